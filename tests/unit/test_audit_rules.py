"""`torchpass audit`'s rules (`torchpass.contract.audit`): the ledger's rows against what the
histories and the jobs' signatures make of them, every disagreement named and nothing else."""

from __future__ import annotations

import uuid
from datetime import timedelta

from tests.unit.test_contract_rules import T0, outcome, report
from tests.unit.test_verify import KEY, QUEUE, failure
from torchpass.contract.audit import Validations, audit
from torchpass.contract.entries import EntryStatus
from torchpass.contract.queries import LedgerRow
from torchpass.contract.terms import ContractPurpose
from torchpass.contract.verify import IncidentFacts, ValidationFacts
from torchpass.ids import WorkflowName, incident_workflow_id
from torchpass.incident.outcome import MigrationOutcome
from torchpass.validation.report import ValidateInput

T = T0 + timedelta(days=30)
WINDOW = (T0.date(), (T + timedelta(days=1)).date())


def validated(queue: str = QUEUE) -> Validations:
    """job-a validated (passed) on the 1st of the window, with KEY proved, on `queue`."""
    source = f"validate-job-a/{uuid.UUID(int=9)}"
    made = report(True, T0).model_copy(
        update={"source": source, "job_key": KEY.public, "job_proof": KEY.prove("job-a", source)}
    )
    facts = ValidationFacts(
        found=True,
        workflow_type=WorkflowName.VALIDATION,
        task_queue=queue,
        request=ValidateInput(contract_id="c-1", customer_id="a", job_id="job-a"),
        recorded=(made,),
    )
    return Validations([(made, facts)], "c-1", ContractPurpose.CUSTOMER, QUEUE)


def incident(
    n: int, signed: bool = True, generation: int = 4
) -> tuple[MigrationOutcome, IncidentFacts]:
    """Run `n` of the failure of generation `generation` (4: `WF`'s)."""
    wf = incident_workflow_id("job-a", "node-1", generation)
    o = outcome(n, T + timedelta(minutes=n), incident_id=f"{wf}/{uuid.UUID(int=n)}")
    if signed:
        o = o.model_copy(update={"attestation": KEY.attest(o)})
    facts = IncidentFacts(
        found=True,
        workflow_type=WorkflowName.MIGRATION,
        report=failure(generation=generation),
        signalled=(o,),
    )
    return o, facts


def row(o: MigrationOutcome, status: EntryStatus) -> LedgerRow:
    return LedgerRow(
        incident_id=o.incident_id,
        job_id=o.job_id,
        detected_at=o.detected_at,
        status=status,
        counted=status in (EntryStatus.SUCCESS, EntryStatus.FAILURE),
        reason=None,
        late=False,
        duplicates=0,
    )


def test_a_ledger_that_matches_the_histories_has_no_finding() -> None:
    genuine = incident(1)
    result = audit([row(genuine[0], EntryStatus.SUCCESS)], [genuine], validated(), WINDOW)
    assert result.findings == () and (result.qualifying, result.successful) == (1, 1)


def test_every_disagreement_is_named() -> None:
    unsigned, genuine = incident(1, signed=False, generation=1), incident(2, generation=2)
    again = incident(3, generation=2)
    made_up = outcome(4, T, incident_id=f"torchpass-incident:job-a:n:g9/{uuid.UUID(int=4)}")
    rows = [
        row(unsigned[0], EntryStatus.FAILURE),  # counted though its job never signed it
        row(made_up, EntryStatus.FAILURE),  # no incident run at all
    ]
    # `genuine` is missing from the ledger; `again` is the same failure told by a second run
    result = audit(rows, [unsigned, genuine, again], validated(), WINDOW)
    found = {f.incident_id: f for f in result.findings}
    assert found.keys() == {unsigned[0].incident_id, made_up.incident_id, genuine[0].incident_id}
    u = found[unsigned[0].incident_id]
    assert (u.ledger, u.audit) == (EntryStatus.FAILURE, EntryStatus.UNCONFIRMED), u
    assert "never attested" in u.why
    m = found[made_up.incident_id]
    assert m.audit is None and "no incident run" in m.why
    g = found[genuine[0].incident_id]
    assert (g.ledger, g.audit, g.why) == (None, EntryStatus.SUCCESS, "missing from the ledger")
    assert (result.qualifying, result.successful) == (1, 1)  # the genuine one, once


def test_a_validation_off_the_control_queue_registers_no_key_and_covers_nothing() -> None:
    genuine = incident(1)
    result = audit([row(genuine[0], EntryStatus.SUCCESS)], [genuine], validated("mine"), WINDOW)
    (f,) = result.findings
    assert f.audit is EntryStatus.NOT_OPTED_IN and result.validations == 0


def test_a_day_the_ledger_keeps_as_counts_only_is_counted_not_compared() -> None:
    genuine = incident(1)
    result = audit([], [genuine], validated(), WINDOW, rolled_up=[genuine[0].detected_at.date()])
    assert result.findings == () and result.qualifying == 1
