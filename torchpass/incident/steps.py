"""The job-side steps of an incident: what each activity takes and what the job measured doing it.

Every figure here is the job's own measurement, from the ranks' own reports: steps completed, the
step each rank resumed at, the digests each side computed of the state it holds, the shard each rank
holds. The proof a live migration records is built from them and checked by
`torchpass.incident.proof`. Fields added after the first release have defaults, so results recorded
in older workflow histories still decode.
"""

from __future__ import annotations

from typing import Any

from pydantic import AwareDatetime, Field, NonNegativeInt, field_validator, model_validator

from torchpass.models import Disposition, Evidence, Model, Phase, PhaseTiming

LOCAL_RUN = "local"
"""The run id of an incident the job carried out itself, before any workflow run reached it."""


class IncidentRef(Model):
    """Identifies the incident an activity acts for: its workflow (keyed by job, failure domain and
    generation), the run of it, and the job. Every job-side activity is idempotent on it."""

    workflow_id: str = Field(min_length=1, max_length=1000)
    run_id: str = Field(min_length=1, max_length=200)
    job_id: str = Field(min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _from_incident_id(cls, data: Any) -> Any:
        """A reference recorded before the typed one carries `incident_id`, "workflow id/run id":
        split here, once (no "/" is left in a workflow id: `torchpass.ids`)."""
        if isinstance(data, dict) and "incident_id" in data and "workflow_id" not in data:
            rest = {k: v for k, v in data.items() if k != "incident_id"}
            workflow_id, _, run_id = str(data["incident_id"]).rpartition("/")
            return {"workflow_id": workflow_id, "run_id": run_id, **rest}
        return data

    @classmethod
    def local(cls, workflow_id: str, job_id: str) -> IncidentRef:
        """An incident the job carries out itself (`LOCAL_RUN`)."""
        return cls(workflow_id=workflow_id, run_id=LOCAL_RUN, job_id=job_id)

    @property
    def incident_id(self) -> str:
        """The outcome's id of the incident: "workflow id/run id"."""
        return f"{self.workflow_id}/{self.run_id}"


class ConfirmInput(Model):
    incident: IncidentRef
    evidence: tuple[Evidence, ...] = Field(min_length=1)


class ConfirmResult(Model):
    confirmed: bool
    lost_slots: tuple[NonNegativeInt, ...]
    fenced_slots: tuple[NonNegativeInt, ...]
    world_size: NonNegativeInt
    redundancy: NonNegativeInt = Field(
        description="replicas of the least replicated shard, from the shards the ranks report "
        "holding"
    )
    generation: NonNegativeInt
    covered: bool = Field(
        description="the job runs under a YOCO contract; whether the outcome counts (opted in and "
        "validated at detection) is the contract's decision, recorded in its ledger"
    )
    detail: str = ""
    shard_of: dict[int, str] = Field(
        default_factory=dict,
        description="slot -> the shard its rank reported holding (replicas share one)",
    )
    spares_ready: NonNegativeInt | None = Field(
        default=None,
        description="warm spares free when the failure was confirmed (None: not measured)",
    )
    spares_warming: NonNegativeInt = 0
    agent: bool = Field(
        default=True,
        description="the ranks run the torchpass agent (False: an unmodified script, `--no-agent`)",
    )
    leaving_slots: tuple[NonNegativeInt, ...] = Field(
        default=(),
        description="lost slots whose ranks a planned move takes out while healthy: each gives its "
        "own state, so its shard needs no replica",
    )
    batch_host: str | None = Field(
        default=None,
        max_length=253,
        description="the job's Slurm batch host (`--batch-host`), whose failure ends the whole "
        "Slurm job",
    )
    work_seconds: float = 0.0


class ReserveResult(Model):
    spare_ids: tuple[str, ...]
    work_seconds: float = 0.0


class FreezeResult(Model):
    completed_steps: dict[int, int] = Field(description="slot -> last completed step, per survivor")
    target_step: int = Field(description="the step every rank will hold after the transfer")
    step_before: int | None = Field(
        default=None,
        description="the most advanced step any rank (the lost ones included) reported completing",
    )
    leaving_steps: dict[int, int] = Field(
        default_factory=dict,
        description="slot -> last completed step of each rank a planned move takes out of the "
        "world, kept until its state has moved (the donor of its own shard)",
    )
    work_seconds: float = 0.0


class Stripe(Model):
    """One slice of the state as a receiver took it: which donor sent it, and the digests both sides
    computed of it (the receiver keeps a slice only when they are equal)."""

    donor: NonNegativeInt = Field(description="slot of the replica that sent it")
    start: NonNegativeInt = Field(description="first byte, of the state's tensors laid end to end")
    stop: NonNegativeInt
    digest: str = Field(max_length=200, description="over the slice's bytes as they arrived")
    sent_digest: str = Field(max_length=200, description="the donor's digest of the bytes it sent")
    donor_digest: str = Field(max_length=200, description="the donor's digest of its whole state")


class ReceiverProof(Model):
    """What one receiver computed itself, after installing the donor's state in its own memory."""

    slot: NonNegativeInt
    stream_digest: str = Field(description="over the bytes as they arrived")
    installed_digest: str = Field(description="over the receiver's whole state once installed")
    installed_step: int = Field(description="the completed step the receiver holds once installed")
    bytes: NonNegativeInt = 0
    seconds: float = Field(default=0.0, ge=0)
    stripes: tuple[Stripe, ...] = Field(
        default=(), max_length=64, description="who sent which slice"
    )
    dropped: tuple[NonNegativeInt, ...] = Field(
        default=(),
        max_length=64,
        description="donors it stopped taking slices from (failed or stalled)",
    )


class TransferProof(Model):
    donor_slot: NonNegativeInt
    receiver_slots: tuple[NonNegativeInt, ...]
    donor_digest: str
    receiver_digests: dict[int, str] = Field(
        description="slot -> the digest the receiver computed itself"
    )
    step_before: int = Field(
        description="last completed step when the failure struck, as the ranks said"
    )
    step_after: int = Field(
        description="step held by every rank after the transfer, as each one said"
    )
    bytes: NonNegativeInt
    seconds: float = Field(
        ge=0, description="donor's snapshot, stream and both digests, end to end"
    )
    stream_seconds: float | None = Field(
        default=None, ge=0, description="the bytes on the wire alone, summed over receivers"
    )
    donor_step: int | None = Field(default=None, description="the completed step the donor served")
    receivers: tuple[ReceiverProof, ...] = Field(
        default=(), description="each receiver's own account"
    )
    survivor_steps: dict[int, int] = Field(
        default_factory=dict,
        description="slot -> completed step of each survivor that received nothing",
    )
    donor_of: dict[int, int] = Field(
        default_factory=dict, description="receiver slot -> the slot of the replica that served it"
    )
    replans: NonNegativeInt = Field(
        default=0,
        description="times the plan was re-made because a donor, receiver or other rank was lost "
        "on the way",
    )
    lost_during: tuple[NonNegativeInt, ...] = Field(
        default=(),
        description="slots lost while the recovery ran (a donor, a receiver, another rank)",
    )
    donor_digests: dict[int, str] = Field(
        default_factory=dict,
        description="slot -> digest of its whole state, each donor that served",
    )
    donor_shards: dict[int, str] = Field(
        default_factory=dict,
        description="donor slot -> the shard it served (a sharded job's lost ranks of several "
        "shards each take their own shard's state); empty: one state for all",
    )
    receiver_shards: dict[int, str] = Field(
        default_factory=dict,
        description="receiver slot -> the shard its slot holds, as its rank reported before the "
        "failure",
    )


class TransferResult(Model):
    proof: TransferProof
    work_seconds: float = 0.0


class RejoinResult(Model):
    generation: NonNegativeInt
    resumed_step: int = Field(description="the step every rank was to resume at")
    resumed_at: AwareDatetime
    resumed_steps: dict[int, int] = Field(
        default_factory=dict,
        description="slot -> the first step the rank reported entering after rejoin",
    )
    step_before: int | None = Field(default=None, description="see FreezeResult.step_before")
    steps_recomputed: NonNegativeInt = Field(
        default=0, description="completed steps the ranks run again, from their own step reports"
    )
    proof: TransferProof | None = Field(
        default=None,
        description="the transfer's proof re-made: a rank was lost after the state moved",
    )
    work_seconds: float = 0.0
    inexact: str | None = Field(
        default=None,
        max_length=2000,
        description="why the resumed run differs from one that never failed although every rank "
        "holds the moved state (per-rank state carried across steps that no replica held): then "
        "the migration is not live",
    )


class FallbackResult(Model):
    restored_step: int = Field(
        description="step of the checkpoint the job restarted from (-1: none)"
    )
    failed_at_step: int = Field(description="the most advanced step any rank reported completing")
    steps_recomputed: NonNegativeInt = Field(
        description="completed steps the restarted ranks run again: from the first step they "
        "reported entering up to failed_at_step"
    )
    resumed_at: AwareDatetime | None = None
    resumed_steps: dict[int, int] = Field(default_factory=dict, description="see RejoinResult")
    work_seconds: float = 0.0


class FallbackInput(Model):
    incident: IncidentRef
    reason: str


MAX_RECORD_EVIDENCE = 256  # as many reports as an incident workflow keeps


class LocalRecord(Model):
    """An incident the job carried out itself because no workflow step reached it in time (the
    control plane was away): every step's own result, kept in the job's state directory and filed
    later by the incident's workflow (`fetch_local_record`), which classifies it and re-checks its
    proof itself."""

    workflow_id: str = Field(min_length=1, max_length=1000)
    evidence: tuple[Evidence, ...] = Field(min_length=1, max_length=MAX_RECORD_EVIDENCE)
    started_at: AwareDatetime = Field(description="when the job began the steps itself")
    confirm: ConfirmResult | None = None
    frozen: FreezeResult | None = None
    disposition: Disposition
    proof: TransferProof | None = None
    rejoin: RejoinResult | None = None
    fallback: FallbackResult | None = None
    error: str | None = Field(default=None, max_length=4000)  # outcome.MAX_ERROR
    phases: tuple[PhaseTiming, ...] = Field(default=(), max_length=16)

    @field_validator("phases")
    @classmethod
    def _steps_timed_once(cls, phases: tuple[PhaseTiming, ...]) -> tuple[PhaseTiming, ...]:
        names = [p.phase for p in phases]
        if len(names) != len(set(names)) or {Phase.DETECT, Phase.CLASSIFY, Phase.RECORD} & set(
            names
        ):
            raise ValueError(f"each job step timed once, and only job steps: {names}")
        return phases
