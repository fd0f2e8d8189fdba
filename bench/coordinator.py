"""Coordinator cost as the job grows: 64, 256 and 1,024 simulated ranks.

The real `Coordinator` (control channel, detector, step tracker, spare pool) runs in this process;
the ranks are simulated in a second process (a few threads, each multiplexing its share of them),
each rank with a connection of its own speaking the real control protocol over real authenticated
sockets: Hello, Ready, Joined after the Regroup, a heartbeat every 0.2 s (the agent's default) and a
step a second (Step and Collective, as a rank sends them). No torch. For each size, in one
invocation: this process's CPU time per second of wall time while every rank trains (the
coordinator's whole cost: reader threads, decoding, MAC checks, the event loop), and the time from a
simulated rank's loss (its connection closed, its process gone) to the incident's report leaving the
coordinator (what starts the incident workflow). Target: detection time flat, CPU linear in the
ranks or better. Writes its block of docs/benchmarks.md. Run: `.venv/bin/python -m
bench.coordinator` (about two minutes).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path

from bench import write_block
from job_agent.launch.launcher import Launcher

SIZES = (64, 256, 1024)
WINDOW = 5.0  # seconds of steady training over which the CPU is measured
STEP_EVERY = 1.0
LOSSES = 3  # losses measured per size (one job each), the median reported


# --- the simulated ranks (their own process)
# ------------------------------------------------------------

# each multiplexes its share of the ranks with select(): 1,024 threads of one process
SIM_THREADS = 8
# spend their time fighting over the GIL, not speaking the protocol


class _SimRank:
    def __init__(self, env: Mapping[str, str]) -> None:
        from job_agent import wire
        from job_agent.rank.settings import AgentSettings
        from job_agent.wire import protocol

        fields = {k[10:].lower(): v for k, v in env.items() if k.startswith("TORCHPASS_")}
        s = self.settings = AgentSettings.model_validate(fields)
        self.layout = wire.ShardLayout(shard="simulated-replica")
        self.sock = protocol.connect(*s.coordinator_addr, s.read_secret(), timedelta(seconds=60))
        hello = wire.Hello(agent_id=s.agent_id, role=wire.Role(s.role), slot=s.slot, pid=1)
        protocol.send_frame(self.sock, hello)
        if not isinstance(protocol.recv_frame(self.sock), wire.Welcome):
            raise ConnectionError(f"{s.agent_id} refused")
        protocol.send_frame(self.sock, wire.Ready(completed=-1, steps=10**9, layout=self.layout))
        self.completed, self.training = -1, False
        self.beat = self.step = time.monotonic()

    def due(self) -> float:
        return min(self.beat, self.step) if self.training else self.beat

    def tick(self, now: float) -> None:
        from job_agent import wire
        from job_agent.wire import protocol

        if now >= self.beat:
            protocol.send_frame(self.sock, wire.Heartbeat())
            self.beat = now + self.settings.heartbeat_interval
        if self.training and now >= self.step:
            self.completed += 1
            protocol.send_frame(self.sock, wire.Step(k=self.completed))
            protocol.send_frame(self.sock, wire.Collective(k=self.completed))
            self.step = now + STEP_EVERY

    def read(self) -> bool:
        """One frame from the coordinator, answered as a rank would; False once told to exit."""
        from job_agent import wire
        from job_agent.wire import protocol

        frame = protocol.recv_frame(self.sock)
        if isinstance(frame, wire.Regroup):
            self.training = True
            joined = wire.Joined(
                generation=frame.generation, completed=self.completed, layout=self.layout
            )
            protocol.send_frame(self.sock, joined)
        elif isinstance(frame, wire.Freeze):
            self.training = False
            protocol.send_frame(self.sock, wire.Frozen(completed=self.completed, reason="freeze"))
        return not isinstance(frame, wire.Exit)


class _SimThread:
    """Simulated ranks sharing one thread: each heart-beats and steps on its own clock."""

    def __init__(self) -> None:
        self.ranks: dict[str, _SimRank] = {}
        self.new: list[Mapping[str, str]] = []
        self.lost: list[str] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        from job_agent.wire import protocol

        while True:
            with self.lock:
                new, self.new = self.new, []
                lost, self.lost = self.lost, []
            for env in new:
                with contextlib.suppress(OSError, ConnectionError, protocol.ProtocolError):
                    r = _SimRank(env)
                    self.ranks[r.settings.agent_id] = r
            for agent in lost:
                if (gone := self.ranks.pop(agent, None)) is not None:
                    with contextlib.suppress(OSError):
                        gone.sock.shutdown(socket.SHUT_RDWR)
                    gone.sock.close()
            now = time.monotonic()
            wait = min((r.due() for r in self.ranks.values()), default=now + 0.05) - now
            poll = select.poll()  # select() stops at descriptor 1023
            by_fd = {r.sock.fileno(): r for r in self.ranks.values()}
            for fd in by_fd:
                poll.register(fd, select.POLLIN)
            for fd, _ in poll.poll(1000 * min(0.05, max(0.0, wait))):
                r = by_fd[fd]
                try:
                    alive = r.read()
                except (OSError, ConnectionError, protocol.ProtocolError):
                    alive = False
                if not alive:
                    self.ranks.pop(r.settings.agent_id, None)
                    r.sock.close()
            now = time.monotonic()
            for r in list(self.ranks.values()):
                with contextlib.suppress(OSError):
                    r.tick(now)


def simulate() -> None:
    """Read commands on stdin: a rank to start (its environment), or one to lose (its socket
    closed)."""
    threads = [_SimThread() for _ in range(SIM_THREADS)]
    where: dict[str, _SimThread] = {}
    for n, line in enumerate(sys.stdin):
        cmd = json.loads(line)
        if "lose" in cmd:
            t = where.get(cmd["lose"])
            if t is not None:
                with t.lock:
                    t.lost.append(cmd["lose"])
        else:
            t = where[cmd["env"]["TORCHPASS_AGENT_ID"]] = threads[n % SIM_THREADS]
            with t.lock:
                t.new.append(cmd["env"])


# --- the coordinator's side (this process)
# --------------------------------------------------------------


class SimLauncher(Launcher):
    """A `Launcher` whose processes are threads of the simulator process."""

    def __init__(self) -> None:
        self.sim = subprocess.Popen(
            [sys.executable, "-m", "bench.coordinator", "simulate"],
            stdin=subprocess.PIPE,
            text=True,
        )
        self.codes: dict[str, int | None] = {}
        # the job is over: its simulated ranks leave when told (Exit), as real ones do
        self.ended = False
        self._lock = threading.Lock()

    def _tell(self, cmd: dict[str, object]) -> None:
        assert self.sim.stdin is not None
        with self._lock:
            self.sim.stdin.write(json.dumps(cmd) + "\n")
            self.sim.stdin.flush()

    def spawn(self, agent_id: str, env: Mapping[str, str]) -> str:
        self.codes[agent_id] = None
        self._tell({"env": {k: v for k, v in env.items() if k.startswith("TORCHPASS_")}})
        return "sim-host"

    def lose(self, agent_id: str) -> None:
        self.codes[agent_id] = -9
        self._tell({"lose": agent_id})

    def kill(self, agent_id: str) -> None:
        self.lose(agent_id)

    def suspend(self, agent_id: str) -> None:  # not used here
        pass

    def resume(self, agent_id: str) -> None:
        pass

    def poll(self, agent_id: str) -> int | None:
        return 0 if self.ended and self.codes.get(agent_id) is None else self.codes.get(agent_id)

    def pid(self, agent_id: str) -> int | None:
        return None

    def shutdown(self, timeout: timedelta) -> None:
        self.sim.kill()
        self.sim.wait(10)


async def one(n: int, state: Path) -> tuple[float, float, float]:
    """(CPU seconds per second while training, heartbeats per second, seconds from loss to
    report)."""
    from job_agent.coordinator.coordinator import Coordinator
    from job_agent.wire.rank import Role
    from torchpass.job import JobSpec, JobState
    from torchpass.models import FailureReport

    launcher = SimLauncher()
    reported = asyncio.Event()
    seen: list[float] = []

    async def report(workflow_id: str, report: FailureReport) -> None:
        if not seen:
            seen.append(time.monotonic())
            reported.set()

    spec = JobSpec(
        job_id=f"bench-coord-{n}",
        script=Path(__file__),
        nproc=n,
        spares=1,
        state_dir=state,
        hang_timeout=5.0,
        checkpoint_every=0,
        startup_timeout=300.0,
        control_plane_wait=3600.0,
    )
    c = Coordinator(spec, report, launcher)
    run = asyncio.ensure_future(c.run())
    try:

        def stepping() -> int:
            return min(
                (m.step or 0 for m in c.roster.members.values() if m.role is Role.RANK), default=0
            )

        started = said = time.monotonic()
        while c.state is JobState.STARTING or stepping() < 2:
            assert not run.done(), run.result().error
            assert time.monotonic() - started < 120, (
                f"{n} ranks: {len(c.roster.ranks())} in, {c.state}"
            )
            if time.monotonic() - said > 10:
                said = time.monotonic()
                print(
                    f"  {n} ranks: {len(c.roster.ranks())} in, {c.state}, step {stepping()}",
                    file=sys.stderr,
                )
            await asyncio.sleep(0.1)
        cpu0, t0 = time.process_time(), time.monotonic()
        await asyncio.sleep(WINDOW)
        cpu = (time.process_time() - cpu0) / (time.monotonic() - t0)
        victim = next(m.agent_id for m in c.roster.members.values() if m.slot == n // 2)
        lost_at = time.monotonic()
        launcher.lose(victim)
        await asyncio.wait_for(reported.wait(), 60)
        return cpu, n / 0.2, seen[0] - lost_at
    finally:
        launcher.ended = True
        c.fail("the benchmark is over")
        with contextlib.suppress(Exception):
            # past it (filing waits for a workflow there is not): cancelled
            await asyncio.wait_for(run, 5)
        launcher.shutdown(timedelta(seconds=5))


async def main() -> int:
    rows: dict[int, list[tuple[float, ...]]] = {}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="torchpass-bench-coord-") as tmp:
        for n in SIZES:
            for k in range(LOSSES):
                # Each job in a fresh process: nothing one leaves behind (threads, sockets) weighs
                # on the next.
                cmd = [
                    sys.executable,
                    "-m",
                    "bench.coordinator",
                    "one",
                    str(n),
                    str(Path(tmp) / f"{n}-{k}"),
                ]
                out = subprocess.run(
                    cmd, stdout=subprocess.PIPE, text=True, timeout=300, check=True
                ).stdout
                rows.setdefault(n, []).append(tuple(json.loads(out.splitlines()[-1])))
                print(f"{n} ranks, run {k}: {rows[n][-1]}", flush=True)
    seconds = time.monotonic() - t0
    base_cpu = _median([r[0] for r in rows[SIZES[0]]])
    base_detect = _median([r[2] for r in rows[SIZES[0]]])
    lines = [
        f"## Coordinator cost as the job grows ({datetime.now(UTC):%Y-%m-%d}, `python -m "
        "bench.coordinator`)",
        "",
        "The real coordinator in one process; the ranks simulated in another (8 threads "
        "multiplexing them), on the real",
        "authenticated control protocol: a heartbeat every 0.2 s, a step (Step + Collective) a "
        "second, no",
        f"torch. CPU: the coordinator's process, per second of wall time over {WINDOW:.0f} s of "
        "training.",
        "Detection: a rank's connection closed and its process gone -> the incident's report "
        "leaves the",
        f"coordinator. Median of {LOSSES} jobs per size; one invocation, {seconds:.0f} s on this "
        "2-core machine",
        "(the simulator shares it).",
        "",
        "| ranks | frames/s in | coordinator CPU (s/s) | CPU / rank vs 64 | detection | vs 64 |",
        "|---|---|---|---|---|---|",
    ]
    for n, rs in rows.items():
        cpu, rate, detect = _median([r[0] for r in rs]), rs[0][1], _median([r[2] for r in rs])
        per_rank = (cpu / n) / (base_cpu / SIZES[0])
        frames = rate + 2 * n / STEP_EVERY
        lines.append(
            f"| {n} | {frames:.0f} | {cpu:.3f} | {per_rank:.2f} | {detect * 1000:.0f} ms | "
            f"{detect / base_detect:.2f} |"
        )
    print("\n".join(lines))
    write_block("coordinator", lines)
    return 0


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


if __name__ == "__main__":
    if sys.argv[1:] == ["simulate"]:
        simulate()
    elif sys.argv[1:2] == ["one"]:
        print(json.dumps(asyncio.run(one(int(sys.argv[2]), Path(sys.argv[3])))), flush=True)
        os._exit(0)  # the job's reader threads and the simulator's connections end with the process
    else:
        sys.exit(asyncio.run(main()))
