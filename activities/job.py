"""Activities on a job's own task queue, served by the Temporal worker inside its coordinator.

Thin: each turns one model into a call on `job_agent.coordinator.incident.executor.IncidentSteps`
and its errors into ApplicationErrors that carry the retry decision. The transfer's heartbeats carry
the bytes streamed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from temporalio import activity
from temporalio.exceptions import ApplicationError

from job_agent.coordinator.coordinator import Coordinator
from job_agent.coordinator.describe import describe
from job_agent.coordinator.incident.attest import attest
from job_agent.coordinator.incident.executor import IncidentSteps
from job_agent.coordinator.incident.lifecycle import IncidentError
from job_agent.coordinator.waiting import JobFailed
from torchpass.errors import ErrorType
from torchpass.ids import JobActivity, JobActivityV0
from torchpass.incident.attestation import JobKey
from torchpass.incident.outcome import CompleteInput
from torchpass.incident.steps import (
    ConfirmInput,
    ConfirmResult,
    FallbackInput,
    FallbackResult,
    FreezeResult,
    IncidentRef,
    LocalRecord,
    RejoinResult,
    ReserveResult,
    TransferResult,
)
from torchpass.validation.facts import JobDescription, ValidationTarget

T = TypeVar("T")


# seconds; the workflow's heartbeat timeout for a job activity is 5 s (torchpass.policies)
BEAT_EVERY = 1.0


async def _beat(details: Callable[[], Any]) -> None:
    while True:
        activity.heartbeat(*details())
        await asyncio.sleep(BEAT_EVERY)


async def _guard(call: Awaitable[T], details: Callable[[], Any] = tuple) -> T:
    """The step, its errors as ApplicationErrors, and a heartbeat each second while it runs (with
    `details()`): a worker or server lost mid-step is noticed in seconds, not at the step's whole
    start-to-close timeout."""
    beating = asyncio.create_task(_beat(details))
    try:
        return await call
    except IncidentError as e:
        raise ApplicationError(
            str(e), type=e.error_type.value, non_retryable=not e.retryable
        ) from e
    except JobFailed as e:
        raise ApplicationError(str(e), type=ErrorType.JOB_GONE.value, non_retryable=True) from e
    except TimeoutError as e:
        raise ApplicationError(str(e), type=ErrorType.TIMEOUT.value) from e
    finally:
        beating.cancel()


class _BytesSent:
    """The transfer's heartbeat details: the bytes streamed so far, as the donor reports them."""

    def __init__(self) -> None:
        self.sent = 0

    def __call__(self, sent: int) -> None:
        self.sent = sent

    def details(self) -> tuple[dict[str, int]]:
        return ({"bytes_sent": self.sent},)


class JobActivities:
    """Built by the job worker with its coordinator and the incident steps acting on it."""

    def __init__(
        self,
        coordinator: Coordinator,
        steps: IncidentSteps,
        key: JobKey,
        endorsement: str | None = None,
    ) -> None:
        self._c = coordinator
        self._a = steps
        self._key = key
        self._endorsement = endorsement  # the cluster's enrolment key's word for `key`

    def _step(self, ref: IncidentRef) -> None:
        """A workflow step reached the job: refused for an incident the job carried out itself while
        the control plane was away (the workflow then files the job's record instead)."""
        if not self._c.incidents.answered(ref.workflow_id):
            raise ApplicationError(
                f"job {self._c.job_id} handled incident {ref.workflow_id} itself; file its record",
                type=ErrorType.HANDLED_LOCALLY.value,
                non_retryable=True,
            )

    @activity.defn(name=JobActivity.CONFIRM_FAILURE)
    async def confirm_failure(self, inp: ConfirmInput) -> ConfirmResult:
        self._step(inp.incident)
        return await _guard(self._a.confirm(inp.incident, inp.evidence))

    @activity.defn(name=JobActivity.RESERVE_SPARES)
    async def reserve_spares(self, inp: IncidentRef) -> ReserveResult:
        self._step(inp)
        return await _guard(self._a.reserve(inp))

    @activity.defn(name=JobActivityV0.RESERVE_SPARE)
    async def reserve_spare_v0(self, inp: IncidentRef) -> ReserveResult:
        """`reserve_spares` under its name from before the `activity-names` patch (older runs call
        it)."""
        return await self.reserve_spares(inp)

    @activity.defn(name=JobActivity.RELEASE_SPARE)
    async def release_spare(self, inp: IncidentRef) -> None:
        self._step(inp)
        await _guard(self._a.release(inp))

    @activity.defn(name=JobActivity.FREEZE_RANKS)
    async def freeze_ranks(self, inp: IncidentRef) -> FreezeResult:
        self._step(inp)
        return await _guard(self._a.freeze(inp))

    @activity.defn(name=JobActivity.TRANSFER_STATE)
    async def transfer_state(self, inp: IncidentRef) -> TransferResult:
        self._step(inp)
        sent = _BytesSent()
        return await _guard(self._a.transfer(inp, tick=sent), sent.details)

    @activity.defn(name=JobActivity.REJOIN)
    async def rejoin(self, inp: IncidentRef) -> RejoinResult:
        self._step(inp)
        return await _guard(self._a.rejoin(inp))

    @activity.defn(name=JobActivity.RESTART_FROM_CHECKPOINT)
    async def restart_from_checkpoint(self, inp: FallbackInput) -> FallbackResult:
        self._step(inp.incident)
        return await _guard(self._a.restart_from_checkpoint(inp.incident, inp.reason))

    @activity.defn(name=JobActivity.FETCH_LOCAL_RECORD)
    async def fetch_local_record(self, inp: IncidentRef) -> LocalRecord:
        """The record of an incident the job handled itself; waits (heart-beating) while it still
        runs."""
        return await _guard(self._c.incidents.records.record_of(inp.workflow_id))

    @activity.defn(name=JobActivityV0.RECORDED_OUTCOME)
    async def recorded_outcome_v0(self, inp: IncidentRef) -> LocalRecord:
        """`fetch_local_record` under its name from before the `activity-names` patch."""
        return await self.fetch_local_record(inp)

    @activity.defn(name=JobActivity.COMPLETE_INCIDENT)
    async def complete_incident(self, inp: CompleteInput) -> None:
        await _guard(self._a.complete(inp.incident, inp.outcome))

    @activity.defn(name=JobActivity.ATTEST_OUTCOME)
    async def attest_outcome(self, inp: CompleteInput) -> str:
        """The job's signature over the outcome's facts, once they agree with its own view (on the
        coordinator's loop, like every step: it reads the incident the steps act on)."""

        async def sign() -> str:
            return attest(self._c, self._key, inp.incident, inp.outcome)

        return await _guard(sign())

    @activity.defn(name=JobActivity.DESCRIBE_JOB)
    async def describe_job(self, inp: ValidationTarget) -> JobDescription:
        if inp.job_id != self._c.job_id:  # a queue name pointing at the wrong job: no retry helps
            raise ApplicationError(
                f"this is job {self._c.job_id}, not {inp.job_id}",
                type=ErrorType.INVALID_INPUT.value,
                non_retryable=True,
            )
        desc = describe(self._c)
        if inp.source is None:
            return desc
        proof = self._key.prove(self._c.job_id, inp.source)
        return desc.model_copy(
            update={"key": self._key.public, "proof": proof, "endorsement": self._endorsement}
        )
