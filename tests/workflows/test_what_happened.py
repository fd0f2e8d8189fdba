"""An incident is classified by what happened, not by what was planned: a drain of a rank whose
shard has no other replica (plain FSDP2) is a planned move, qualifying, as it begins; if that rank
dies before its state moved, nothing holds its shard any more and the recovery falls back to the
checkpoint. That is the brief's "failures exceeding parallelism redundancy", disqualifying (before,
it stayed planned and qualifying, and counted against the guarantee although no replica existed).
The job's side of it, the transfer failing `BeyondRedundancy`, is tested in
tests/unit/test_planned_moves.py."""

from __future__ import annotations

from temporalio.testing import WorkflowEnvironment

from tests.workflows.fake_job import FakeJob, incident
from torchpass.models import Category, Disposition, FailureKind


async def test_a_drain_that_lost_its_only_source_is_beyond_redundancy(
    env: WorkflowEnvironment, name: str
) -> None:
    job = FakeJob(beyond=True)
    outcome, _ = await incident(env, job, name, kinds=(FailureKind.NODE_DRAIN,))
    assert outcome.disposition is Disposition.FALLBACK_RESTART and not outcome.success
    c = outcome.classification
    assert c.category is Category.UNABLE_TO_RECOVER and not c.qualifying, c
    assert "failures exceeding parallelism redundancy" in c.reason and "planned" in c.reason, c
    assert outcome.kind is FailureKind.NODE_DRAIN
    assert job.calls["transfer"] == 1  # not retried: no retry brings the source back


async def test_a_drain_whose_transfer_fails_otherwise_stays_planned(
    env: WorkflowEnvironment, name: str
) -> None:
    outcome, _ = await incident(env, FakeJob(transfer=True), name, kinds=(FailureKind.NODE_DRAIN,))
    assert outcome.disposition is Disposition.FALLBACK_RESTART
    assert outcome.classification.category is Category.PLANNED
    assert outcome.classification.qualifying
