"""The harness of the job side's fast tests: a real Coordinator over fake ranks, driven as
MigrationWorkflow.

`Job` runs a real `Coordinator` with `fake_ranks.FakeLauncher` and, on leaving, checks that the job
ended and left nothing running; `Migration` calls the job-side activities' `IncidentSteps` directly,
in the workflow's order, and keeps what each answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import threading
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TypeVar

from job_agent.coordinator.coordinator import Coordinator
from job_agent.coordinator.incident.executor import IncidentSteps
from job_agent.coordinator.incident.lifecycle import IncidentError
from job_agent.coordinator.incident.local import LocalRecovery
from tests.unit.fake_ranks import FakeLauncher
from torchpass.errors import ErrorType
from torchpass.incident import steps as st
from torchpass.incident.classify import classify, classify_input
from torchpass.incident.decisions import RecoveryAction, plan_recovery
from torchpass.incident.outcome import Ending, MigrationOutcome, build_outcome
from torchpass.incident.proof import resume_problems, transfer_problems
from torchpass.job import JobResult, JobSpec, JobState
from torchpass.models import Classification, Disposition, FailureReport

# any script: the fakes ignore it
SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_dp.py"
STEPS = 16
WAIT = 10.0  # seconds: the bound on every wait of a test
T = TypeVar("T")
Counts = tuple[int, ...]  # Python threads, OS threads, open file descriptors


SHARED_PEERS: set[str] = set()
"""'host:port' of the Temporal servers the session's fixtures hold clients of: their connection
pools open and close connections whenever they like, so a socket to one is never a job's leak."""

FOREIGN_THREADS = ("tokio-",)
"""OS thread names of the Temporal client's runtime (Rust, tokio): a client an earlier test made
spawns blocking threads on demand (name lookups) that live 10 s idle. The job under test never uses
Temporal (its reports go to a queue), so such a thread is never its leak. Found when a CI run
counted two more OS threads than Python threads after a test, both gone by the time anyone
looked."""


def os_threads() -> dict[str, str]:
    """Each OS thread of this process that is not a foreign runtime's: its id and name."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            name = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            if not name.startswith(FOREIGN_THREADS):
                out[tid] = name
    return out


def counts() -> Counts:
    fds = len(os.listdir("/proc/self/fd"))
    if SHARED_PEERS:
        fds -= sum(
            1
            for what in fd_targets().values()
            if what.split(" -> ")[-1].split(" ")[0] in SHARED_PEERS
        )
    return threading.active_count(), len(os_threads()), fds


def fd_targets() -> dict[str, str]:
    """What each open descriptor is (a socket with its addresses, a pipe, a file): the diagnosis
    when a test leaks one."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
    sockets = _socket_ends()
    return {fd: f"{what} {sockets.get(what[8:-1], '')}".strip() for fd, what in out.items()}


def _socket_ends() -> dict[str, str]:
    """inode -> 'local -> remote (state)' of this process's TCP sockets, from /proc/net/tcp."""
    ends = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/net/tcp").read_text().splitlines()[1:]:
            f = line.split()
            ends[f[9]] = f"{_addr(f[1])} -> {_addr(f[2])} (state {f[3]})"
    return ends


def _addr(hex_addr: str) -> str:
    host, port = hex_addr.split(":")
    return ".".join(str(b) for b in reversed(bytes.fromhex(host))) + f":{int(port, 16)}"


async def bounded(call: Awaitable[T]) -> T:
    return await asyncio.wait_for(call, WAIT)


async def until(pred: Callable[[], bool], what: str, timeout: float = WAIT) -> None:
    """Until `pred()` holds; fails after `timeout` seconds naming `what` it waited for."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        await asyncio.sleep(0.01)  # the poll's interval


def poll_until(pred: Callable[[], bool], what: str, timeout: float = WAIT) -> None:
    """`until` for code that is not async: blocks the calling thread."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.01)  # the poll's interval


async def quiet() -> Counts:
    """The counts once no control server's threads remain and what they kept alive is collected."""
    names = ("(_serve)", "torchpass-accept")  # the control server's reader and accept threads
    await until(
        lambda: not [t for t in threading.enumerate() if t.name.endswith(names)],
        "the control server's threads to end",
    )
    gc.collect()
    now = counts()
    for _ in range(100):  # a native thread of a store just destroyed may still be exiting
        await asyncio.sleep(0.03)
        if now == (now := counts()):
            break
    return now


class Job:
    """A real coordinator over fake ranks; leaving it, the job has ended and left nothing
    running."""

    def __init__(
        self,
        tmp: Path,
        allowance: Counts | None,
        nproc: int = 3,
        spares: int = 1,
        ckpt: int = 0,
        local: bool = False,
        hang_timeout: float = 0.5,
    ) -> None:
        self.launcher = FakeLauncher(steps=STEPS)
        self.spec = JobSpec(
            script=SCRIPT,
            nproc=nproc,
            spares=spares,
            state_dir=tmp,
            hang_timeout=hang_timeout,
            collective_timeout=5.0,
            checkpoint_every=ckpt,
            startup_timeout=WAIT,
            control_plane_wait=0.5,
        )
        self.reports: asyncio.Queue[tuple[str, FailureReport]] = asyncio.Queue()
        # the job recovers by itself when no step comes, as `torchpass run` wires it
        self.local = local
        self.down = False  # Temporal unreachable: every report fails
        self.attempts = 0
        self.result: JobResult | None = None
        self._allowance = allowance

    async def _report(self, workflow_id: str, report: FailureReport) -> None:
        self.attempts += 1
        if self.down:
            raise ConnectionError("Temporal is down (the test says so)")
        await self.reports.put((workflow_id, report))

    async def __aenter__(self) -> Job:
        self._before = await quiet()
        self._fds = fd_targets()
        self._tasks = os_threads()
        self.coordinator = c = Coordinator(self.spec, self._report, self.launcher)
        wait = timedelta(seconds=WAIT)
        self.steps = IncidentSteps(c, wait, wait, spare_wait=timedelta(seconds=2))
        if self.local:
            LocalRecovery(self.steps)
        self._run = asyncio.ensure_future(c.run())
        await until(lambda: c.state is not JobState.STARTING, "the ranks to start")
        return self

    async def report(self) -> tuple[str, FailureReport]:
        return await bounded(self.reports.get())

    async def finished(self) -> JobResult:
        self.result = await bounded(asyncio.shield(self._run))
        return self.result

    async def __aexit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is not None:  # stop the job, past its shutdown's grace; the test's own error stands
            self.coordinator.fail(f"the test failed: {exc!r}")
            await asyncio.wait_for(asyncio.shield(self._run), 3 * WAIT)
            return
        self.result = await bounded(asyncio.shield(self._run))
        assert isinstance(self.result, JobResult)
        await until(lambda: not self.launcher.threads(), "the fake ranks to end")
        assert not [t.name for t in threading.enumerate() if t.name.startswith("fake-rank")]
        if self._allowance is not None:
            limit = tuple(b + a for b, a in zip(self._before, self._allowance, strict=True))
            deadline = time.monotonic() + WAIT
            while any(n > m for n, m in zip(counts(), limit, strict=True)):
                if time.monotonic() >= deadline:
                    new = {
                        fd: what for fd, what in fd_targets().items() if self._fds.get(fd) != what
                    }
                    born = sorted(
                        name for tid, name in os_threads().items() if tid not in self._tasks
                    )
                    raise AssertionError(
                        f"leaked: (threads, tasks, fds) {counts()} > {limit}; new fds {new}; new "
                        f"tasks {born}"
                    )
                await asyncio.sleep(0.01)
                # as `quiet` did before counting: a socket in a reference cycle waits for it
                gc.collect()


def _check(problems: list[str]) -> None:
    """MigrationWorkflow checks the proof again on what the job answered."""
    if problems:
        raise IncidentError(ErrorType.PROOF_MISMATCH, "proof does not hold: " + "; ".join(problems))


class Migration:
    """MigrationWorkflow's run with its job-side activities called directly: confirm, classify, then
    reserve, freeze, transfer and rejoin (each proof checked again), or release and restart from the
    checkpoint; then complete. What each step answered, and the error of the one that failed, are
    kept."""

    def __init__(self, job: Job, workflow_id: str, report: FailureReport) -> None:
        self.steps, self.evidence = job.steps, [report.evidence]
        self.ref = st.IncidentRef(workflow_id=workflow_id, run_id="run-1", job_id=job.spec.job_id)
        self.incident_id = self.ref.incident_id
        self.started_at = datetime.now(UTC)
        self.confirmed: st.ConfirmResult | None = None
        self.reserved: st.ReserveResult | None = None
        self.frozen: st.FreezeResult | None = None
        self.transferred: st.TransferResult | None = None
        self.rejoined: st.RejoinResult | None = None
        self.fallback: st.FallbackResult | None = None
        self.failed: dict[str, IncidentError] = {}

    async def confirm(self) -> st.ConfirmResult:
        self.confirmed = await bounded(self.steps.confirm(self.ref, tuple(self.evidence)))
        return self.confirmed

    async def run(self) -> MigrationOutcome:
        confirm = self.confirmed or await self.confirm()
        c = self._classify(confirm)
        action = plan_recovery(c, confirm)
        if action is RecoveryAction.MIGRATE:
            c, ending = await self._migrate(confirm, c)
        elif action is RecoveryAction.FALLBACK:
            ending = await self._fall_back(c.reason)
        else:
            ending = Ending(disposition=Disposition.NOT_A_FAILURE)
        kind, started = c.kind or self.evidence[0].kind, self.started_at
        outcome = build_outcome(
            self.incident_id, self.evidence, kind, c, confirm, ending, started, ()
        )
        await bounded(self.steps.complete(self.ref, outcome))
        return outcome

    def _classify(self, confirm: st.ConfirmResult, spare_lost: bool = False) -> Classification:
        return classify(classify_input(tuple(self.evidence), confirm, spare_lost))

    async def _migrate(
        self, confirm: st.ConfirmResult, c: Classification
    ) -> tuple[Classification, Ending]:
        try:
            self.reserved = await bounded(self.steps.reserve(self.ref))
        except IncidentError as e:
            self.failed["reserve"] = e
            if e.error_type is ErrorType.NO_SPARE:
                c = self._classify(confirm, spare_lost=True)
                return c, await self._fall_back(c.reason)
            await bounded(self.steps.release(self.ref))
            return c, await self._fall_back(str(e))
        step = "freeze"
        try:
            self.frozen = await bounded(self.steps.freeze(self.ref))
            step = "transfer"
            self.transferred = await bounded(self.steps.transfer(self.ref, lambda sent: None))
            _check(transfer_problems(self.transferred.proof, self.frozen.target_step))
            step = "rejoin"
            self.rejoined = await bounded(self.steps.rejoin(self.ref))
            _check(resume_problems(self.rejoined.resumed_steps, self.rejoined.resumed_step))
        except IncidentError as e:
            self.failed[step] = e
            # the compensation, then the classic restart
            await bounded(self.steps.release(self.ref))
            return c, await self._fall_back(str(e))
        return c, Ending(Disposition.MIGRATED, proof=self.transferred.proof, rejoin=self.rejoined)

    async def _fall_back(self, reason: str) -> Ending:
        try:
            self.fallback = await bounded(self.steps.restart_from_checkpoint(self.ref, reason))
        except IncidentError as e:
            self.failed["fallback"] = e
            return Ending(Disposition.FAILED, error=f"{reason}; fallback: {e}")
        return Ending(Disposition.FALLBACK_RESTART, fallback=self.fallback, error=reason)
