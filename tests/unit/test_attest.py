"""What a job signs (`job_agent.coordinator.incident.attest`): its own incident with the figures it
measured, a false alarm, an incident it carried out itself or already recorded; never an incident
none of whose steps ran, nor figures other than its own. A signature verifies only over the facts
signed (`torchpass.incident.attestation`)."""

from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import pytest

from job_agent.coordinator.incident.attest import attest
from job_agent.coordinator.incident.lifecycle import Incident, IncidentError
from tests.unit.test_contract_rules import outcome
from tests.workflows.fake_job import proof_of
from torchpass.incident.attestation import JobKey, attested
from torchpass.incident.steps import IncidentRef, RejoinResult
from torchpass.models import Disposition

T = datetime(2026, 12, 1, tzinfo=UTC)
RUN = "00000000-0000-0000-0000-000000000007"
KEY = JobKey.generate()


def job(
    current: Incident | None, recorded: tuple[str, ...] = (), handled: tuple[str, ...] = ()
) -> Any:
    """What `attest` reads of a job (`JobControl`): its id, its open incident, what it recorded."""
    incidents = SimpleNamespace(
        current=current,
        outcomes=[outcome(0, T, incident_id=i) for i in recorded],
        records=SimpleNamespace(handled=dict.fromkeys(handled)),
    )
    return SimpleNamespace(job_id="job-a", incidents=incidents)


def migrated(wf: str) -> tuple[Incident, Any]:
    """The job's incident, migrated live, and the outcome its workflow built from its answers."""
    inc = Incident(wf)
    inc.proof = proof_of("d", 9)
    inc.rejoined = RejoinResult(
        generation=1, resumed_step=10, resumed_at=T, resumed_steps={0: 10, 1: 10}, proof=inc.proof
    )
    o = outcome(1, T, incident_id=f"{wf}/{RUN}", proof=inc.proof, resumed_steps={0: 10, 1: 10})
    return inc, o


def test_the_job_signs_its_own_incident_with_its_own_figures() -> None:
    inc, o = migrated("wf-1")
    signature = attest(
        job(inc), KEY, IncidentRef(workflow_id="wf-1", run_id=RUN, job_id="job-a"), o
    )
    signed = o.model_copy(update={"attestation": signature})
    assert attested(signed, [KEY.public])
    assert not attested(signed, [JobKey.generate().public])
    assert not attested(signed.model_copy(update={"steps_recomputed": 3}), [KEY.public])


def test_the_job_refuses_an_incident_it_never_confirmed_or_figures_not_its_own() -> None:
    inc, o = migrated("wf-1")
    ref = IncidentRef(workflow_id="wf-1", run_id=RUN, job_id="job-a")
    other = IncidentRef(workflow_id="wf-2", run_id=RUN, job_id="job-a")
    cases = {
        "never confirmed": (job(None), other, o.model_copy(update={"incident_id": f"wf-2/{RUN}"})),
        "is of": (job(inc), other, o),  # an outcome of another incident than the run asking
        "digests or step differ": (
            job(inc),
            ref,
            o.model_copy(update={"proof": proof_of("forged", 9)}),
        ),
        "resumed at differ": (job(inc), ref, o.model_copy(update={"resumed_steps": {0: 4}})),
    }
    for why, (j, r, claim) in cases.items():
        with pytest.raises(IncidentError, match=why):
            attest(j, KEY, r, claim)


def test_a_false_alarm_and_an_incident_the_job_recorded_or_handled_are_signed() -> None:
    _, o = migrated("wf-3")
    ref = IncidentRef(workflow_id="wf-3", run_id=RUN, job_id="job-a")
    refuted = o.model_copy(update={"disposition": Disposition.NOT_A_FAILURE, "success": False})
    assert attest(job(None), KEY, ref, refuted)
    assert attest(job(None, recorded=(o.incident_id,)), KEY, ref, o)
    assert attest(job(None, handled=("wf-3",)), KEY, ref, o)
