"""`torchpass contract ...` and `torchpass cost --contract` against the real dev server and control
worker.

The CLI runs as users run it (its own event loop and Temporal connection, here in a thread); the
contract is a real ContractWorkflow and the incident a real MigrationWorkflow of a real job that
loses a rank.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from temporalio.client import Client

from job_agent import wire
from job_agent.coordinator.jobs import request, wait_until_ready
from tests.integration.conftest import run_with, spec, start_job
from torchpass.cli import main
from torchpass.models import ContractRef


async def _cli(
    client: Client, capsys: pytest.CaptureFixture[str], *argv: str
) -> tuple[int, str, str]:
    address = client.service_client.config.target_host
    code = await asyncio.to_thread(main, [*argv, "--address", address])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def ids() -> tuple[str, str]:
    return "cli-customer", f"c-{uuid.uuid4().hex[:8]}"


async def test_contract_commands_create_show_ledger_expand_renew(
    client: Client, capsys: pytest.CaptureFixture[str], ids: tuple[str, str]
) -> None:
    cust, cid = ids
    who = ("--customer", cust, "--contract", cid)
    start = datetime.now(UTC).date().replace(day=1)
    code, out, err = await _cli(
        client, capsys, "contract", "create", *who, "--start", str(start), "--fee", "120,000"
    )
    assert code == 0, err
    assert f"renewal {start.replace(year=start.year + 1)}" in out
    code, out, _ = await _cli(
        client, capsys, "contract", "opt-in", *who, "--job", "j1", "--no-validate"
    )
    assert code == 0 and "j1" in out
    code, out, _ = await _cli(client, capsys, "contract", "show", *who)
    assert code == 0 and "success rate" in out and "120,000.00 USD" in out
    code, out, _ = await _cli(client, capsys, "contract", "show", *who, "--json")
    standing = json.loads(out)
    assert standing["contract_id"] == cid and standing["qualifying"] == 0
    code, out, _ = await _cli(client, capsys, "contract", "ledger", *who)
    assert code == 0 and "0 of 0 entries" in out
    code, out, err = await _cli(client, capsys, "contract", "renew", *who)
    assert code == 0, err
    assert f"term ending {start.replace(year=start.year + 1)}" in out
    code, out, _ = await _cli(client, capsys, "contract", "show", *who, "--json")
    assert json.loads(out)["renewed"] is True


async def test_contract_bad_input_gets_a_clear_error(
    client: Client, capsys: pytest.CaptureFixture[str], ids: tuple[str, str]
) -> None:
    cust, cid = ids
    who = ("--customer", cust, "--contract", cid)
    code, _, err = await _cli(
        client, capsys, "contract", "create", *who, "--start", "2026-06-01", "--fee", "-5"
    )
    assert code == 2 and "fee" in err.lower()
    code, _, err = await _cli(
        client,
        capsys,
        "contract",
        "create",
        *who,
        "--start",
        "2026-06-01",
        "--renewal",
        "2026-01-01",
        "--fee",
        "1000",
    )
    assert code == 2 and "renewal" in err.lower()
    code, _, err = await _cli(
        client, capsys, "contract", "show", "--customer", cust, "--contract", "nope"
    )
    assert code == 2 and "nope" in err
    with pytest.raises(SystemExit):
        await _cli(client, capsys, "contract", "create", *who, "--start", "June 1st", "--fee", "1")


async def test_a_validated_jobs_incident_counts_on_its_contract_and_feeds_cost(
    client: Client, capsys: pytest.CaptureFixture[str], ids: tuple[str, str], tmp_path: Path
) -> None:
    cust, cid = ids
    who = ("--customer", cust, "--contract", cid)
    start = datetime.now(UTC).date().replace(day=1)
    code, out, err = await _cli(
        client,
        capsys,
        "contract",
        "create",
        *who,
        "--start",
        str(start),
        "--fee",
        "1e5",
        "--development",
    )
    assert code == 0, err
    assert "DEVELOPMENT contract" in out and "development contract" in out
    customer = ("--customer", cust, "--contract", f"{cid}-customer")
    code, _, err = await _cli(
        client, capsys, "contract", "create", *customer, "--start", str(start), "--fee", "1e5"
    )
    assert code == 0, err
    job = spec(
        tmp_path,
        f"cli-{cid}",
        contract=ContractRef(customer_id=cust, contract_id=cid),
        args=("--steps", "400", "--width", "128", "--depth", "2"),
    )
    task = await start_job(client, job)
    try:
        await asyncio.to_thread(wait_until_ready, job.state_dir, job.job_id, timedelta(seconds=60))
        # This host has neither Slurm nor Kubernetes: the explicit development override waives that
        # check, which a customer contract does not accept and a development contract does.
        code, out, err = await _cli(
            client, capsys, "contract", "opt-in", *customer, "--job", job.job_id, "--allow-local"
        )
        assert code == 1, out + err
        assert "WAIVED" in out and "not covered (waived checks on a customer contract)" in out
        code, out, err = await _cli(
            client, capsys, "contract", "opt-in", *who, "--job", job.job_id, "--allow-local"
        )
        assert code == 0, out + err
        assert "WAIVED" in out and "  ok " in out and "agent_present" in out
        last = out.strip().splitlines()[-1]
        assert last == f"job {job.job_id}: covered (development contract: scheduler waived)"
        kill = wire.Inject(action=wire.InjectAction.KILL, slot=2)
        assert isinstance(
            await asyncio.to_thread(request, job.state_dir, job.job_id, kill), wire.Ok
        )
        result = await asyncio.wait_for(asyncio.shield(task), 150)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    assert result.ok and result.incidents[0].success and result.incidents[0].error is None
    assert result.incidents[0].covered  # the job runs under a contract
    incident = result.incidents[0].incident_id
    for _ in range(50):  # the outcome's signal is asynchronous
        code, out, _ = await _cli(client, capsys, "contract", "show", *who, "--json")
        if json.loads(out)["qualifying"] == 1:
            break
        await asyncio.sleep(0.1)
    standing = json.loads(out)
    assert (standing["qualifying"], standing["successful"]) == (1, 1)
    code, out, _ = await _cli(client, capsys, "contract", "ledger", *who)
    assert incident in out and "success" in out and out.startswith("DEVELOPMENT contract")
    code, out, _ = await _cli(client, capsys, "contract", "show", *who)
    assert out.startswith("DEVELOPMENT contract") and "development" in out
    code, out, err = await _cli(
        client, capsys, "cost", "--contract", cid, "--customer", cust, "--json"
    )
    assert code == 0, err
    measured = json.loads(out)
    assert measured["inputs"]["success_rate"] in ("1", "1.0", 1, 1.0)
    # The auditor's recomputation from the incident's and the validation's own histories agrees.
    code, out, err = await _cli(client, capsys, "audit", *who)
    assert code == 0, out + err
    assert "the ledger agrees with the histories" in out
    assert "audit               1          1" in out


async def test_an_uncovered_jobs_incident_is_recorded_but_excluded(
    client: Client, capsys: pytest.CaptureFixture[str], ids: tuple[str, str], tmp_path: Path
) -> None:
    cust, cid = ids
    who = ("--customer", cust, "--contract", cid)
    start = datetime.now(UTC).date().replace(day=1)
    assert (
        await _cli(
            client, capsys, "contract", "create", *who, "--start", str(start), "--fee", "1e5"
        )
    )[0] == 0
    job = spec(tmp_path, f"cli-{cid}", contract=ContractRef(customer_id=cust, contract_id=cid))
    result = await run_with(client, job, [("kill", 2, 20)])
    assert result.ok and result.incidents[0].success and result.incidents[0].error is None
    incident = result.incidents[0].incident_id
    for _ in range(50):  # the outcome's signal is asynchronous
        code, out, _ = await _cli(client, capsys, "contract", "ledger", *who)
        if incident in out:
            break
        await asyncio.sleep(0.1)
    assert incident in out and "not_opted_in" in out  # recorded, excluded with its reason
    code, _, err = await _cli(client, capsys, "cost", "--contract", cid, "--customer", cust)
    assert code == 2 and "no qualifying" in err.lower()
