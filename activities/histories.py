"""Reading the history of a workflow a claim names: the facts the ledger's checks
(`activities.ledger`) and `torchpass audit` judge with `torchpass.contract.verify`.

Idempotent: it only reads. A claim naming no workflow (or one of another type) gives facts saying
so; only a server that does not answer raises.
"""

from __future__ import annotations

from typing import Any

from temporalio.api.common.v1 import Payload
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from torchpass.contract.verify import MAX_EVENTS, IncidentFacts, ValidationFacts, split_run
from torchpass.ids import ContractMessage, ValidationActivity
from torchpass.incident.outcome import MigrationOutcome
from torchpass.models import FailureReport
from torchpass.validation.report import RecordValidationInput, ValidateInput, ValidationReport

_MAX_SENT = 20  # outcomes one incident signalled that are decoded; a genuine one sends one


class _TooLong(Exception):
    pass


class HistoryReader:
    """The facts of claimed workflows, read through `client` (its data converter decodes)."""

    def __init__(self, client: Client) -> None:
        self._client = client

    async def incident(self, claim: str, contract_workflow_id: str) -> IncidentFacts:
        events, detail = await self._history(claim)
        if events is None:
            return IncidentFacts(found=False, detail=detail)
        kind, start = _started(events[0])
        sent: list[MigrationOutcome] = []
        for ev in events:
            if ev.event_type != EventType.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED:
                continue
            a = ev.signal_external_workflow_execution_initiated_event_attributes
            if (
                a.workflow_execution.workflow_id != contract_workflow_id
                or a.signal_name != ContractMessage.RECORD_OUTCOME
            ):
                continue
            if len(sent) < _MAX_SENT and (
                o := await self._decode(a.input.payloads, MigrationOutcome)
            ):
                sent.append(o)
        report = await self._decode(start, FailureReport)
        why = "" if report is not None else "undecodable"
        return IncidentFacts(
            found=True, workflow_type=kind, report=report, signalled=tuple(sent), detail=why
        )

    async def validation(self, claim: str) -> ValidationFacts:
        events, detail = await self._history(claim)
        if events is None:
            return ValidationFacts(found=False, detail=detail)
        kind, start = _started(events[0])
        queue = events[0].workflow_execution_started_event_attributes.task_queue.name
        recorded: list[ValidationReport] = []
        for ev in events:
            if ev.event_type != EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
                continue
            a = ev.activity_task_scheduled_event_attributes
            if (
                a.activity_type.name != ValidationActivity.RECORD_VALIDATION
                or len(recorded) >= _MAX_SENT
            ):
                continue
            if (rec := await self._decode(a.input.payloads, RecordValidationInput)) is not None:
                recorded.append(rec.report)
        request = await self._decode(start, ValidateInput)
        return ValidationFacts(
            found=True,
            workflow_type=kind,
            task_queue=queue,
            request=request,
            recorded=tuple(recorded),
        )

    async def _history(self, claim: str) -> tuple[list[HistoryEvent] | None, str]:
        """The named run's history so far (a running workflow's too), or None and why not."""
        workflow_id, run_id = split_run(claim)
        if run_id is None or not workflow_id:
            return None, "not a workflow id/run id"
        client = self._client
        events: list[HistoryEvent] = []
        try:
            async for ev in client.get_workflow_handle(
                workflow_id, run_id=run_id
            ).fetch_history_events():
                events.append(ev)
                if len(events) > MAX_EVENTS:
                    raise _TooLong
        except _TooLong:
            return None, f"its history is longer than {MAX_EVENTS} events"
        except RPCError as e:
            if e.status not in (RPCStatusCode.NOT_FOUND, RPCStatusCode.INVALID_ARGUMENT):
                raise  # the server did not answer: retried
            return None, f"{e.status.name}: {e.message}"[:300]
        if not events or not events[0].HasField("workflow_execution_started_event_attributes"):
            return None, "its history has no start"
        return events, ""

    async def _decode(self, payloads: Any, model: type[Any]) -> Any:
        """One payload as `model`, through the client's converter (its codec included); None if it
        is not."""
        if len(payloads) != 1:
            return None
        client = self._client
        try:
            (value,) = await client.data_converter.decode(list(payloads), [model])
        except Exception:  # not this model: the claim's workflow did not make it
            return None
        return value if isinstance(value, model) else None


def _started(first: HistoryEvent) -> tuple[str, list[Payload]]:
    a = first.workflow_execution_started_event_attributes
    return a.workflow_type.name, list(a.input.payloads)
