"""Cutting a rank's side of its groups (`job_agent.rank.sever.GroupSockets`), with two real gloo
processes: rank 0 blocks in a collective that rank 1 never joins, on a sub-group made after the
job's group formed (as a script's own `dist.new_group`, or a mesh made late, is); the cut makes it
fail at once instead of at the group's timeout. Before, only the sockets that appeared while the
job's group formed were recorded, so a freeze left that collective blocked."""

from __future__ import annotations

import multiprocessing as mp
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from job_agent.rank.sever import GroupSockets

TIMEOUT = 30.0  # the groups' own timeout: far longer than the cut may take


def _rank(rank: int, store_path: str, out: mp.Queue) -> None:
    sockets = GroupSockets()
    sockets.watch_new_groups()
    sockets.forming()
    store = dist.FileStore(store_path, 2)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=TIMEOUT)
    )
    sockets.formed()
    sub = dist.new_group([0, 1])  # the script's own, once the job's group formed
    dist.barrier()
    if rank == 1:  # never joins rank 0's collective; waits to be told it is over
        time.sleep(TIMEOUT)
        return
    work = dist.all_reduce(torch.ones(1), group=sub, async_op=True)
    time.sleep(0.5)  # blocked now, on rank 1
    t0 = time.monotonic()
    cut = sockets.cut()
    try:
        work.wait()
        out.put(("completed", cut, time.monotonic() - t0))
    except RuntimeError:
        out.put(("failed", cut, time.monotonic() - t0))


def test_a_collective_on_a_sub_group_made_after_formation_fails_when_cut(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    store = str(tmp_path / "store")
    procs = [ctx.Process(target=_rank, args=(r, store, out), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        how, cut, seconds = out.get(timeout=TIMEOUT + 30)
    finally:
        for p in procs:
            p.kill()
            p.join(10)
    assert cut > 0, "no socket of the sub-group was recorded"
    assert how == "failed" and seconds < 5, (how, seconds)
