"""The job's own word: an Ed25519 key pair its coordinator makes and keeps in the job's directory,
with which the job attests what the ledger counts.

- An incident's outcome counts only with the job's signature over its facts (`outcome_facts`):
  anyone with a Temporal client can start a MigrationWorkflow, but only the job can sign what its
  incident was and how it ended. The job signs only an incident it knows (it confirmed it, or
  carried it out itself) and only figures that agree with its own
  (`job_agent.coordinator.incident.attest`).
- A validation counts only with the job's proof that it holds the key the validation registers on
  the contract: a signature over the job id and the validation run (`validation_facts`).
- A contract may name an enrolment key: the public half of a key pair whose private half only the
  customer's job hosts hold. Its jobs' keys then count only vouched for by it (`enrolment_facts`),
  so that nobody with Temporal access alone can make up a job of their own and have it validated.

The contract keeps the public keys its genuine validations registered for each job
(`torchpass.contract.coverage.JobCoverage.keys`) and checks each outcome against them
(`torchpass.contract.verify`). Keys and signatures travel as lowercase hex.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from torchpass.incident.outcome import MigrationOutcome

KEY_HEX = 64  # an Ed25519 public or private key: 32 bytes
SIGNATURE_HEX = 128  # an Ed25519 signature: 64 bytes
_OUTCOME = b"torchpass-outcome-v1\0"
_VALIDATION = b"torchpass-validation-v1\0"
_ENROLMENT = b"torchpass-enrolment-v1\0"


def outcome_facts(outcome: MigrationOutcome) -> bytes:
    """What a job's attestation of an outcome covers: the incident and its run, the job and failure
    domain (the generation is part of the incident's id), the kind, the classification, how it
    ended, the steps before and after and recomputed, and the digests of the state moved. A fixed
    list, so that a field added to the outcome later cannot change what was signed."""
    proof = outcome.proof
    fallback = outcome.fallback
    facts = {
        "incident": outcome.incident_id,
        "job": outcome.job_id,
        "domain": outcome.failure_domain,
        "kind": outcome.kind.value,
        "category": outcome.classification.category.value,
        "qualifying": outcome.classification.qualifying,
        "disposition": outcome.disposition.value,
        "success": outcome.success,
        "lost": list(outcome.lost_slots),
        "recomputed": outcome.steps_recomputed,
        "before": outcome.step_before,
        "resumed": {str(k): v for k, v in sorted(outcome.resumed_steps.items())},
        "detected": outcome.detected_at.isoformat(),
        "donor_digest": proof.donor_digest if proof else None,
        "receivers": (
            {str(k): v for k, v in sorted(proof.receiver_digests.items())} if proof else None
        ),
        "step_after": proof.step_after if proof else None,
        "restored_step": fallback.restored_step if fallback else None,
    }
    return _OUTCOME + json.dumps(facts, sort_keys=True, separators=(",", ":")).encode()


def validation_facts(job_id: str, source: str, public_key: str) -> bytes:
    """What a job signs for a validation: that it, holding `public_key`, is job `job_id` as the
    validation run `source` (workflow id/run id) asked it."""
    return _VALIDATION + json.dumps([job_id, source, public_key]).encode()


def enrolment_facts(job_id: str, job_key: str) -> bytes:
    """What a cluster's enrolment key signs when a job starts on it: that job `job_id`, holding
    `job_key`, is one of the cluster's (a contract that names the enrolment key counts only such
    jobs)."""
    return _ENROLMENT + json.dumps([job_id, job_key]).encode()


class JobKey:
    """A job's private key, made by its coordinator; never leaves the job's directory."""

    def __init__(self, private: Ed25519PrivateKey) -> None:
        self._private = private
        self.public = private.public_key().public_bytes_raw().hex()

    @classmethod
    def generate(cls) -> JobKey:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_hex(cls, private: str) -> JobKey:
        return cls(Ed25519PrivateKey.from_private_bytes(bytes.fromhex(private.strip())))

    def private_hex(self) -> str:
        """For the job's own directory only (`job_agent.coordinator.jobs.job_key`)."""
        return self._private.private_bytes_raw().hex()

    def sign(self, facts: bytes) -> str:
        return self._private.sign(facts).hex()

    def attest(self, outcome: MigrationOutcome) -> str:
        return self.sign(outcome_facts(outcome))

    def prove(self, job_id: str, source: str) -> str:
        return self.sign(validation_facts(job_id, source, self.public))

    def endorse(self, job_id: str, job_key: str) -> str:
        """As a cluster's enrolment key: vouch for a job started on the cluster."""
        return self.sign(enrolment_facts(job_id, job_key))


def signed_by(public_key: str, facts: bytes, signature: str | None) -> bool:
    """Whether `signature` is `public_key`'s over `facts`; False for anything malformed."""
    if signature is None or len(signature) != SIGNATURE_HEX or len(public_key) != KEY_HEX:
        return False
    try:
        key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(public_key))
        key.verify(bytes.fromhex(signature), facts)
    except (ValueError, InvalidSignature):
        return False
    return True


def endorsed(enrolment_key: str, job_id: str, job_key: str, endorsement: str | None) -> bool:
    """Whether the cluster's enrolment key vouched for job `job_id` holding `job_key`."""
    return signed_by(enrolment_key, enrolment_facts(job_id, job_key), endorsement)


def attested(outcome: MigrationOutcome, keys: Iterable[str]) -> bool:
    """Whether one of the job's registered keys signed this outcome's facts."""
    facts = outcome_facts(outcome)
    return any(signed_by(k, facts, outcome.attestation) for k in keys)
