"""The loop form's parts without a job: batches positioned by the step number alone (what a spare
taking a rank over mid-epoch reads), and a step's `with` block telling a peer's failure from the
script's bug."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from job_agent import wire
from job_agent.rank.loop import Batches, CollectiveFailure, Step

DATA = TensorDataset(torch.arange(96).float().unsqueeze(1))


def _loaders() -> dict[str, Any]:
    return {
        "distributed": lambda: DataLoader(
            DATA, batch_size=4, sampler=DistributedSampler(DATA, num_replicas=2, rank=0, seed=5)
        ),
        "global RNG": lambda: DataLoader(DATA, batch_size=4, shuffle=True),
        "own generator": lambda: DataLoader(
            DATA, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(11)
        ),
    }


@pytest.mark.parametrize("kind", ["distributed", "global RNG", "own generator"])
def test_a_rank_started_at_any_step_reads_the_batches_of_the_rank_that_ran_from_the_start(
    kind: str,
) -> None:
    make = _loaders()[kind]
    rank = 1
    first = Batches(make(), seed=0)
    reference = {}
    # 2 ranks x 4 a batch over 96 samples: 12 steps an epoch, into a fourth epoch
    for k in range(40):
        reference[k] = first.at(k, rank, 2)[0].clone()
        torch.manual_seed(1000 + k)  # the step's own use of the RNG must not change what comes next
        torch.rand(3)
    for joined in (5, 12, 13, 30):
        spare = Batches(make(), seed=0)
        for k in range(joined, 40):
            assert torch.equal(spare.at(k, rank, 2)[0], reference[k]), (kind, joined, k)
    # The other rank reads other samples; without a DistributedSampler (whose own seed orders it),
    # the job's seed orders the passes.
    assert not torch.equal(Batches(make(), seed=0).at(3, 0, 2)[0], reference[3])
    if kind != "distributed":
        assert not torch.equal(Batches(make(), seed=1).at(3, rank, 2)[0], reference[3])


def test_a_step_done_again_gets_the_same_batch() -> None:
    b = Batches(_loaders()["global RNG"](), seed=0)
    once = b.at(7, 0, 1)
    assert b.at(7, 0, 1) is once


class _Noisy(torch.utils.data.Dataset[torch.Tensor]):
    """Samples with random augmentation drawn in the loader's worker processes."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.rand(1) + i


def _second_pass(loader: DataLoader[torch.Tensor], fresh: bool) -> torch.Tensor:
    """The loader's second pass, seeded as the agent seeds a pass: after a first one, or as a spare
    would read it, its first."""
    if not fresh:
        torch.manual_seed(0)
        list(loader)
    torch.manual_seed(1)
    return torch.cat(list(loader))


def test_loader_workers_are_seeded_each_pass_and_persistent_ones_are_refused() -> None:
    """Workers made for each pass draw from the pass's seed: a spare starting at step 13 reads what
    the rank it replaces read. Persistent workers keep their streams from pass to pass, which a
    spare's new ones cannot have (shown with torch alone): refused with the fix."""
    make = lambda persistent: DataLoader(  # noqa: E731
        _Noisy(), batch_size=4, num_workers=2, persistent_workers=persistent
    )
    first = Batches(make(False), seed=0)
    reference = {k: first.at(k, 0, 1).clone() for k in range(20)}
    spare = Batches(make(False), seed=0)
    assert all(torch.equal(spare.at(k, 0, 1), reference[k]) for k in range(13, 20))

    assert torch.equal(
        _second_pass(make(False), fresh=False), _second_pass(make(False), fresh=True)
    )
    assert not torch.equal(
        _second_pass(make(True), fresh=False), _second_pass(make(True), fresh=True)
    )
    with pytest.raises(ValueError, match="persistent_workers=False"):
        Batches(make(True), seed=0)


def test_a_sampler_built_for_another_world_is_refused_with_the_fix() -> None:
    loader = DataLoader(
        DATA, batch_size=4, sampler=DistributedSampler(DATA, num_replicas=3, rank=0)
    )
    with pytest.raises(ValueError, match=r"num_replicas=agent\.world_size"):
        Batches(loader, seed=0).at(0, 0, 2)


def test_a_peers_failure_ends_the_block_quietly_and_the_scripts_bug_goes_through() -> None:
    sent: list[wire.Frame] = []
    step = Step(4, None, sent.append)
    with step:
        raise CollectiveFailure("peer gone")
    assert step.entered and step.failure == "peer gone" and not sent
    step = Step(4, None, sent.append)
    with step:
        raise RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer")
    assert step.failure is not None and "Connection closed" in step.failure
    step = Step(5, None, sent.append)
    with pytest.raises(ValueError, match="bug"), step:
        raise ValueError("bug in the script")
    assert step.failure is None
    (report,) = sent
    assert (
        isinstance(report, wire.UserError)
        and report.step == 5
        and "bug in the script" in report.traceback
    )
    assert range(Step(3, None, sent.append)) == range(3)  # a step is its number
