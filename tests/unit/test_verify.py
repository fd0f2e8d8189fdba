"""The ledger's rules for what it counts (`torchpass.contract.verify`) and how the book keeps
refused claims: each rule refuses its forgery, and a genuine claim passes them all."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

from tests.unit.test_contract_rules import T0, covered_book, outcome, report
from torchpass.contract.entries import EntryStatus
from torchpass.contract.verify import (
    MAX_REJECTED_KEPT,
    MAX_UNVERIFIED,
    IncidentFacts,
    Quarantine,
    ValidationFacts,
    judge_outcome,
    judge_validation,
    split_run,
)
from torchpass.ids import WorkflowName, incident_workflow_id
from torchpass.incident.attestation import JobKey
from torchpass.incident.outcome import MigrationOutcome
from torchpass.models import ContractRef, EventSource, Evidence, FailureKind, FailureReport
from torchpass.validation.report import ValidateInput

T = T0 + timedelta(days=30)
RUN = str(uuid.UUID(int=7))
WF = incident_workflow_id("job-a", "node-1", 4)
KEY = JobKey.generate()  # the job's
QUEUE = "torchpass-control"  # the control worker's


def failure(job: str = "job-a", domain: str = "node-1", generation: int = 4) -> FailureReport:
    ev = Evidence(
        kind=FailureKind.PROCESS_EXIT,
        source=EventSource.RANK,
        job_id=job,
        failure_domain=domain,
        observed_at=T,
    )
    return FailureReport(
        evidence=ev,
        job_task_queue="q",
        generation=generation,
        contract=ContractRef(customer_id="a", contract_id="c"),
    )


def genuine() -> tuple[MigrationOutcome, IncidentFacts]:
    o = outcome(1, T, incident_id=f"{WF}/{RUN}")
    o = o.model_copy(update={"attestation": KEY.attest(o)})
    return o, IncidentFacts(
        found=True, workflow_type=WorkflowName.MIGRATION, report=failure(), signalled=(o,)
    )


def test_an_incident_id_splits_at_its_run_id_only() -> None:
    assert split_run(f"{WF}/{RUN}") == (WF, RUN)
    assert split_run(WF) == (WF, None)
    assert split_run("a/b/not-a-uuid") == ("a/b/not-a-uuid", None)


def test_a_genuine_outcome_is_accepted_with_its_failure() -> None:
    o, facts = genuine()
    v = judge_outcome(o, facts, [KEY.public])
    assert v.accepted and v.attested and v.failure_key == WF and v.reason == ""


def test_an_outcome_its_job_did_not_sign_is_kept_unconfirmed_and_never_counts() -> None:
    """The forged MigrationWorkflow (a genuine run pointed at a queue no job serves): its history
    bears the outcome out, but the job never signed it. So is one signed by another key, one whose
    figures changed after the job signed them, and one of a job no validation gave a key."""
    o, facts = genuine()
    other = JobKey.generate()
    cases = {
        "never attested": (o.model_copy(update={"attestation": None}), [KEY.public]),
        "not the job's signature": (
            o.model_copy(update={"attestation": other.attest(o)}),
            [KEY.public],
        ),
        "not the job's signature ": (
            o.model_copy(update={"steps_recomputed": 0, "success": False}),
            [KEY.public],
        ),
        "no key of the job is registered": (o, []),
    }
    for why, (claim, keys) in cases.items():
        v = judge_outcome(claim, facts.model_copy(update={"signalled": (claim,)}), keys)
        assert v.accepted and not v.attested and why.strip() in v.reason, (why, v)
    book = covered_book()
    forged = o.model_copy(update={"attestation": None, "success": False})
    assert book.record_checked(forged, WF, attested=False)
    assert book.entries[forged.incident_id].status is EntryStatus.UNCONFIRMED
    assert book.standing(T).qualifying == 0


def test_an_incident_moved_off_a_squatted_id_counts_under_its_failure() -> None:
    """`IncidentTracker.rekey` moves an incident to its key + ':x' + 16 hex digits: counted under
    the key, so it and anything at the squatted id are one failure. Any other suffix is not its
    failure's id."""
    o, facts = genuine()
    moved = f"{WF}:x0123456789abcdef"
    m = o.model_copy(update={"incident_id": f"{moved}/{RUN}"})
    v = judge_outcome(m, facts.model_copy(update={"signalled": (m,)}))
    assert v.accepted and v.failure_key == WF
    for suffix in (":x0123", ":xNOTHEXNOTHEXNOT", ":y0123456789abcdef", "x0123456789abcdef"):
        f = o.model_copy(update={"incident_id": f"{WF}{suffix}/{RUN}"})
        v = judge_outcome(f, facts.model_copy(update={"signalled": (f,)}))
        assert not v.accepted and "not at its failure's incident id" in v.reason, suffix


def test_every_forged_outcome_is_refused_with_why() -> None:
    o, facts = genuine()
    changed = o.model_copy(update={"success": False})
    cases = {
        "names no workflow run": (o.model_copy(update={"incident_id": WF}), facts),
        "no such incident workflow": (o, IncidentFacts(found=False, detail="NOT_FOUND")),
        "not an incident": (o, facts.model_copy(update={"workflow_type": WorkflowName.CONTRACT})),
        "start input is not a failure report": (o, facts.model_copy(update={"report": None})),
        "was started for job": (o, facts.model_copy(update={"report": failure(job="job-b")})),
        "not at its failure's incident id": (
            o,
            facts.model_copy(update={"report": failure(generation=5)}),
        ),
        "sent no outcome": (o, facts.model_copy(update={"signalled": ()})),
        "sent another outcome": (changed, facts),
    }
    for why, (claim, f) in cases.items():
        v = judge_outcome(claim, f, [KEY.public])
        assert not v.accepted and why in v.reason, (why, v)


def test_a_validation_is_accepted_only_from_the_run_that_made_it() -> None:
    source = f"validate-job-a/{RUN}"
    proof = KEY.prove("job-a", source)
    made = report(True, T).model_copy(
        update={"source": source, "job_key": KEY.public, "job_proof": proof}
    )
    request = ValidateInput(contract_id="c-1", customer_id="a", job_id="job-a")
    facts = ValidationFacts(
        found=True,
        workflow_type=WorkflowName.VALIDATION,
        task_queue=QUEUE,
        request=request,
        recorded=(made,),
    )
    assert judge_validation(made, facts, QUEUE).accepted
    # its job's proof, of another key, or of another run
    stolen = made.model_copy(update={"job_key": JobKey.generate().public})
    replayed = made.model_copy(update={"job_proof": KEY.prove("job-a", f"validate-job-a/{RUN}x")})
    cases = {
        "names no validation workflow run": (made.model_copy(update={"source": None}), facts),
        "no such validation workflow": (made, ValidationFacts(found=False)),
        "not a validation": (
            made,
            facts.model_copy(update={"workflow_type": WorkflowName.MIGRATION}),
        ),
        "another contract or job": (
            made,
            facts.model_copy(update={"request": request.model_copy(update={"job_id": "job-b"})}),
        ),
        "did not make this report": (
            made.model_copy(update={"validated_at": datetime.now(UTC)}),
            facts,
        ),
        # the attacker's own worker running a workflow of the validation's type
        "not on the control worker's": (made, facts.model_copy(update={"task_queue": "mine"})),
        "did not prove it holds the key": (
            stolen,
            facts.model_copy(update={"recorded": (stolen,)}),
        ),
        "did not prove it holds the key ": (
            replayed,
            facts.model_copy(update={"recorded": (replayed,)}),
        ),
        "did not prove it holds the key  ": (
            made.model_copy(update={"job_key": None, "job_proof": None}),
            facts.model_copy(
                update={"recorded": (made.model_copy(update={"job_key": None, "job_proof": None}),)}
            ),
        ),
    }
    for why, (claim, f) in cases.items():
        v = judge_validation(claim, f, QUEUE)
        assert not v.accepted and why.strip() in v.reason, (why, v)


def test_a_refused_claim_never_counts_nor_blocks_the_genuine_one() -> None:
    book = covered_book()
    o = outcome(1, T, incident_id=f"{WF}/{RUN}", success=False)
    book.checks.reject(o.incident_id, o.job_id, o.detected_at, "forged")  # a forgery arriving first
    assert book.standing(T).qualifying == 0
    assert book.record_checked(o, WF)  # the genuine outcome of that id is counted
    assert book.entries[o.incident_id].status.value == "failure"
    again = outcome(2, T, incident_id=f"{WF}/{uuid.UUID(int=8)}")  # the same failure, a second run
    assert not book.record_checked(again, WF)
    assert (
        again.incident_id not in book.entries
        and "the same failure" in book.checks.rejected[-1].reason
    )
    assert (book.duplicates, book.checks.rejected_claims) == (1, 2)


def test_the_quarantine_is_bounded_and_every_refusal_is_counted() -> None:
    q = Quarantine()
    for n in range(MAX_UNVERIFIED):
        assert q.hold(outcome(n, T))
    assert not q.hold(outcome(-1, T)) and len(q.unverified) == MAX_UNVERIFIED
    for n in range(MAX_REJECTED_KEPT + 5):
        q.reject(f"x-{n}", "job-a", T, "forged " * 200)
    assert len(q.rejected) == MAX_REJECTED_KEPT and q.rejected_claims == MAX_REJECTED_KEPT + 6
    assert (
        q.rejected[-1].claim == f"x-{MAX_REJECTED_KEPT + 4}" and len(q.rejected[-1].reason) <= 500
    )


def test_on_a_contract_with_an_enrolment_key_only_jobs_it_vouched_for_are_registered() -> None:
    """Temporal access alone can serve a made-up job to a genuine validation (it runs on the control
    queue and the job proves a key of its own); the cluster's enrolment key, held only by the job
    hosts, is what such a job cannot have."""
    enrolment, other = JobKey.generate(), JobKey.generate()
    source = f"validate-job-a/{RUN}"
    proof = KEY.prove("job-a", source)
    made = report(True, T).model_copy(
        update={"source": source, "job_key": KEY.public, "job_proof": proof}
    )
    request = ValidateInput(contract_id="c-1", customer_id="a", job_id="job-a")

    def judged(endorsement: str | None, enrolment_key: str | None) -> str:
        r = made.model_copy(update={"job_endorsement": endorsement})
        facts = ValidationFacts(
            found=True,
            workflow_type=WorkflowName.VALIDATION,
            task_queue=QUEUE,
            request=request,
            recorded=(r,),
        )
        v = judge_validation(r, facts, QUEUE, enrolment_key)
        return "accepted" if v.accepted else v.reason

    vouched = enrolment.endorse("job-a", KEY.public)
    assert judged(vouched, enrolment.public) == "accepted"
    assert judged(None, None) == "accepted"  # a contract naming no enrolment key
    for endorsement in (
        None,
        other.endorse("job-a", KEY.public),
        enrolment.endorse("job-b", KEY.public),
    ):
        assert "not vouched for by the contract's enrolment key" in judged(
            endorsement, enrolment.public
        )
