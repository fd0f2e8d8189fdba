"""How MigrationWorkflow runs one step: an activity by name, with its timeouts and retries
(`torchpass.policies`), timed into the incident's phases. A step that fails past its retries, or
with a non-retryable error, raises `StepFailed` carrying the error's type."""

from __future__ import annotations

from typing import Any, TypeVar

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from torchpass.models import Phase, PhaseTiming
    from torchpass.policies import ACTIVITY_TIMEOUTS, MIGRATION_RETRY
    from workflows.logs import logger
    from workflows.policy import retry_policy

R = TypeVar("R")
RETRY_POLICY = retry_policy(MIGRATION_RETRY)


class StepFailed(Exception):
    """A step failed past its retries (or with a non-retryable error), or its answer did not
    hold."""

    def __init__(self, name: str, err: ActivityError | None = None, why: str = "") -> None:
        cause = err.cause if err is not None else None
        self.error_type = cause.type if isinstance(cause, ApplicationError) else None
        super().__init__(f"{name} failed: {why or cause or err}")


class StepCalls:
    """The steps of one incident: where the job's run (`queue`), which phase is running, how long
    each took."""

    def __init__(self, queue: str) -> None:
        self.queue = queue
        self.phase = Phase.DETECT
        self.phases: dict[Phase, PhaseTiming] = {}

    async def call(
        self, phase: Phase, name: str, arg: Any, result_type: type[R], queue: str | None = None
    ) -> R:
        """One step: the activity by name, its timeouts and retries, and its timing (a phase run
        twice, as classification after a failed reservation, is timed as one)."""
        self.phase = phase
        t = ACTIVITY_TIMEOUTS[name]
        t0 = workflow.now()
        work: float | None = None
        try:
            result = await workflow.execute_activity(
                name,
                arg,
                task_queue=queue or self.queue,
                result_type=result_type,
                start_to_close_timeout=t.start_to_close,
                schedule_to_close_timeout=t.schedule_to_close,
                schedule_to_start_timeout=t.schedule_to_start,
                heartbeat_timeout=t.heartbeat,
                retry_policy=RETRY_POLICY,
            )
            work = getattr(result, "work_seconds", None)
            return result
        except ActivityError as e:
            raise StepFailed(name, e) from e
        finally:
            seconds = (workflow.now() - t0).total_seconds()
            prior = self.phases.get(phase)
            if prior is not None:
                seconds += prior.seconds
                work = (
                    None
                    if work is None or prior.work_seconds is None
                    else work + prior.work_seconds
                )
            self.phases[phase] = PhaseTiming(phase=phase, seconds=seconds, work_seconds=work)

    async def attempt(self, name: str, arg: Any) -> str | None:
        """A best-effort job step (compensation, the job's record): returns the error instead of
        raising."""
        t = ACTIVITY_TIMEOUTS[name]
        try:
            await workflow.execute_activity(
                name,
                arg,
                task_queue=self.queue,
                start_to_close_timeout=t.start_to_close,
                schedule_to_close_timeout=t.schedule_to_close,
                schedule_to_start_timeout=t.schedule_to_start,
                retry_policy=RETRY_POLICY,
            )
        except ActivityError as e:
            logger.warning("%s failed: %s", name, e.cause or e)
            return str(StepFailed(name, e))
        return None
