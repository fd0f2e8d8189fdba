"""The records of the incidents the job carried out itself while the control plane was away: kept in
memory and in the job's state directory (owner-only), handed to each incident's workflow when it
asks (`fetch_local_record`), and put away once that workflow filed the incident under its own id."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from datetime import timedelta
from pathlib import Path

from job_agent.coordinator.incident.lifecycle import Incident, IncidentError
from job_agent.coordinator.private_files import open_private
from torchpass.errors import ErrorType
from torchpass.incident.outcome import MigrationOutcome
from torchpass.incident.proof import filed_ending
from torchpass.incident.steps import LocalRecord

log = logging.getLogger("torchpass.coordinator")


class LocalRecords:
    """The incidents the job handled itself (`handled`), until filed; `outcomes` is the job's
    list."""

    def __init__(
        self, job_id: str, directory: Path | None, outcomes: list[MigrationOutcome]
    ) -> None:
        self._job_id = job_id
        self._dir = directory
        self._outcomes = outcomes
        self.handled: dict[str, Incident] = {}

    def keep(self, inc: Incident, record: LocalRecord) -> None:
        """The job's own recovery of `inc` is done: its record is kept (in memory and in the state
        directory, owner-only) until the incident's workflow files it."""
        inc.record = record
        if self._dir is not None:
            self._dir.mkdir(mode=0o700, exist_ok=True)
            path = self._dir / f"{_safe(inc.workflow_id)}.json"
            with open_private(path) as f:
                f.write(record.model_dump_json(indent=2))
        inc.recorded.set()

    async def record_of(self, workflow_id: str) -> LocalRecord:
        """The record of an incident the job handled itself, once its recovery is done."""
        inc = self.handled.get(workflow_id)
        if inc is None:
            raise IncidentError(
                ErrorType.UNKNOWN_INCIDENT,
                f"job {self._job_id} holds no unfiled record of {workflow_id}",
            )
        await inc.recorded.wait()
        assert inc.record is not None
        return inc.record

    def file(self, workflow_id: str, outcome: MigrationOutcome) -> bool:
        """The workflow recorded a locally handled incident (`outcome`, under its own id): it
        replaces the job's provisional one, the record file goes, no report of it is sent again.
        False: not one."""
        inc = self.handled.get(workflow_id)
        if inc is None or inc.record is None:
            return False
        mine = f"{workflow_id}/"
        expected = filed_ending(inc.record).disposition
        if not outcome.incident_id.startswith(mine) or outcome.disposition is not expected:
            # A completion that is not the filing of this record (another run's, or forged): the
            # job's own outcome stands, the record stays for its real workflow.
            log.error(
                "incident %s: a filing as %s (%s) does not match the job's record (%s); not taken",
                workflow_id,
                outcome.incident_id,
                outcome.disposition.value,
                expected.value,
            )
            return True
        del self.handled[workflow_id]
        for task in inc.deliveries:
            task.cancel()
        at = next((i for i, o in enumerate(self._outcomes) if o.incident_id.startswith(mine)), None)
        if at is None:
            self._outcomes.append(outcome)
        else:
            self._outcomes[at] = outcome
        if self._dir is not None:
            (self._dir / f"{_safe(workflow_id)}.json").unlink(missing_ok=True)
        log.info(
            "incident %s, handled by the job itself, is filed as %s",
            workflow_id,
            outcome.incident_id,
        )
        return True

    async def filed(self, timeout: timedelta) -> None:
        """Wait (at most `timeout`) for the incidents the job handled itself to be filed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout.total_seconds()
        while (
            any(inc.record is not None for inc in self.handled.values()) and loop.time() < deadline
        ):
            await asyncio.sleep(0.1)


def _safe(workflow_id: str) -> str:
    """A file name for a workflow id (ids hold ':' and may hold '/'), its hash keeping two apart."""
    readable = "".join(c if c.isalnum() or c in "-_." else "_" for c in workflow_id)[:160]
    return f"{readable}-{hashlib.sha256(workflow_id.encode()).hexdigest()[:12]}"
