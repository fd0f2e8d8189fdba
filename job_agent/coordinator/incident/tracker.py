"""The incident in progress, as the coordinator keeps it, and the delivery of its reports to
Temporal.

Evidence of one failure folds into one incident (its workflow id is keyed by job, failure domain and
world generation). A failure during the recovery (a donor, a spare or another rank lost while the
state moves) folds into it too: the recovery re-plans around it. Once the world trains again, later
evidence waits for the next incident. Every report is delivered to the incident's workflow by the
`Reporter` (signal-with-start), retried with backoff for a bounded time; one that still cannot be
delivered is logged and counted, never dropped silently.

The job never waits on the control plane: an incident no workflow step has reached within
`LOCAL_AFTER` (the server, or every control worker, away) is carried out by the job itself
(`job_agent.coordinator.incident.local`), which keeps the record in its state directory (`local/`).
Its reports are then retried until Temporal takes them; the incident's workflow, refused the steps,
files that record (`fetch_local_record`), so it is recorded once, under the incident's own id.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import deque
from collections.abc import Awaitable, Callable
from datetime import timedelta
from pathlib import Path

from job_agent.coordinator.incident.lifecycle import Driver, Incident
from job_agent.coordinator.incident.local_records import LocalRecords
from torchpass.ids import REKEY_HEX, incident_workflow_id, job_task_queue
from torchpass.incident.classify import CATEGORY_OF
from torchpass.incident.outcome import MigrationOutcome
from torchpass.job import JobSpec
from torchpass.models import Category, ContractRef, Disposition, Evidence, FailureReport

log = logging.getLogger("torchpass.coordinator")

Reporter = Callable[[str, FailureReport], Awaitable[None]]
REPORT_RETRY_FOR = timedelta(seconds=60)
MAX_REKEYS = 3
# No workflow step for this long after an incident opened: the control plane is away, the job goes
# on alone.
LOCAL_AFTER = timedelta(seconds=5)
_FIRST_BACKOFF, _MAX_BACKOFF = 0.2, 5.0
# Claims the job refuted (a failure it never had): every one counted, the latest kept.
KEPT_REFUTED = 20


class Squatted(Exception):
    """A report reached a workflow at the incident's id that is not this job's incident (it runs the
    job's activities on another task queue, or holds another job's reports): the incident needs a
    fresh id."""


class IncidentTracker:
    """The current incident, the evidence queued behind it, and every outcome recorded."""

    def __init__(
        self,
        job_id: str,
        generation: Callable[[], int],
        reporter: Reporter,
        contract: ContractRef | None,
        retry_for: timedelta = REPORT_RETRY_FOR,
        records: Path | None = None,
        local_after: timedelta = LOCAL_AFTER,
        late_window: timedelta = timedelta(0),
    ) -> None:
        self._job_id = job_id
        self._generation = generation
        self._reporter = reporter
        self._contract = contract
        self._retry_for = retry_for
        self.local_after = local_after
        # an incident's workflow stays open this long after its outcome
        self.late_window = late_window
        # incident id -> when its outcome was recorded (monotonic)
        self._recorded: dict[str, float] = {}
        self.current: Incident | None = None
        # evidence waiting for the next incident, with the processes that held its slots then
        self.queued: list[tuple[Evidence, tuple[str, ...]]] = []
        # the processes holding the slots `ev` names (the coordinator's roster says)
        self.holders: Callable[[Evidence], tuple[str, ...]] = lambda ev: ()
        self.outcomes: list[MigrationOutcome] = []  # the job's incidents
        # claims the job refuted, apart from its incidents: the latest, and how many in all
        self.refuted: deque[MigrationOutcome] = deque(maxlen=KEPT_REFUTED)
        self.refuted_total = 0
        self.records = LocalRecords(job_id, records, self.outcomes)  # incidents it handled itself
        self.undelivered = 0  # reports that never reached Temporal within the retry bound
        # Set by the job worker (`job_agent.coordinator.incident.local`): carries out an incident no
        # workflow step reached.
        self.on_unanswered: Callable[[Incident], Awaitable[None]] | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @classmethod
    def of_job(
        cls, spec: JobSpec, generation: Callable[[], int], reporter: Reporter
    ) -> IncidentTracker:
        """The tracker of `spec`'s job: its records of incidents it handles itself go in its
        local/."""
        local_after = timedelta(seconds=spec.control_plane_wait)
        return cls(
            spec.job_id,
            generation,
            reporter,
            spec.contract,
            records=spec.job_dir / "local",
            local_after=local_after,
            late_window=timedelta(seconds=spec.late_window),
        )

    def add(self, ev: Evidence) -> Incident | None:
        """Fold `ev` into the current incident (or start one) and report it; None when it must
        wait."""
        inc = self.current
        if inc is None:
            inc = self.current = Incident(
                incident_workflow_id(self._job_id, ev.failure_domain, self._generation())
            )
            self._spawn(self._unanswered_after(inc))
        elif inc.past_freeze and not (
            inc.recovering and CATEGORY_OF[ev.kind] is not Category.PLANNED
        ):
            # The world of this incident is already decided (or a planned move waits for a calm
            # one): the next incident takes it.
            # A late report of this incident's own losses concerns processes already replaced; one
            # about a rank outside it (a GPU failing under a live rank) concerns the process there
            # now, and stands while that process holds the slot.
            ours = set(ev.slots) & (inc.lost | inc.leaving)
            self.queued.append((ev, () if ours else self.holders(ev)))
            return None
        inc.evidence.append(ev)
        inc.lost.update(ev.slots)
        self._report(inc, ev, self._generation())
        return inc

    def rekey(self, inc: Incident, why: str) -> str:
        """The workflow at `inc`'s id is not this job's incident (a squatter holds it): the incident
        goes on under a fresh id nobody can guess, and every report of it is delivered there again.
        Returns it."""
        old = inc.workflow_id
        base = old.rsplit(":", 1)[0] if old.rsplit(":", 1)[-1].startswith("x") else old
        inc.workflow_id = f"{base}:x{secrets.token_hex(REKEY_HEX // 2)}"
        inc.rekeyed += 1
        if inc.driver is Driver.WORKFLOW:  # the squatter's step was no step of this incident
            inc.drive(Driver.WAITING)
        log.warning("incident %s moves to %s: %s", old, inc.workflow_id, why)
        for ev in inc.evidence:
            self._report(inc, ev, inc.generation)
        return inc.workflow_id

    def _report(self, inc: Incident, ev: Evidence, generation: int) -> None:
        if inc.generation < 0:
            inc.generation = generation
        lead = inc.lead.get(inc.workflow_id)
        report = self._report_of(ev, generation, opens=lead is None)
        task = self._spawn(self._deliver(inc, inc.workflow_id, report, after=lead))
        inc.lead.setdefault(inc.workflow_id, task)
        inc.deliveries.add(task)
        task.add_done_callback(inc.deliveries.discard)

    def _report_of(
        self, ev: Evidence, generation: int, late: bool = False, opens: bool = False
    ) -> FailureReport:
        return FailureReport(
            evidence=ev,
            job_task_queue=job_task_queue(self._job_id),
            generation=generation,
            contract=self._contract,
            linger_seconds=self.late_window.total_seconds(),
            late=late,
            opens=opens,
        )

    def late(self, ev: Evidence, incident_id: str) -> None:
        """`ev` came after its incident's outcome was recorded (`incident_id`: workflow id/run id):
        it goes to that run alone, open for the late window, into its history; it starts nothing."""
        self._spawn(
            self._deliver(
                None, incident_id, self._report_of(ev, self._generation(), late=True), None
            )
        )

    def _spawn(self, work: Awaitable[None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _unanswered_after(self, inc: Incident) -> None:
        await asyncio.sleep(self.local_after.total_seconds())
        if self.on_unanswered is None or self.current is not inc:
            return
        if inc.driver is not Driver.WAITING or inc.past_freeze:
            return
        inc.drive(Driver.JOB)
        self.records.handled[inc.workflow_id] = inc
        log.warning(
            "incident %s: no workflow step within %.0f s (is Temporal or the control worker "
            "down?); the job carries it out itself and files the record when the control plane is "
            "back",
            inc.workflow_id,
            self.local_after.total_seconds(),
        )
        await self.on_unanswered(inc)

    def answered(self, workflow_id: str) -> bool:
        """A workflow step for `workflow_id` reached the job. False: the job handled that incident
        itself, and the step must be refused (the workflow files the job's record instead)."""
        if workflow_id in self.records.handled:
            return False
        inc = self.current
        if inc is not None and inc.workflow_id == workflow_id:
            inc.drive(Driver.WORKFLOW)
        return True

    async def _deliver(
        self,
        inc: Incident | None,
        workflow_id: str,
        report: FailureReport,
        after: asyncio.Task[None] | None,
    ) -> None:
        if after is not None:  # signal-with-start: the first report delivered starts the workflow
            await asyncio.wait({after})
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._retry_for.total_seconds()
        backoff = _FIRST_BACKOFF
        while True:
            try:
                await self._reporter(workflow_id, report)
                return
            except Squatted as e:  # delivered to a workflow that is not this job's incident
                if inc is not None and inc.workflow_id == workflow_id and inc.rekeyed < MAX_REKEYS:
                    self.rekey(inc, str(e))
                elif inc is None or inc.workflow_id == workflow_id:
                    self.undelivered += 1
                    log.error(
                        "incident %s squatted %d times; report NOT delivered: %s",
                        workflow_id,
                        MAX_REKEYS,
                        e,
                    )
                return
            # any failure to reach Temporal: retried, then logged, never raised
            except Exception as e:
                # One the job handles itself is retried until Temporal is back: its record waits
                # there.
                if (
                    not (inc is not None and inc.driver is Driver.JOB)
                    and loop.time() + backoff > deadline
                ):
                    self.undelivered += 1
                    log.error(
                        "report of %s to incident %s NOT delivered after %.0f s: %s",
                        report.evidence.kind,
                        workflow_id,
                        self._retry_for.total_seconds(),
                        e,
                    )
                    return
                log.warning(
                    "report to incident %s failed, retrying in %.1f s: %s", workflow_id, backoff, e
                )
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, _MAX_BACKOFF)

    def end(
        self,
        outcome: MigrationOutcome,
        replaced: Callable[[Evidence, tuple[str, ...]], bool],
        refuted: bool = False,
    ) -> bool:
        """The incident's workflow is done with the job; queued evidence not yet repaired goes next
        (`replaced` is asked with the processes it concerned: it stands while they hold its slots).
        A refuted claim (never this job's incident) is only counted, apart from the incidents, the
        latest `KEPT_REFUTED` kept. Returns whether the outcome was new (a retried completion
        records nothing twice)."""
        if refuted:
            new = all(o.incident_id != outcome.incident_id for o in (*self.outcomes, *self.refuted))
            if new:
                self.refuted.append(outcome)
                self.refuted_total += 1
            return new
        new = all(o.incident_id != outcome.incident_id for o in self.outcomes)
        if new:
            self.outcomes.append(outcome)
            self._recorded[outcome.incident_id] = time.monotonic()
        self.current = None
        queued, self.queued = self.queued, []
        for ev, held in queued:
            if not replaced(ev, held):
                self.add(ev)
        return new

    def recent(self, node: str) -> MigrationOutcome | None:
        """The last failure of `node` (not a planned move, not a refuted claim) whose workflow is
        still open for late evidence (`late`)."""
        for o in reversed(self.outcomes):
            planned = o.classification.category is Category.PLANNED
            if (
                o.failure_domain == node
                and o.disposition is not Disposition.NOT_A_FAILURE
                and not planned
            ):
                recorded = self._recorded.get(o.incident_id, float("-inf"))
                return o if time.monotonic() - recorded < self.late_window.total_seconds() else None
        return None

    def cancel(self) -> None:
        for t in self._tasks:
            t.cancel()
