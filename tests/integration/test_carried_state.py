"""State a script carries from step to step on each rank (`examples/train_carried.py`: a GRU trained
by truncated back-propagation, its hidden state going on from batch to batch as in PyTorch's
word_language_model, or the next batch drawn ahead of its step), declared with `agent.carry`. No
replica holds a rank's carried state, so the process that takes a killed rank's slot starts it
afresh: the state moved is bitwise the donor's, yet the run ends elsewhere than the run that never
failed. The incident must say so: migrated, but not live, with why (before, such runs were reported
"migrated, success, 0 steps recomputed" and ended with other weights)."""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.client import Client

from tests.integration.conftest import ROOT, run_with, spec
from torchpass.models import Disposition

pytestmark = pytest.mark.integration
SCRIPT = ROOT / "examples" / "train_carried.py"


@pytest.mark.parametrize(("mode", "name"), [((), "hidden"), (("--prefetch",), "batch")])
async def test_a_rank_that_carried_state_migrates_and_the_incident_says_it_is_not_live(
    client: Client, tmp_path: Path, mode: tuple[str, ...], name: str
) -> None:
    args = ("--steps", "60", *mode)
    job = spec(tmp_path / "run", f"carried-{name}", script=SCRIPT, args=args)
    result = await run_with(client, job, [("kill", 1, 20)])
    reference = await run_with(
        client, spec(tmp_path / "ref", f"carried-{name}-ref", spares=0, script=SCRIPT, args=args)
    )
    assert result.ok and reference.ok, (result.error, reference.error)
    (o,) = result.incidents
    assert o.disposition is Disposition.MIGRATED and o.proof is not None
    assert o.proof.donor_digest in o.proof.receiver_digests.values()  # the moved state is exact
    assert not o.success, o  # ... and yet not live
    assert o.error and "no replica holds" in o.error and f"({name})" in o.error, o.error
    # what the incident says is borne out: the run ended elsewhere than the one that never failed
    assert result.final_digest != reference.final_digest
