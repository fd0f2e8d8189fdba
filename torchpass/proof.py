"""The checks a live migration's proof must pass, on the figures the ranks reported themselves.

The job side runs them before it calls a transfer or a rejoin done, and MigrationWorkflow runs them again
on what the job answered: a proof that disagrees with itself (a receiver holding other bytes or another
step than the donor served, a rank resuming at another step than the frozen one) fails the migration.
Each returns the problems found, in words for the outcome's error; none found means the proof holds.
"""

from __future__ import annotations

from collections.abc import Mapping

from torchpass.steps import TransferProof


def _short(digest: str) -> str:
    return digest[:16] or "(none)"


def transfer_problems(proof: TransferProof, target_step: int) -> list[str]:
    """Every receiver installed exactly the donor's bytes at the frozen step; every survivor holds it."""
    problems = []
    if proof.donor_step is not None and proof.donor_step != target_step:
        problems.append(f"the donor served step {proof.donor_step}, the world froze after step {target_step}")
    accounted = {r.slot for r in proof.receivers}
    for slot in sorted(set(proof.receiver_slots) - accounted):
        problems.append(f"rank {slot} gave no account of the state it installed")
    for r in proof.receivers:
        if r.stream_digest != proof.donor_digest:
            problems.append(
                f"rank {r.slot} received bytes hashing to {_short(r.stream_digest)}, the donor sent "
                f"{_short(proof.donor_digest)}"
            )
        if r.installed_digest != proof.donor_digest:
            problems.append(
                f"rank {r.slot} holds state hashing to {_short(r.installed_digest)} once installed, the "
                f"donor's is {_short(proof.donor_digest)}"
            )
        if r.installed_step != target_step:
            problems.append(f"rank {r.slot} holds step {r.installed_step} once installed, not {target_step}")
    for slot, step in sorted(proof.survivor_steps.items()):
        if step != target_step:
            problems.append(f"rank {slot} holds step {step}, not {target_step}, and received nothing")
    return problems


def resume_problems(resumed_steps: Mapping[int, int], resume_step: int) -> list[str]:
    """Every rank that stepped after the rejoin entered the frozen step first: none skipped or redid one."""
    return [
        f"rank {slot} resumed at step {step}, not at step {resume_step}"
        for slot, step in sorted(resumed_steps.items())
        if step != resume_step
    ]
