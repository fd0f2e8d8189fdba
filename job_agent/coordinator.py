"""The per-job coordinator: membership, failure detection, and the job side of every incident.

It runs off the training ranks (so no training node is special): it hosts the rendezvous store, launches
the ranks and a pool of warm spares, takes heartbeats and step progress over the authenticated control
channel, detects a lost or hung rank and reports it (the caller turns reports into incident workflows).
The recovery steps themselves (`job_agent.incident.IncidentActions`) are driven by those workflows.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import torch.distributed as dist

from job_agent import protocol
from job_agent.incident import Incident
from job_agent.launcher import Launcher, LocalLauncher
from job_agent.members import ControlServer, Member
from job_agent.recovery import Progress, find_hung
from torchpass.ids import incident_workflow_id, job_task_queue
from torchpass.job import JobResult, JobSpec
from torchpass.models import EventSource, Evidence, FailureKind, FailureReport, MigrationOutcome

Reporter = Callable[[str, FailureReport], Awaitable[None]]


class JobFailed(Exception):
    """The job cannot go on: a script error, a start-up failure, an unrecoverable incident."""


def _signal_name(code: int) -> str:
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"exit code {code}"


# Beyond the hang timeout, before frozen ranks with nobody lost count as a failed collective.
_STALL_MARGIN = 0.5


class Coordinator:
    """One per job. All state is touched on the event loop thread only."""

    def __init__(self, spec: JobSpec, reporter: Reporter, launcher: Launcher | None = None) -> None:
        self.spec = spec
        self.job_id = spec.job_id
        self.world_size = spec.nproc
        self.generation = -1
        self.secret = secrets.token_bytes(32)
        self._reporter = reporter
        self._launcher = launcher or LocalLauncher(str(spec.script), spec.args)
        self.members: dict[str, Member] = {}
        self._conns: dict[socket.socket, Member] = {}
        self._pending: dict[str, str] = {}  # agent_id -> node, spawned but not yet connected
        self._changed = asyncio.Event()
        self._done = asyncio.get_running_loop().create_future()
        self._injections: list[dict[str, Any]] = []
        self.checkpoints: list[tuple[int, str]] = []
        self.recomputed: set[int] = set()
        self._high_water = -1  # the most advanced step any rank has completed
        self._settled = -1  # ... as of the start of the current generation
        self.incidents: list[MigrationOutcome] = []
        self.incident: Incident | None = None
        self._queued: list[Evidence] = []
        self._spawned = 0
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self._server = ControlServer(self.secret, asyncio.get_running_loop(), self._on_frame, self._on_close)
        self.job_dir = spec.job_dir
        self._tasks: set[asyncio.Task[Any]] = set()
        self.state = "starting"
        self.error: str | None = None

    # --- lifecycle -----------------------------------------------------------------------------------

    async def run(self) -> JobResult:
        self._write_registry()
        for slot in range(self.world_size):
            self.spawn("rank", slot)
        for _ in range(self.spec.spares):
            self.spawn("spare", -1)
        self._bg(self._watch())
        try:
            await asyncio.wait_for(self._start_world(), self.spec.startup_timeout)
            self.state = "training"
            await self._done
        except TimeoutError:
            self._fail("the ranks did not all join within the start-up timeout")
        except JobFailed as e:
            self._fail(str(e))
        return await self._shutdown()

    async def _start_world(self) -> None:
        await self.wait_for(lambda: len(self.ranks("ready")) == self.world_size, None, "ranks to start")
        self.regroup()

    def regroup(self) -> int:
        """Form the next generation of the world with every current rank; returns its number."""
        self.generation += 1
        self._settled = self._high_water
        for m in self.ranks():
            m.state = "joining"
            m.replies.pop("joined", None)
            m.send({"t": "regroup", "generation": self.generation, "world_size": self.world_size})
        return self.generation

    async def _shutdown(self) -> JobResult:
        finished = self.state == "finished"
        code = 0 if finished else 1
        reason = "" if finished else f"job {self.job_id} stopped: {self.error}"
        for m in self.members.values():
            if m.alive:
                m.send({"t": "exit", "code": code, "reason": reason})
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(self._launcher.poll(a) is None for a in self.members):
            await asyncio.sleep(0.05)
        await asyncio.to_thread(self._launcher.shutdown, 5.0)
        for t in self._tasks:
            t.cancel()
        self._server.close()
        digests = {m.digest for m in self.ranks() if m.digest}
        result = JobResult(
            job_id=self.job_id,
            status=self.state if self.state in ("finished", "user_error") else "failed",
            steps_completed=max((m.completed for m in self.ranks()), default=-1) + 1,
            final_digest=digests.pop() if len(digests) == 1 else None,
            generation=self.generation,
            steps_recomputed=len(self.recomputed),
            incidents=tuple(self.incidents),
            error=self.error,
        )
        (self.job_dir / "result.json").write_text(result.model_dump_json(indent=2))
        (self.job_dir / "job.json").unlink(missing_ok=True)
        return result

    def _fail(self, error: str, state: str = "failed") -> None:
        if self.state in ("finished", "failed", "user_error"):
            return
        self.state, self.error = state, error
        if not self._done.done():
            self._done.set_result(None)

    def _write_registry(self) -> None:
        """Where `torchpass inject` and `torchpass jobs` find this job (the secret file is 0600)."""
        self.job_dir.mkdir(parents=True, exist_ok=True)
        secret_file = self.job_dir / "secret"
        fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.secret.hex())
        info = {
            "job_id": self.job_id,
            "coordinator": f"127.0.0.1:{self._server.port}",
            "pid": os.getpid(),
            "world_size": self.world_size,
            "started_at": datetime.now(UTC).isoformat(),
        }
        (self.job_dir / "job.json").write_text(json.dumps(info, indent=2))

    def spawn(self, role: str, slot: int, restore: str | None = None) -> str:
        self._spawned += 1
        agent_id = f"{role}{slot if slot >= 0 else ''}-{self._spawned}"
        s = self.spec
        env = {
            "TORCHPASS_JOB_ID": self.job_id,
            "TORCHPASS_AGENT_ID": agent_id,
            "TORCHPASS_ROLE": role,
            "TORCHPASS_SLOT": str(slot),
            "TORCHPASS_WORLD_SIZE": str(self.world_size),
            "TORCHPASS_COORDINATOR": f"127.0.0.1:{self._server.port}",
            "TORCHPASS_STORE": f"127.0.0.1:{self._store.port}",
            "TORCHPASS_SECRET_FILE": str(self.job_dir / "secret"),
            "TORCHPASS_CHECKPOINT_DIR": str(self.job_dir / "checkpoints"),
            "TORCHPASS_CHECKPOINT_EVERY": str(s.checkpoint_every),
            "TORCHPASS_SEED": str(s.seed),
            "TORCHPASS_THREADS": str(s.threads),
            "TORCHPASS_COLLECTIVE_TIMEOUT": str(s.collective_timeout),
        }
        if restore:
            env["TORCHPASS_RESTORE"] = restore
        self._pending[agent_id] = self._launcher.spawn(agent_id, env)
        return agent_id

    # --- queries -------------------------------------------------------------------------------------

    def ranks(self, *states: str) -> list[Member]:
        """Live members holding a slot (optionally in given states), by slot."""
        out = [
            m for m in self.members.values() if m.slot >= 0 and m.alive and (not states or m.state in states)
        ]
        return sorted(out, key=lambda m: m.slot)

    def spares(self) -> list[Member]:
        """Warm spares free to be reserved."""
        return [
            m
            for m in self.members.values()
            if m.slot < 0 and m.alive and m.state == "ready" and m.reserved_for is None
        ]

    def starting_spares(self) -> int:
        """Spares launched but not yet warm."""
        connecting = [m for m in self.members.values() if m.slot < 0 and m.alive and m.state == "connected"]
        return len(connecting) + sum(1 for a in self._pending if a.startswith("spare-"))

    def kill(self, m: Member) -> None:
        self._launcher.kill(m.agent_id)

    def member_at(self, slot: int) -> Member | None:
        return next((m for m in self.ranks() if m.slot == slot), None)

    async def wait_for(
        self,
        pred: Callable[[], bool],
        timeout: float | None,
        what: str,
        tick: Callable[[], None] | None = None,
    ) -> None:
        """Wait until `pred()` holds; every wait is bounded (None only under an outer timeout)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not pred():
            if self._done.done() and self.state != "training":
                raise JobFailed(self.error or "job stopped")
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"timed out after {timeout:.1f} s waiting for {what}")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(left or 1.0, 1.0))
            if tick is not None:
                tick()

    # --- control channel -----------------------------------------------------------------------------

    def _on_frame(self, conn: socket.socket, msg: dict[str, Any], ts: float) -> None:
        member = self._conns.get(conn)
        try:
            if member is None:
                self._on_first_frame(conn, msg)
            else:
                self._on_member_frame(member, msg, ts)
        except (KeyError, TypeError, ValueError) as e:
            # A malformed frame is the sender's problem; the coordinator carries on.
            _send_raw(conn, {"t": "error", "reason": f"bad frame {msg.get('t')!r}: {e}"})
        self._changed.set()

    def _on_first_frame(self, conn: socket.socket, msg: dict[str, Any]) -> None:
        t = msg["t"]
        if t == "hello":
            agent_id = str(msg["agent_id"])
            node = self._pending.pop(agent_id, None)
            if node is None:
                _send_raw(
                    conn, {"t": "reject", "reason": f"{agent_id} is not a process of this job (or fenced)"}
                )
                return
            m = Member(agent_id, str(msg["role"]), int(msg["slot"]), int(msg["pid"]), node, conn)
            self.members[agent_id] = m
            self._conns[conn] = m
            m.send({"t": "welcome"})
        elif t == "inject":
            _send_raw(conn, self._inject(msg))
        elif t == "drain":
            _send_raw(conn, self._drain(msg))
        elif t == "status":
            _send_raw(conn, self.status())
        else:
            _send_raw(conn, {"t": "error", "reason": f"unknown request {t!r}"})

    def _on_member_frame(self, m: Member, msg: dict[str, Any], ts: float) -> None:
        now = time.monotonic()
        m.last_heartbeat = now
        t = msg["t"]
        if t == "hb":
            return
        if t == "step":
            step = int(msg["k"])
            # An independent count of what the outcome claims: a step entered again after any rank had
            # completed it is recomputed work. Across ranks only completions before this generation count:
            # within one, frames of different ranks may be read out of order.
            if step <= self._settled or step <= m.completed:
                self.recomputed.add(step)
            m.step, m.step_at, m.step_wall, m.state = step, now, ts, "training"
            m.completed, m.frozen_at = step - 1, None
            self._high_water = max(self._high_water, m.completed)
            self._fire_injections(m)
        elif t == "coll":
            m.collective_step, m.collective_at = int(msg["k"]), now
        elif t == "ready":
            m.state, m.completed = "ready", int(msg["completed"])
        elif t == "frozen":
            m.state, m.completed = "frozen", int(msg["completed"])
            m.frozen_at = m.frozen_at or now
        elif t == "joined":
            m.state = "joined"
            m.replies["joined"] = msg
            m.collective_step = -1
        elif t == "done":
            m.state, m.completed, m.digest = "done", int(msg["step"]), str(msg["digest"])
            self._maybe_finished()
        elif t == "checkpoint":
            self.checkpoints.append((int(msg["step"]), str(msg["path"])))
        elif t == "user_error":
            self._fail(
                f"rank {m.slot} failed in the training script at step {msg.get('step')} (not a migration; "
                f"its traceback is above):\n{msg.get('traceback', '').rstrip()}",
                state="user_error",
            )
        elif t == "device_error":
            m.replies["device_error"] = msg
        else:
            m.replies[t] = msg

    def _on_close(self, conn: socket.socket, info: dict[str, Any], ts: float) -> None:
        m = self._conns.pop(conn, None)
        if m is None or not m.alive or (m.state == "done" and self.state == "finished"):
            return
        self._bg(self._lost(m, ts, info.get("reason", "")))
        self._changed.set()

    async def _lost(self, m: Member, observed: float, reason: str) -> None:
        """A member's connection closed: find out whether its process died, then report it."""
        for _ in range(20):  # the exit status follows the closed socket within milliseconds
            if self._launcher.poll(m.agent_id) is not None:
                break
            await asyncio.sleep(0.005)
        code = self._launcher.poll(m.agent_id)
        was_fenced = m.fenced
        m.state = "lost"
        self._changed.set()
        if was_fenced or self.state != "training":
            return
        if m.slot < 0:  # a spare died: refill the pool, nothing to migrate
            self.spawn("spare", -1)
            return
        if "device_error" in m.replies:
            kind, detail = FailureKind.CUDA_ERROR, m.replies["device_error"].get("detail", "")
        elif code is not None:
            kind, detail = FailureKind.PROCESS_EXIT, f"rank {m.slot} ({m.agent_id}) {_signal_name(code)}"
        else:
            kind, detail = FailureKind.CONNECTION_LOST, f"rank {m.slot} connection lost: {reason}"
        self.report(m, kind, detail, observed, code)

    # --- detection -----------------------------------------------------------------------------------

    async def _watch(self) -> None:
        """Hang detection and process reaping, ten times a second."""
        while True:
            await asyncio.sleep(0.1)
            now = time.monotonic()
            self._reap()
            if self.state != "training" or self.incident is not None:
                continue
            training = [m for m in self.ranks("training") if not m.fenced]
            progress = [
                Progress(m.slot, m.last_heartbeat, m.collective_step, m.collective_at) for m in training
            ]
            for hang in find_hung(progress, now, self.spec.hang_timeout):
                m = self.member_at(hang.slot)
                if m is not None:
                    self.report(m, FailureKind.HANG, f"rank {m.slot} hung: {hang.detail}", time.time(), None)
            if self.incident is None:
                self._check_stall(now)

    def _check_stall(self, now: float) -> None:
        """Ranks frozen with nobody lost: a collective failed or timed out with every rank alive.

        Reported once every rank of the world is frozen (nobody died: a dead rank is never "frozen"), or
        when some have been frozen past the hang timeout while the rest still heart-beat in a collective
        of their own. A real loss or hang is detected well within that time and takes precedence.
        """
        ranks = self.ranks()
        frozen = [m for m in ranks if m.state == "frozen" and m.frozen_at is not None]
        if not frozen:
            return
        everyone = len(ranks) == self.world_size and len(frozen) == len(ranks)
        waited = now - min(m.frozen_at for m in frozen if m.frozen_at is not None)
        if not everyone and waited <= self.spec.hang_timeout + _STALL_MARGIN:
            return
        ev = Evidence(
            kind=FailureKind.COLLECTIVE_TIMEOUT,
            source=EventSource.COORDINATOR,
            job_id=self.job_id,
            failure_domain="collective",
            slots=(),
            detail=f"ranks {sorted(m.slot for m in frozen)} left a failed collective with every rank alive"
            f" ({len(frozen)} of {self.world_size} frozen for {waited:.1f} s); re-forming the group in place",
            observed_at=datetime.now(UTC) - timedelta(seconds=waited),
        )
        self.add_evidence(ev)

    def _reap(self) -> None:
        """A process that died before it ever connected (import error, bad arguments) fails the job."""
        for agent_id in list(self._pending):
            code = self._launcher.poll(agent_id)
            if code is not None:
                del self._pending[agent_id]
                self._fail(
                    f"{agent_id} exited ({_signal_name(code)}) before joining the job; see its output above"
                )

    def report(self, m: Member, kind: FailureKind, detail: str, observed: float, code: int | None) -> None:
        """Turn a detection into evidence for the incident workflow (folded by workflow id)."""
        ev = Evidence(
            kind=kind,
            source=EventSource.COORDINATOR,
            job_id=self.job_id,
            failure_domain=m.node,
            slots=(m.slot,),
            detail=detail,
            observed_at=datetime.fromtimestamp(observed, UTC),
            exit_code=code,
        )
        m.fenced = m.fenced or kind == FailureKind.HANG  # never report the same rank twice
        self.add_evidence(ev)

    def add_evidence(self, ev: Evidence) -> None:
        inc = self.incident
        if inc is None:
            inc = self.incident = Incident(
                incident_workflow_id(self.job_id, ev.failure_domain, self.generation)
            )
        elif inc.past_freeze:
            # The world of this incident is already decided: the next incident takes it.
            self._queued.append(ev)
            return
        inc.evidence.append(ev)
        inc.lost.update(ev.slots)
        report = FailureReport(
            evidence=ev,
            job_task_queue=job_task_queue(self.job_id),
            generation=self.generation,
            contract=self.spec.contract,
        )
        self._bg(self._reporter(inc.workflow_id, report))

    def _replaced(self, slots: tuple[int, ...]) -> bool:
        """A queued loss was already repaired (say by a fallback restart): a healthy rank holds its slot."""
        return any((m := self.member_at(s)) is not None and not m.fenced for s in slots)

    def end_incident(self, outcome: MigrationOutcome) -> None:
        """The incident's workflow is done with the job; detection resumes, queued failures go next."""
        if all(o.incident_id != outcome.incident_id for o in self.incidents):
            self.incidents.append(outcome)
            with (self.job_dir / "incidents.jsonl").open("a") as f:
                f.write(outcome.model_dump_json() + "\n")
        self.incident = None
        queued, self._queued = self._queued, []
        for ev in queued:
            if not self._replaced(ev.slots):
                self.add_evidence(ev)

    def _maybe_finished(self) -> None:
        ranks = self.ranks()
        if len(ranks) == self.world_size and all(m.state == "done" for m in ranks):
            self.state = "finished"
            if not self._done.done():
                self._done.set_result(None)

    # --- failure injection (tests, demos, chaos) -------------------------------------------------------

    def _inject(self, msg: dict[str, Any]) -> dict[str, Any]:
        action, slot = msg.get("action"), msg.get("slot")
        if action not in ("kill", "hang", "pause"):
            return {"t": "error", "reason": f"unknown injection {action!r}: use kill, hang or pause"}
        seconds = msg.get("seconds", 5.0)
        if action == "pause" and not (isinstance(seconds, int | float) and 0 < seconds <= 3600):
            return {"t": "error", "reason": f"pause needs 0 < seconds <= 3600, not {seconds!r}"}
        if not isinstance(slot, int) or not 0 <= slot < self.world_size:
            return {
                "t": "error",
                "reason": f"job {self.job_id} has ranks 0-{self.world_size - 1}, not {slot!r}",
            }
        after = msg.get("after_step")
        self._injections.append({"action": action, "slot": slot, "after_step": after, "seconds": seconds})
        m = self.member_at(slot)
        if m is not None:
            self._fire_injections(m)
        return {"t": "ok", "action": action, "slot": slot, "after_step": after}

    def _drain(self, msg: dict[str, Any]) -> dict[str, Any]:
        """A planned migration (node cordon or drain, security patch, rising temperature): the rank's
        slot moves to a spare while the rank is still healthy; it is fenced only once every rank froze."""
        slot = msg.get("slot")
        m = self.member_at(slot) if isinstance(slot, int) else None
        if m is None or m.role != "rank":
            return {
                "t": "error",
                "reason": f"job {self.job_id} has ranks 0-{self.world_size - 1}, not {slot!r}",
            }
        if self.state != "training":
            return {"t": "error", "reason": f"job {self.job_id} is {self.state}, not training"}
        reason = str(msg.get("reason") or "operator request")[:500]
        kind = FailureKind.NODE_CORDON if msg.get("kind") == "cordon" else FailureKind.NODE_DRAIN
        self.add_evidence(
            Evidence(
                kind=kind,
                source=EventSource.OPERATOR,
                job_id=self.job_id,
                failure_domain=m.node,
                slots=(m.slot,),
                detail=f"planned migration of rank {m.slot} off {m.node}: {reason}",
                observed_at=datetime.now(UTC),
            )
        )
        return {"t": "ok", "slot": m.slot, "node": m.node}

    def _fire_injections(self, m: Member) -> None:
        for inj in list(self._injections):
            if inj["slot"] == m.slot and (inj["after_step"] is None or m.step >= inj["after_step"]):
                self._injections.remove(inj)
                if inj["action"] == "kill":
                    self._launcher.kill(m.agent_id)
                else:
                    self._launcher.suspend(m.agent_id)
                if inj["action"] == "pause":  # a stall that ends: the rank resumes on its own
                    loop = asyncio.get_running_loop()
                    loop.call_later(float(inj["seconds"]), self._launcher.resume, m.agent_id)

    def status(self) -> dict[str, Any]:
        return {
            "t": "status",
            "job_id": self.job_id,
            "state": self.state,
            "generation": self.generation,
            "world_size": self.world_size,
            "ranks": [
                {"slot": m.slot, "agent": m.agent_id, "state": m.state, "step": m.step} for m in self.ranks()
            ],
            "spares": len(self.spares()),
            "incident": self.incident.workflow_id if self.incident else None,
        }

    def _bg(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _send_raw(conn: socket.socket, msg: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):  # the peer already hung up: nothing to tell it
        protocol.send_frame(conn, msg)
