"""A training script that never imports torchpass, run as torchrun would run it (`torchpass run
--no-agent`), with what its process can tell the coordinator without the script's help.

`python job_agent/rank/unmodified.py script.py ARGS...` is what each rank runs. The script finds
torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
TORCHELASTIC_RESTART_COUNT...) and forms its own group with `dist.init_process_group()`. Around it,
in the same process:

- the rank connects to the coordinator and heart-beats (a stopped process is a hang);
- each step it completes is read from the script's optimizer: the optimizer's own step count where
  it keeps one (Adam, AdamW, RMSprop...: it is part of the state a checkpoint restores, so a
  restarted rank counts from where its checkpoint left it), else one per `optimizer.step()` since
  the process started;
- a checkpoint is reported with its step: rank 0's `torch.save(obj, path)` or `torch.save(obj, f)`
  on a file it opened, or `torch.distributed.checkpoint.save(..., checkpoint_id=dir)` (seen once the
  script imports that package; the step `get_state_dict` takes to lay out a fresh optimizer is not
  counted);
- an error the script raises is a collective broken by a lost peer (the rank exits, a failure), or
  the script's own bug, reported as such (the job ends as a user error instead of restarting on it);
- the groups the script destroys are kept until it has returned (`GroupKeeper`).

A failure of such a job can only restart the whole job (every rank, the script loading its own last
checkpoint): its incidents are recorded as "not configured for live migration" and never counted as
live.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import queue
import runpy
import sys
import traceback
from collections.abc import Callable
from datetime import timedelta
from importlib.machinery import ModuleSpec
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from job_agent import wire
from job_agent.rank.link import CoordinatorLink, exit_now
from job_agent.rank.loop import step_failure
from job_agent.rank.settings import AgentSettings
from job_agent.rank.tensors import environment, pick_device

EXIT_FAILED = 1


class StepCounter:
    """The steps one rank of an unmodified script completes, measured from its first optimizer."""

    def __init__(self, link: CoordinatorLink, rank: int) -> None:
        self.completed = -1
        self._link, self._rank = link, rank
        self._optimizer: int | None = None
        self._save = torch.save
        self._laying_out = False

    def entering(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        """Before the optimizer's step: the rank is in step k, k steps done (by the optimizer's
        count)."""
        if self._counts(optimizer):
            own = _optimizer_steps(optimizer)
            self._link.send(wire.Step(k=own if own is not None else self.completed + 1))

    def stepped(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        if self._counts(optimizer):
            own = _optimizer_steps(optimizer)
            self.completed = own - 1 if own is not None else self.completed + 1

    def _counts(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether this optimizer's steps are the script's: the first one to step (a GAN's second
        not), and not a step torch takes to lay out the optimizer's state (`_init_optim_state`, zero
        grads)."""
        if self._laying_out:
            return False
        if self._optimizer is None:
            self._optimizer = id(optimizer)
        return id(optimizer) == self._optimizer

    def save(self, obj: object, f: Any, *args: Any, **kwargs: Any) -> None:
        """`torch.save`, and rank 0's saves to a path or a file opened on one reported as the job's
        checkpoints."""
        self._save(obj, f, *args, **kwargs)
        self._saved(f if isinstance(f, str | os.PathLike) else getattr(f, "name", None))

    def watch_dcp(self, dcp: Any) -> None:
        """`torch.distributed.checkpoint.save` (every rank saves its part), reported by rank 0 with
        the checkpoint's directory; `async_save` once its upload completed, with the step it was
        asked at."""
        save, async_save = dcp.save, getattr(dcp, "async_save", None)

        def saved(*args: Any, **kwargs: Any) -> Any:
            out = save(*args, **kwargs)
            self._saved(_dcp_dir(kwargs))
            return out

        def saved_later(*args: Any, **kwargs: Any) -> Any:
            step, where = self.completed, _dcp_dir(kwargs)
            out = async_save(*args, **kwargs)  # type: ignore[misc]
            # an AsyncSaveResponse, or the upload's future
            done = getattr(out, "upload_completion", out)

            def uploaded(f: Any) -> None:
                if f.exception() is None:  # a failed save is no checkpoint
                    self._saved(where, step)

            done.add_done_callback(uploaded)
            return out

        dcp.save = saved
        if async_save is not None:
            dcp.async_save = saved_later

    def watch_dcp_state_dict(self, module: Any) -> None:
        """`get_state_dict` steps a fresh optimizer once at lr 0 to make its state: not a training
        step."""
        init = module._init_optim_state

        def laying_out(optimizer: torch.optim.Optimizer) -> None:
            self._laying_out = True
            try:
                init(optimizer)
            finally:
                self._laying_out = False

        module._init_optim_state = laying_out

    def _saved(self, where: object, step: int | None = None) -> None:
        step = self.completed if step is None else step
        if self._rank == 0 and step >= 0 and isinstance(where, str | os.PathLike):
            path = str(Path(where).resolve())[:4000]
            self._link.send(wire.CheckpointSaved(step=step, path=path))


def _dcp_dir(kwargs: dict[str, Any]) -> object:
    return kwargs.get("checkpoint_id") or getattr(kwargs.get("storage_writer"), "path", None)


class _OnImport(importlib.abc.MetaPathFinder):
    """Calls `then(module)` once the script imports `name` (torch's checkpoint package costs most of
    a second to import: a script that never uses it does not pay for it)."""

    def __init__(self, name: str, then: Callable[[Any], None]) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> ModuleSpec | None:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        run, then = spec.loader.exec_module, self.then

        def exec_module(module: Any) -> None:
            run(module)
            then(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


class GroupKeeper:
    """Holds the process groups the script destroys until the script has returned, then lets them
    go.

    Torch 2.13 can wedge a rank for good as its script returns: `destroy_process_group()` leaves
    DDP's reducer the last owner of the gloo group, and when the reducer is freed (the script's
    `main()` returning) the group's destructor joins its worker threads while holding the GIL. A
    worker still releasing its last collective's tensors needs the GIL to do it: neither moves, the
    heartbeats stop, and the rank is a hang after its last step (4 ranks ending DDP + DCP this way
    wedged 5 times in 8 on 2 cores). A group let go from Python is destroyed with the GIL released,
    so nothing waits on it."""

    def __init__(self) -> None:
        self.kept: list[object] = []
        self._destroy = c10d.destroy_process_group

    def install(self) -> None:
        dist.destroy_process_group = c10d.destroy_process_group = self.destroy

    def destroy(self, group: Any = None) -> None:
        self.kept.extend(list(c10d._world.pg_map) if group is None else [group])
        self._destroy(group)

    def release(self) -> None:
        self.kept.clear()


def _optimizer_steps(optimizer: torch.optim.Optimizer) -> int | None:
    """The optimizer's own count of steps taken (its state's `step`), where it keeps one."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            step = optimizer.state.get(p, {}).get("step")
            if isinstance(step, torch.Tensor | int | float):
                return int(step)
    return None


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit("usage: unmodified.py SCRIPT [ARGS...]")
    s = AgentSettings.model_validate({})
    hello = s.hello(wire.Role(s.role), s.slot, environment(pick_device(s.device, s.local_rank)))
    link = CoordinatorLink(
        *s.coordinator_addr, s.read_secret(), hello, timedelta(seconds=s.heartbeat_interval)
    )
    counter = StepCounter(link, s.slot)
    register_optimizer_step_pre_hook(counter.entering)
    register_optimizer_step_post_hook(counter.stepped)
    torch.save = counter.save
    sys.meta_path.insert(0, _OnImport("torch.distributed.checkpoint", counter.watch_dcp))
    sys.meta_path.insert(
        0, _OnImport("torch.distributed.checkpoint.state_dict", counter.watch_dcp_state_dict)
    )
    link.send(wire.Ready(completed=-1, steps=0))
    _await_group(link)
    sys.argv = list(argv)
    sys.path.insert(0, str(Path(argv[0]).resolve().parent))  # as `python script.py` would
    groups = GroupKeeper()
    groups.install()
    try:
        runpy.run_path(argv[0], run_name="__main__")
        groups.release()
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    except Exception as e:
        # the script's own bug: reported
        if step_failure(counter.completed + 1, e, link.send) is None:
            raise
        traceback.print_exception(e)
        exit_now(
            EXIT_FAILED, f"rank {s.slot}: a collective failed (a peer was lost); the job restarts"
        )
    link.send(wire.Done(step=counter.completed, digest=""))
    while not isinstance(link.inbox.get(timeout=s.recovery_timeout), wire.Exit):
        pass
    link.close()


def _await_group(link: CoordinatorLink) -> None:
    """Wait for the coordinator to start the job: the script forms its own group; say it joined."""
    while True:
        try:
            frame = link.inbox.get(timeout=300)
        except queue.Empty:
            exit_now(EXIT_FAILED, "the coordinator never started the job")
        match frame:
            case wire.Regroup(generation=generation):
                link.send(wire.Joined(generation=generation, completed=-1))
                return
            case wire.Exit(code=code, reason=reason):
                exit_now(code, reason)


if __name__ == "__main__":
    main(sys.argv[1:])
