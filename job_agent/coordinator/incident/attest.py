"""The job's attestation of an incident's outcome (`torchpass.incident.attestation`): what the
ledger counts only with the job's signature.

The job signs only an incident it knows: the one it has open (it confirmed it), one it carried out
itself, or one whose outcome it already recorded; and only figures that agree with its own (the
digests the receivers computed, the steps each rank resumed at, the checkpoint it restarted from).
A false alarm is signed as such: the job's confirm refuted it, and "not a failure" never counts.
Anything else is refused with why, and its outcome is recorded by the contract as unconfirmed.
"""

from __future__ import annotations

from job_agent.coordinator.incident.confirm import is_current
from job_agent.coordinator.incident.job_control import JobControl
from job_agent.coordinator.incident.lifecycle import Incident, IncidentError
from torchpass.errors import ErrorType
from torchpass.incident.attestation import JobKey
from torchpass.incident.outcome import MigrationOutcome
from torchpass.incident.steps import IncidentRef
from torchpass.models import Disposition


def attest(job: JobControl, key: JobKey, ref: IncidentRef, outcome: MigrationOutcome) -> str:
    """The job's signature over `outcome`'s facts, or an IncidentError saying why it will not
    sign."""
    if outcome.job_id != job.job_id or outcome.incident_id != ref.incident_id:
        _refuse(job, ref, f"the outcome is of {outcome.incident_id!r} of job {outcome.job_id!r}")
    known = any(o.incident_id == outcome.incident_id for o in job.incidents.outcomes)
    if is_current(job, ref) and job.incidents.current is not None:
        if why := disagreement(job.incidents.current, outcome):
            _refuse(job, ref, why)
    elif not (
        known
        or ref.workflow_id in job.incidents.records.handled
        or outcome.disposition is Disposition.NOT_A_FAILURE
    ):
        _refuse(job, ref, "the job never confirmed this incident (none of its steps ran)")
    return key.attest(outcome)


def disagreement(inc: Incident, outcome: MigrationOutcome) -> str | None:
    """Where the outcome's figures differ from what the job measured; None when they agree."""
    mine, theirs = inc.proof, outcome.proof
    if outcome.disposition is Disposition.MIGRATED:
        if mine is None or theirs is None:
            return "a live migration without the state moved the job measured"
        if (theirs.donor_digest, theirs.receiver_digests, theirs.step_after) != (
            mine.donor_digest,
            mine.receiver_digests,
            mine.step_after,
        ):
            return "the proof's digests or step differ from what the job's receivers computed"
        if inc.rejoined is None or outcome.resumed_steps != inc.rejoined.resumed_steps:
            return "the steps the ranks resumed at differ from what they told the job"
    restored = inc.fallback.restored_step if inc.fallback else None
    if outcome.fallback is not None and outcome.fallback.restored_step != restored:
        return "the checkpoint restored differs from the one the job restarted from"
    return None


def _refuse(job: JobControl, ref: IncidentRef, why: str) -> None:
    raise IncidentError(
        ErrorType.UNKNOWN_INCIDENT,
        f"job {job.job_id} does not attest {ref.incident_id}: {why}",
    )
