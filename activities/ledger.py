"""The ledger's checks: read the history of the workflow a claim names (`activities.histories`)
and let `torchpass.contract.verify` judge it.

Served by the control worker, whose client reads the namespace the incidents and validations run in.
Idempotent: it only reads. A claim naming no workflow (or one of another type, or one that never
sent it) is an answer, a refused `Verdict`; only a server that does not answer is an error, retried.
"""

from __future__ import annotations

from temporalio import activity
from temporalio.client import Client

from activities.histories import HistoryReader
from torchpass.contract.verify import (
    OutcomeClaims,
    ValidationClaim,
    Verdict,
    Verdicts,
    judge_outcome,
    judge_validation,
)
from torchpass.ids import ControlActivity


class LedgerActivities:
    """Built by the control worker; `client` reads histories (default: the worker's own)."""

    def __init__(self, client: Client | None = None) -> None:
        self._client = client

    @activity.defn(name=ControlActivity.VERIFY_OUTCOMES)
    async def verify_outcomes(self, inp: OutcomeClaims) -> Verdicts:
        verdicts = []
        for outcome in inp.outcomes:
            facts = await self._reader().incident(outcome.incident_id, inp.contract_workflow_id)
            verdicts.append(judge_outcome(outcome, facts, inp.keys.get(outcome.job_id, ())))
            activity.heartbeat(len(verdicts))
        return Verdicts(verdicts=tuple(verdicts))

    @activity.defn(name=ControlActivity.VERIFY_VALIDATION)
    async def verify_validation(self, inp: ValidationClaim) -> Verdict:
        facts = await self._reader().validation(inp.report.source or "")
        # A genuine validation runs on the control worker's own queue: this one's.
        return judge_validation(inp.report, facts, activity.info().task_queue, inp.enrolment_key)

    def _reader(self) -> HistoryReader:
        return HistoryReader(self._client or activity.client())
