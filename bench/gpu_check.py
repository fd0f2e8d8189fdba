"""The CUDA and NCCL paths that the CPU suite cannot reach, checked on a machine with a GPU.

1. Striped transfer of GPU-resident state: a model and its Adam state on the GPU, served by two
   donors (`StateServer`, each staging its snapshot to host memory) and received by a fresh replica
   whose tensors are on the GPU (`job_agent.transfer.receiver`: slices into host buffers, copied up
   at the end). Checked: the digests agree, every tensor is bit-for-bit the donor's and still on the
   GPU.
2. The regroup a survivor does on NCCL: a group formed on the job's own store
   (`job_agent.rank.store`), an all-reduce, the group aborted from another thread
   (`GroupSockets.abort(nccl=True)`, what the agent does when told to abort), destroyed, and the
   next generation's group formed in the same process under a new store prefix, with an all-reduce
   on it. One GPU gives a world of one: NCCL refuses two ranks on one device, so a failure between
   GPUs stays for a multi-GPU machine.

Run: `.venv/bin/python -m bench.gpu_check` (exit 0: every check held; 1: one failed; 2: no GPU).
`--device cpu` runs both parts on the CPU, part 2 on gloo (a dry run of the script, not a GPU
check).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from job_agent import wire
from job_agent.coordinator.store_server import StoreServer
from job_agent.rank.sever import GroupSockets
from job_agent.rank.state import TrackedState
from job_agent.rank.store import RendezvousStore
from job_agent.transfer import receiver
from job_agent.transfer.donor import StateServer
from job_agent.wire.store import STORE_PREFIX

SECRET = os.urandom(32)
STEP = 11
WAIT = timedelta(seconds=120)


def _state(device: torch.device, seed: int, trained: bool, width: int) -> TrackedState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(8))).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    state = TrackedState(model, opt, {})
    if trained:
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(16, width, device=device)).pow(2).mean().backward()
            opt.step()
    else:
        state.warm()
    return state


def _tensors(s: TrackedState) -> list[torch.Tensor]:
    out = [p.detach() for p in s.model.parameters()]
    assert s.optimizer is not None
    for per_param in s.optimizer.state_dict()["state"].values():
        out += [v for v in per_param.values() if isinstance(v, torch.Tensor)]
    return out


def striped(device: torch.device, width: int = 2048) -> dict[str, object]:
    """Part 1; `width` 2048 is about 400 MB of model and Adam state."""
    donor = _state(device, 0, trained=True, width=width)
    spare = _state(device, 1, trained=False, width=width)
    sources, threads, served = [], [], []
    for slot in range(2):
        server = StateServer(SECRET, "127.0.0.1")
        sources.append(wire.Source(slot=slot, host="127.0.0.1", port=server.port))

        def serve(server: StateServer = server) -> None:
            served.append(server.serve(donor.snapshot(STEP), 1, WAIT, lambda n: None))

        threads.append(threading.Thread(target=serve, daemon=True))
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    stats = receiver.receive_state(spare, sources, SECRET, WAIT)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    for t in threads:
        t.join(30)
    mine, theirs = _tensors(spare), _tensors(donor)
    checks = {
        "digests agree": stats.digest
        == donor.snapshot(STEP).digest()
        == spare.snapshot(STEP).digest(),
        "both donors served the same digest": served == [stats.digest] * 2,
        "two slices, one per donor": sorted(s.donor for s in stats.stripes) == [0, 1],
        "every tensor bit-for-bit the donor's": len(mine) == len(theirs)
        and all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True)),
        f"every tensor still on {device.type}": all(t.device.type == device.type for t in mine),
    }
    return {
        "checks": checks,
        "bytes": stats.nbytes,
        "seconds": round(seconds, 3),
        "MB/s": round(stats.nbytes / seconds / 1e6),
    }


def _group(
    store: RendezvousStore, generation: int, device: torch.device, sockets: GroupSockets
) -> float:
    sockets.forming()
    cuda = device.type == "cuda"
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        store=dist.PrefixStore(f"{STORE_PREFIX}{generation}", store),
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=60),
        device_id=device if cuda else None,
    )
    sockets.formed()
    x = torch.full((1024,), float(generation + 1), device=device)
    dist.all_reduce(x)
    if cuda:
        torch.cuda.synchronize()
    return float(x[0])


def regroup(device: torch.device) -> dict[str, object]:
    """Part 2 (in this process: it leaves no group behind)."""
    server = StoreServer(SECRET, "127.0.0.1")
    store = RendezvousStore("127.0.0.1", server.port, SECRET, timedelta(seconds=60))
    sockets = GroupSockets()
    first = _group(store, 0, device, sockets)
    aborter = threading.Thread(target=sockets.abort, args=(device.type == "cuda",))
    aborter.start()
    aborter.join(30)
    aborted = not aborter.is_alive()
    try:
        dist.destroy_process_group()
    # an aborted group may refuse a clean shutdown: the agent suppresses this too
    except RuntimeError as e:
        print(f"destroy after abort: {e}", file=sys.stderr)
        c10d._world.group_count = 0
    second = _group(store, 1, device, sockets)
    dist.destroy_process_group()
    return {
        "checks": {
            "generation 0 all-reduce": first == 1.0,
            "abort from another thread returned": aborted,
            "generation 1 formed in the same process, all-reduce": second == 2.0,
        }
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--out", type=Path, default=None, help="write the results here as JSON")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing was checked", file=sys.stderr)
        return 2
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    results: dict[str, object] = {
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    }
    results["torch"] = torch.__version__
    results["striped transfer"] = striped(device)
    results["nccl regroup" if device.type == "cuda" else "gloo regroup (dry run)"] = regroup(device)
    ok = all(all(part["checks"].values()) for part in results.values() if isinstance(part, dict))
    results["ok"] = ok
    text = json.dumps(results, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
