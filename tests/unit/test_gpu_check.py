"""`bench/gpu_check.py`, the script a session with a GPU runs for the CUDA and NCCL paths, dry-run
on the CPU (part 2 on gloo) so that it still runs when a GPU is lent: this checks the script, not
the GPU paths."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from bench import gpu_check
from job_agent.transfer import receiver

CPU = torch.device("cpu")


def test_the_gpu_check_holds_on_the_cpu() -> None:
    part1 = gpu_check.striped(CPU, width=128)
    assert all(part1["checks"].values()), part1  # type: ignore[attr-defined]
    part2 = gpu_check.regroup(CPU)
    assert all(part2["checks"].values()), part2  # type: ignore[attr-defined]


def test_its_transfer_check_fails_when_the_receiver_ends_up_with_other_bits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = receiver.receive_state

    def receive_then_corrupt(tracked: Any, *args: Any, **kwargs: Any) -> Any:
        stats = real(tracked, *args, **kwargs)
        with torch.no_grad():
            next(iter(tracked.model.parameters())).view(-1)[0] += 1
        return stats

    monkeypatch.setattr(receiver, "receive_state", receive_then_corrupt)
    checks = gpu_check.striped(CPU, width=128)["checks"]
    assert checks["every tensor bit-for-bit the donor's"] is False  # type: ignore[index]
    assert checks["digests agree"] is False  # type: ignore[index]
