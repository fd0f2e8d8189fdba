"""The incident in progress, as the coordinator keeps it, and the delivery of its reports to Temporal.

Evidence of one failure folds into one incident (its workflow id is keyed by job, failure domain and
world generation). A failure during the recovery (a donor, a spare or another rank lost while the state
moves) folds into it too: the recovery re-plans around it. Once the world trains again, later evidence
waits for the next incident. Every
report is delivered to the incident's workflow by the `Reporter` (signal-with-start), retried with
backoff for a bounded time; one that still cannot be delivered is logged and counted, never dropped
silently.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import timedelta

from job_agent import wire
from torchpass.classify import CATEGORY_OF
from torchpass.errors import ErrorType, TorchpassError
from torchpass.ids import incident_workflow_id, job_task_queue
from torchpass.models import Category, ContractRef, Evidence, FailureReport
from torchpass.outcome import MigrationOutcome
from torchpass.steps import FallbackResult, FreezeResult, RejoinResult, TransferProof

log = logging.getLogger("torchpass.coordinator")

Reporter = Callable[[str, FailureReport], Awaitable[None]]
REPORT_RETRY_FOR = timedelta(seconds=60)
MAX_REKEYS = 3
_FIRST_BACKOFF, _MAX_BACKOFF = 0.2, 5.0


class Squatted(Exception):
    """A report reached a workflow at the incident's id that is not this job's incident (it runs the job's
    activities on another task queue, or holds another job's reports): the incident needs a fresh id."""


class IncidentError(TorchpassError):
    """A step of the incident failed; its `error_type` decides whether trying again can help."""

    def __init__(self, error_type: ErrorType, message: str) -> None:
        super().__init__(message, error_type)


@dataclass
class Supply:
    """The state transfers of one recovery so far (several when a donor or receiver was lost)."""

    got: dict[int, tuple[str, wire.Received, int]] = field(
        default_factory=dict
    )  # slot: agent, account, donor
    served: list[tuple[int, wire.Served]] = field(default_factory=list)  # donor slot and its account
    moves: int = 0


@dataclass
class Incident:
    """What the coordinator remembers of the incident in progress."""

    workflow_id: str
    evidence: list[Evidence] = field(default_factory=list)
    lost: set[int] = field(default_factory=set)
    leaving: set[int] = field(default_factory=set)  # planned: healthy until frozen, then fenced
    confirmed: frozenset[int] = frozenset()  # the slots confirm found lost; the rest were lost later
    past_freeze: bool = False
    frozen: FreezeResult | None = None
    proof: TransferProof | None = None
    supply: Supply = field(default_factory=Supply)
    rejoined: RejoinResult | None = None
    fallback: FallbackResult | None = None
    completed: bool = False
    generation: int = -1  # the world generation its reports carry (the first report's)
    rekeyed: int = 0  # times it moved to a fresh id because a squatter held its own

    @property
    def recovering(self) -> bool:
        """Frozen and not yet training again: a failure now is one more loss of this recovery, whose plan
        is re-made around it, not a failure of the world the recovery is building."""
        return self.past_freeze and self.rejoined is None and self.fallback is None and not self.completed


class IncidentTracker:
    """The current incident, the evidence queued behind it, and every outcome recorded."""

    def __init__(
        self,
        job_id: str,
        generation: Callable[[], int],
        reporter: Reporter,
        contract: ContractRef | None,
        retry_for: timedelta = REPORT_RETRY_FOR,
    ) -> None:
        self._job_id = job_id
        self._generation = generation
        self._reporter = reporter
        self._contract = contract
        self._retry_for = retry_for
        self.current: Incident | None = None
        self.queued: list[Evidence] = []
        self.outcomes: list[MigrationOutcome] = []
        self.undelivered = 0  # reports that never reached Temporal within the retry bound
        self._tasks: set[asyncio.Task[None]] = set()

    def add(self, ev: Evidence) -> Incident | None:
        """Fold `ev` into the current incident (or start one) and report it; None when it must wait."""
        inc = self.current
        if inc is None:
            inc = self.current = Incident(
                incident_workflow_id(self._job_id, ev.failure_domain, self._generation())
            )
        elif inc.past_freeze and not (inc.recovering and CATEGORY_OF[ev.kind] is not Category.PLANNED):
            # The world of this incident is already decided (or a planned move waits for a calm one):
            # the next incident takes it.
            self.queued.append(ev)
            return None
        inc.evidence.append(ev)
        inc.lost.update(ev.slots)
        self._report(inc, ev, self._generation())
        return inc

    def rekey(self, inc: Incident, why: str) -> str:
        """The workflow at `inc`'s id is not this job's incident (a squatter holds it): the incident goes on
        under a fresh id nobody can guess, and every report of it is delivered there again. Returns it."""
        old = inc.workflow_id
        base = old.rsplit(":", 1)[0] if old.rsplit(":", 1)[-1].startswith("x") else old
        inc.workflow_id = f"{base}:x{secrets.token_hex(8)}"
        inc.rekeyed += 1
        log.warning("incident %s moves to %s: %s", old, inc.workflow_id, why)
        for ev in inc.evidence:
            self._report(inc, ev, inc.generation)
        return inc.workflow_id

    def _report(self, inc: Incident, ev: Evidence, generation: int) -> None:
        if inc.generation < 0:
            inc.generation = generation
        report = FailureReport(
            evidence=ev,
            job_task_queue=job_task_queue(self._job_id),
            generation=generation,
            contract=self._contract,
        )
        task = asyncio.ensure_future(self._deliver(inc, inc.workflow_id, report))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _deliver(self, inc: Incident, workflow_id: str, report: FailureReport) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._retry_for.total_seconds()
        backoff = _FIRST_BACKOFF
        while True:
            try:
                await self._reporter(workflow_id, report)
                return
            except Squatted as e:  # delivered to a workflow that is not this job's incident
                if inc.workflow_id == workflow_id and inc.rekeyed < MAX_REKEYS:
                    self.rekey(inc, str(e))
                elif inc.workflow_id == workflow_id:
                    self.undelivered += 1
                    log.error(
                        "incident %s squatted %d times; report NOT delivered: %s", workflow_id, MAX_REKEYS, e
                    )
                return
            except Exception as e:  # any failure to reach Temporal: retried, then logged, never raised
                if loop.time() + backoff > deadline:
                    self.undelivered += 1
                    log.error(
                        "report of %s to incident %s NOT delivered after %.0f s: %s",
                        report.evidence.kind,
                        workflow_id,
                        self._retry_for.total_seconds(),
                        e,
                    )
                    return
                log.warning("report to incident %s failed, retrying in %.1f s: %s", workflow_id, backoff, e)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, _MAX_BACKOFF)

    def end(
        self, outcome: MigrationOutcome, replaced: Callable[[Evidence], bool], refuted: bool = False
    ) -> bool:
        """The incident's workflow is done with the job; queued evidence not yet repaired goes next. A
        refuted claim (never this job's incident) is only recorded. Returns whether the outcome was new (a
        retried completion records nothing twice)."""
        new = all(o.incident_id != outcome.incident_id for o in self.outcomes)
        if new:
            self.outcomes.append(outcome)
        if refuted:
            return new
        self.current = None
        queued, self.queued = self.queued, []
        for ev in queued:
            if not replaced(ev):
                self.add(ev)
        return new

    def cancel(self) -> None:
        for t in self._tasks:
            t.cancel()
