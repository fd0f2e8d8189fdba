"""Node agents started on this host for a multi-node job: `torchpass run --nnodes N` (the one-host
quick start, as torchrun's single command) and the demo.

Each is a real `torchpass node` process, started once the job's coordinator has registered (its
address and secret exist), in a session of its own so that losing a node is one signal to that
session (the agent and, through their parent-death signal, its ranks). A node may run under a
command prefix, such as `ip netns exec NS` for a network namespace of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

from temporalio.client import Client

from torchpass.job import JobResult, JobSpec
from workers.job import run_job

log = logging.getLogger("torchpass.nodes")
REGISTER_TIMEOUT = timedelta(seconds=60)


@dataclass(frozen=True)
class LocalNode:
    name: str
    slots: int
    spares: int
    host: str  # the address its processes advertise: every node its own
    prefix: tuple[str, ...] = ()  # e.g. ("ip", "netns", "exec", NS)


def plan(
    nnodes: int, per_node: int, spares_per_node: int, spare_nodes: int, host: str
) -> list[LocalNode]:
    """`nnodes` nodes of `per_node` ranks and `spares_per_node` warm spares each, and `spare_nodes`
    spare nodes each keeping enough warm spares to take a whole node's ranks."""
    nodes = [LocalNode(f"node{i}", per_node, spares_per_node, host) for i in range(nnodes)]
    return nodes + [LocalNode(f"spare{i}", 0, per_node, host) for i in range(spare_nodes)]


async def coordinator_address(spec: JobSpec) -> str:
    """host:port of the job's coordinator once it registered (its secret written beside it)."""
    deadline = time.monotonic() + REGISTER_TIMEOUT.total_seconds()
    while True:
        with contextlib.suppress(OSError, ValueError, KeyError):
            info = json.loads((spec.job_dir / "job.json").read_text())
            if (spec.job_dir / "secret").exists():
                return str(info["coordinator"])
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {spec.job_id} never registered its coordinator")
        await asyncio.sleep(0.05)


async def print_node_command(spec: JobSpec) -> None:
    """What to run on each host of a job whose nodes are started elsewhere (`torchpass run
    --remote`)."""
    print(node_command(spec, await coordinator_address(spec)), flush=True)


def node_command(spec: JobSpec, address: str) -> str:
    """What to run on each host of a multi-node job."""
    per_node = spec.nproc // spec.nodes if spec.nproc % spec.nodes == 0 else "P"
    argv = " ".join([str(spec.script), *spec.args])
    return (
        f"torchpass: job {spec.job_id} waits for {spec.nodes} node(s); on each host run\n  "
        f"torchpass node --job {spec.job_id} --coordinator {address} --secret-file SECRET --host "
        f"ADDRESS --slots {per_node} --spares K {argv}\n(SECRET: a copy of "
        f"{spec.job_dir / 'secret'} readable by that host's user alone; ADDRESS: the host's own, "
        "reachable from every other; --slots 0: a spare node)"
    )


class LocalNodes:
    """The job's node agents on this host: `start` them, `lose` one (SIGKILL to its session),
    `close`."""

    def __init__(self, spec: JobSpec, nodes: Sequence[LocalNode]) -> None:
        self.spec = spec
        self.nodes = {n.name: n for n in nodes}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    async def start(self) -> None:
        """Once the coordinator registered: every node, spare nodes first (they hold no slot), then
        the others in order, each joined before the next starts (the first holds ranks 0..P-1)."""
        address = await coordinator_address(self.spec)
        ordered = sorted(self.nodes.values(), key=lambda n: n.slots > 0)
        for n in ordered:
            self.procs[n.name] = self._start(n, address)
            if n.slots:
                await self._joined(n)

    def _start(self, n: LocalNode, coordinator: str) -> subprocess.Popen[bytes]:
        s = self.spec
        argv = [*n.prefix, sys.executable, "-m", "torchpass.cli", "node", "--job", s.job_id]
        argv += [
            "--coordinator",
            coordinator,
            "--secret-file",
            str(s.job_dir / "secret"),
            "--host",
            n.host,
        ]
        argv += ["--name", n.name, "--slots", str(n.slots), "--spares", str(n.spares)]
        return subprocess.Popen(
            [*argv, str(s.script), *s.args], stdin=subprocess.DEVNULL, start_new_session=True
        )

    async def _joined(self, n: LocalNode) -> None:
        """Until the coordinator has admitted `n` (its slots are placed in join order)."""
        from job_agent import wire
        from job_agent.coordinator.jobs import request

        deadline = time.monotonic() + REGISTER_TIMEOUT.total_seconds()
        while time.monotonic() < deadline:
            p = self.procs[n.name]
            if p.poll() is not None:
                raise RuntimeError(f"node {n.name} exited ({p.returncode}) before it joined")
            with contextlib.suppress(OSError, ValueError):
                s = await asyncio.to_thread(
                    request, self.spec.state_dir, self.spec.job_id, wire.StatusRequest()
                )
                if isinstance(s, wire.Status) and n.name in s.nodes:
                    return
            await asyncio.sleep(0.05)
        raise TimeoutError(f"node {n.name} did not join job {self.spec.job_id}")

    async def lose_at(self, name: str, step: int) -> None:
        """Lose node `name` whole once every rank has passed `step` with no incident in progress."""
        from job_agent import wire
        from job_agent.coordinator.jobs import request

        while True:
            s = await asyncio.to_thread(
                request, self.spec.state_dir, self.spec.job_id, wire.StatusRequest()
            )
            if (
                isinstance(s, wire.Status)
                and s.ranks
                and min(r.step for r in s.ranks) >= step
                and not s.incident
            ):
                break
            await asyncio.sleep(0.05)
        self.lose(name)

    def lose(self, name: str) -> None:
        """The node is gone at once: its agent and, with it, every one of its processes."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.procs[name].pid, signal.SIGKILL)

    def close(self) -> None:
        """Each agent leaves when its job ends; any still here (the job failed to start) is
        stopped."""
        for p in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)
                continue
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)


async def run_on_local_nodes(spec: JobSpec, client: Client, nodes: LocalNodes) -> JobResult:
    """Run the job with its node agents started here; they leave with it."""
    job = asyncio.create_task(run_job(spec, client))
    starting = asyncio.create_task(nodes.start())
    try:
        await asyncio.wait({job, starting}, return_when=asyncio.FIRST_EXCEPTION)
        if starting.done() and starting.exception() is not None:
            # The job fails at its start-up timeout, saying which nodes came; this says why one did
            # not.
            log.error("starting the job's node agents failed: %s", starting.exception())
        return await job
    finally:
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await starting
        await asyncio.to_thread(nodes.close)
