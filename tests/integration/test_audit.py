"""`torchpass audit` flags a ledger that does not match the histories: a contract whose ledger
checks were replaced (a worker of its own on the contract's queue, taking every claim on trust, as a
tampered or compromised control worker would) counts a made-up failure and a made-up validation; the
audit, reading only the histories in the namespace, names the row and exits 1. The agreeing case, a
real job's incident, is in test_contract_cli.py; the demo runs the audit too."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime

import pytest
from temporalio.client import Client
from temporalio.worker import Worker

from tests.integration.test_contract_cli import _cli
from tests.workflows.test_contract import TRUSTING
from torchpass.contract.credit import Money
from torchpass.contract.rules import add_months
from torchpass.contract.terms import ContractTerms
from torchpass.incident.outcome import MigrationOutcome
from torchpass.models import Category, Classification, Disposition, FailureKind
from torchpass.validation.report import CheckResult, ValidationReport
from workers import contract_client as cc
from workflows.contract import CONTRACT_WORKFLOWS

pytestmark = pytest.mark.integration


def forged_failure(job_id: str) -> MigrationOutcome:
    """A failure no incident workflow ever had."""
    return MigrationOutcome(
        incident_id=f"torchpass-incident:{job_id}:node-1:g0/{uuid.uuid4()}",
        job_id=job_id,
        failure_domain="node-1",
        kind=FailureKind.PROCESS_EXIT,
        evidence_count=1,
        classification=Classification(
            category=Category.INTERRUPTION, qualifying=True, reason="exit"
        ),
        covered=True,
        disposition=Disposition.FAILED,
        success=False,
        detected_at=datetime.now(UTC),
    )


async def test_the_audit_flags_a_row_no_incident_bears_out(
    client: Client, capsys: pytest.CaptureFixture[str]
) -> None:
    cust, cid = "audit-customer", f"c-{uuid.uuid4().hex[:8]}"
    queue = f"tampered-{uuid.uuid4().hex[:6]}"
    today = datetime.now(UTC).date()
    terms = ContractTerms(
        customer_id=cust,
        contract_id=cid,
        start=today,
        renewal_date=add_months(today, 12),
        annual_fee=Money(amount="120000", currency="USD"),
    )
    async with Worker(client, task_queue=queue, workflows=CONTRACT_WORKFLOWS, activities=TRUSTING):
        handle = await cc.create_contract(client, terms, task_queue=queue)
        await cc.opt_in(client, cust, cid, "job-x")
        check = CheckResult(name="agent_present", passed=True)
        report = ValidationReport(
            contract_id=cid,
            job_id="job-x",
            passed=True,
            checks=(check,),
            validated_at=datetime.now(UTC),
        )
        await cc.record_validation(client, cust, report)
        forged = forged_failure("job-x")
        await cc.record_outcome(client, cust, cid, forged)
        for _ in range(100):
            standing = await cc.get_standing(client, cust, cid)
            if standing.unverified == 0:
                break
            await asyncio.sleep(0.1)
        assert (standing.qualifying, standing.successful) == (1, 0)  # the tampered ledger counts it
        code, out, err = await _cli(client, capsys, "audit", "--customer", cust, "--contract", cid)
        await handle.terminate("test done")
    assert code == 1, out + err
    assert forged.incident_id in out and "no incident run of this contract bears it out" in out
    assert "audit               0          0" in out and "ledger              1          0" in out
