"""The steps of one incident's recovery, as MigrationWorkflow asks them: confirm the failure with
the job, classify it, then migrate it live (reserve a spare, freeze, transfer the state, rejoin) or
fall back to a checkpoint restart, giving the spare back when a migration cannot finish.

Job-side steps are activities on the job's own task queue, served by the worker inside its
coordinator, and referenced by name; classification runs on the control queue, as an activity and
its one owner, so that a change to the table changes future incidents without breaking the replay of
old ones. What the job answers is checked again here (`torchpass.incident.proof`) before a migration
is recorded as live.

Which path a step takes before a patch is the workflow's decision (`workflows.migration` calls every
`workflow.patched`); a `Recovery` is told the answers.
"""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from torchpass.errors import ErrorType
    from torchpass.ids import CONTROL_TASK_QUEUE, ControlActivity, JobActivity, JobActivityV0
    from torchpass.incident.classify import classify_input, unable_to_recover, unclassified
    from torchpass.incident.outcome import Ending
    from torchpass.incident.proof import resume_problems, transfer_problems
    from torchpass.incident.steps import (
        ConfirmInput,
        ConfirmResult,
        FallbackInput,
        FallbackResult,
        FreezeResult,
        IncidentRef,
        RejoinResult,
        ReserveResult,
        TransferResult,
    )
    from torchpass.models import Classification, Disposition, Evidence, FailureKind, Phase
    from workflows import legacy
    from workflows.search_attributes import KIND, QUALIFYING
    from workflows.step_calls import StepCalls, StepFailed


class Recovery:
    """One incident's recovery steps, run through its `StepCalls`. `measured`: the run took the
    `measured-outcome` patch (the classifier owns the kind, proofs are checked); `renamed`: it took
    the `activity-names` patch (two job activities under their new names)."""

    def __init__(
        self, steps: StepCalls, measured: bool, renamed: bool, by_what_happened: bool = False
    ) -> None:
        self.steps = steps
        self.measured = measured
        self.renamed = renamed
        # the `classified-by-what-happened` patch: a recovery whose state lost its only source is
        # classified beyond redundancy, whatever was planned
        self.by_what_happened = by_what_happened

    def kind(self, evidence: tuple[Evidence, ...], c: Classification) -> FailureKind:
        """The kind that named the category, as the classifier said (our clock never reads the
        table)."""
        if not self.measured:
            return legacy.kind_of(evidence)
        return c.kind or evidence[0].kind

    async def confirm(
        self, ref: IncidentRef, evidence: tuple[Evidence, ...]
    ) -> tuple[ConfirmResult | None, str | None, str | None]:
        """The job's confirmation, or why there is none and the error's type."""
        inp = ConfirmInput(incident=ref, evidence=evidence)
        try:
            confirm = await self.steps.call(
                Phase.CONFIRM, JobActivity.CONFIRM_FAILURE, inp, ConfirmResult
            )
        except StepFailed as e:
            return None, str(e), e.error_type
        return confirm, None, None

    async def classify(
        self,
        evidence: tuple[Evidence, ...],
        confirm: ConfirmResult | None,
        spare_lost: bool = False,
    ) -> Classification:
        if self.measured:
            # Spare availability is evidence too: measured when the job confirmed, or learnt when
            # the reservation found none.
            inp = classify_input(evidence, confirm, spare_lost)
        else:
            inp = legacy.classify_input(evidence, confirm)
        try:
            c = await self.steps.call(
                Phase.CLASSIFY,
                ControlActivity.CLASSIFY_FAILURE,
                inp,
                Classification,
                CONTROL_TASK_QUEUE,
            )
        except StepFailed as e:
            # Our own step failed: it must never disqualify the customer's failure.
            c = unclassified(str(e)) if self.measured else legacy.judged_by_kind(evidence, str(e))
        workflow.upsert_search_attributes(
            [
                KIND.value_set(self.kind(evidence, c).value),
                QUALIFYING.value_set("true" if c.qualifying else "false"),
            ]
        )
        return c

    async def migrate(
        self,
        ref: IncidentRef,
        evidence: tuple[Evidence, ...],
        confirm: ConfirmResult,
        classification: Classification,
    ) -> tuple[Classification, Ending]:
        """The live migration; the classification again if no spare was to be had."""
        try:
            reserve = JobActivity.RESERVE_SPARES if self.renamed else JobActivityV0.RESERVE_SPARE
            await self.steps.call(Phase.RESERVE, reserve, ref, ReserveResult)
        except StepFailed as e:
            if e.error_type != ErrorType.NO_SPARE:
                # The reservation may have half-happened: give back whatever was taken.
                await self.steps.attempt(JobActivity.RELEASE_SPARE, ref)
                return classification, await self.fall_back(ref, str(e))
            if self.measured:
                classification = await self.classify(evidence, confirm, spare_lost=True)
            else:
                classification = legacy.no_spare()
                workflow.upsert_search_attributes([QUALIFYING.value_set("false")])
            return classification, await self.fall_back(ref, classification.reason)
        try:
            frozen = await self.steps.call(
                Phase.FREEZE, JobActivity.FREEZE_RANKS, ref, FreezeResult
            )
            transfer = await self.steps.call(
                Phase.TRANSFER, JobActivity.TRANSFER_STATE, ref, TransferResult
            )
            self._check(
                JobActivity.TRANSFER_STATE, transfer_problems(transfer.proof, frozen.target_step)
            )
            rejoin = await self.steps.call(Phase.REJOIN, JobActivity.REJOIN, ref, RejoinResult)
            # A rank lost after the state moved was supplied before the group re-formed: a new
            # proof.
            proof = rejoin.proof or transfer.proof
            self._check(JobActivity.REJOIN, transfer_problems(proof, frozen.target_step))
            self._check(
                JobActivity.REJOIN, resume_problems(rejoin.resumed_steps, rejoin.resumed_step)
            )
        except StepFailed as e:
            if self.by_what_happened and e.error_type == ErrorType.BEYOND_REDUNDANCY:
                classification = self._beyond_redundancy(classification, str(e))
            # Compensation: the spare goes back to the pool, then the classic restart.
            await self.steps.attempt(JobActivity.RELEASE_SPARE, ref)
            return classification, await self.fall_back(ref, str(e))
        return classification, Ending(Disposition.MIGRATED, proof=proof, rejoin=rejoin)

    def _beyond_redundancy(self, planned: Classification, why: str) -> Classification:
        """A move (planned or not) whose state lost its only source: the brief's "failures
        exceeding parallelism redundancy", disqualifying; a drain's plan does not make it
        qualifying."""
        c = unable_to_recover(
            f"failures exceeding parallelism redundancy: {why} (the incident was "
            f"{planned.category.value} as it began)"
        ).model_copy(update={"kind": planned.kind})
        workflow.upsert_search_attributes([QUALIFYING.value_set("false")])
        return c

    def _check(self, name: str, problems: list[str]) -> None:
        """The job's answer must hold on its own figures before the migration counts as live."""
        if self.measured and problems:
            raise StepFailed(name, why="proof does not hold: " + "; ".join(problems))

    async def fall_back(self, ref: IncidentRef, reason: str) -> Ending:
        """The checkpoint restart; a failed one ends the incident failed, with both reasons."""
        inp = FallbackInput(incident=ref, reason=reason)
        try:
            fb = await self.steps.call(
                Phase.FALLBACK, JobActivity.RESTART_FROM_CHECKPOINT, inp, FallbackResult
            )
        except StepFailed as e:
            return Ending(Disposition.FAILED, error=f"{reason}; fallback: {e}")
        return Ending(Disposition.FALLBACK_RESTART, fallback=fb, error=reason)
