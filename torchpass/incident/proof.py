"""The checks a live migration's proof must pass, on the figures the ranks reported themselves.

The job side runs them before it calls a transfer or a rejoin done, and MigrationWorkflow runs them
again on what the job answered: a proof that disagrees with itself (a receiver holding other bytes
or another step than the donor served, a rank resuming at another step than the frozen one) fails
the migration. Each returns the problems found, in words for the outcome's error; none found means
the proof holds.
"""

from __future__ import annotations

from collections.abc import Mapping

from torchpass.incident.outcome import Ending
from torchpass.incident.steps import LocalRecord, ReceiverProof, TransferProof
from torchpass.models import Disposition


def _short(digest: str) -> str:
    return digest[:16] or "(none)"


def _sent_to(proof: TransferProof, slot: int) -> str:
    """The state receiver `slot` was to get: its own donor's (a sharded job's lost ranks of several
    shards each take their shard's), else the donor's."""
    donor = proof.donor_of.get(slot)
    return (
        proof.donor_digests.get(donor, proof.donor_digest)
        if donor is not None
        else proof.donor_digest
    )


def transfer_problems(proof: TransferProof, target_step: int) -> list[str]:
    """Every receiver installed exactly the donor's bytes at the frozen step; every survivor holds
    it."""
    problems = []
    if proof.donor_step is not None and proof.donor_step != target_step:
        problems.append(
            f"the donor served step {proof.donor_step}, the world froze after step {target_step}"
        )
    accounted = {r.slot for r in proof.receivers}
    for slot in sorted(set(proof.receiver_slots) - accounted):
        problems.append(f"rank {slot} gave no account of the state it installed")
    for r in proof.receivers:
        sent = _sent_to(proof, r.slot)
        if r.stream_digest != sent:
            problems.append(
                f"rank {r.slot} received bytes hashing to {_short(r.stream_digest)}, the donor "
                f"sent {_short(sent)}"
            )
        if r.installed_digest != sent:
            problems.append(
                f"rank {r.slot} holds state hashing to {_short(r.installed_digest)} once "
                f"installed, the donor's is {_short(sent)}"
            )
        if r.installed_step != target_step:
            problems.append(
                f"rank {r.slot} holds step {r.installed_step} once installed, not {target_step}"
            )
    for slot, step in sorted(proof.survivor_steps.items()):
        if step != target_step:
            problems.append(
                f"rank {slot} holds step {step}, not {target_step}, and received nothing"
            )
    first = {proof.donor_shards.get(proof.donor_slot, ""): proof.donor_digest}
    for slot, digest in sorted(proof.donor_digests.items()):
        # replicas of one shard agree
        expected = first.setdefault(proof.donor_shards.get(slot, ""), digest)
        if digest != expected:
            problems.append(
                f"donor rank {slot} holds state hashing to {_short(digest)}, the donor's is "
                f"{_short(expected)}: the replicas differ"
            )
    for r in proof.receivers:
        problems += stripe_problems(proof, r)
    for slot, want in sorted(proof.receiver_shards.items()):
        donor = proof.donor_of.get(slot, proof.donor_slot)
        got = proof.donor_shards.get(donor)
        if got and want and got != want:
            problems.append(
                f"rank {slot} holds shard {want!r}, its donor rank {donor} served shard {got!r}"
            )
    return problems


def stripe_problems(proof: TransferProof, r: ReceiverProof) -> list[str]:
    """A receiver that took its state in slices: they cover the state once, end to end, each came
    from a donor of this recovery holding the donor's state, and each arrived as its donor sent
    it."""
    if not r.stripes:
        return []
    problems = []
    donors = set(proof.donor_digests) | set(proof.lost_during) | {proof.donor_slot}
    pos = 0
    for s in sorted(r.stripes, key=lambda s: s.start):
        where = f"rank {r.slot}'s slice [{s.start}, {s.stop})"
        if s.start != pos:
            problems.append(f"rank {r.slot}'s slices leave a gap or overlap at byte {pos}")
        pos = max(pos, s.stop)
        if s.digest != s.sent_digest:
            problems.append(
                f"{where} hashes to {_short(s.digest)}, its donor sent {_short(s.sent_digest)}"
            )
        if s.donor not in donors:
            problems.append(f"{where} came from rank {s.donor}, no donor of this recovery")
        if s.donor_digest != _sent_to(proof, r.slot):
            problems.append(
                f"{where} came from rank {s.donor} holding {_short(s.donor_digest)}, not the "
                "donor's state"
            )
    if pos != r.bytes:
        problems.append(f"rank {r.slot}'s slices end at byte {pos}, its state has {r.bytes}")
    return problems


def resume_problems(resumed_steps: Mapping[int, int], resume_step: int) -> list[str]:
    """Every rank that stepped after the rejoin entered the frozen step first: none skipped or redid
    one."""
    return [
        f"rank {slot} resumed at step {step}, not at step {resume_step}"
        for slot, step in sorted(resumed_steps.items())
        if step != resume_step
    ]


def filed_ending(rec: LocalRecord) -> Ending:
    """How an incident the job handled itself ended, as its record shows, checked as a workflow
    checks a migration it ran: a live migration needs its freeze, its transfer proof and its rejoin,
    all holding. A record that does not hold is a failure on the record (with why), never a
    success."""
    if rec.disposition is Disposition.MIGRATED:
        if rec.proof is None or rec.rejoin is None or rec.frozen is None:
            problems = ["a migration recorded without its freeze, transfer proof and rejoin"]
        else:
            problems = transfer_problems(rec.proof, rec.frozen.target_step)
            problems += resume_problems(rec.rejoin.resumed_steps, rec.rejoin.resumed_step)
        if not problems:
            return Ending(Disposition.MIGRATED, proof=rec.proof, rejoin=rec.rejoin)
        why = "the job's record of its own recovery does not hold: " + "; ".join(problems)
        return Ending(Disposition.FAILED, error=why)
    if rec.disposition is Disposition.FALLBACK_RESTART:
        if rec.fallback is None:
            return Ending(
                Disposition.FAILED, error="a fallback recorded without the restart's figures"
            )
        return Ending(Disposition.FALLBACK_RESTART, fallback=rec.fallback, error=rec.error)
    if rec.disposition is Disposition.FAILED:
        return Ending(Disposition.FAILED, error=rec.error or "the job's own recovery failed")
    return Ending(rec.disposition, error=rec.error)
