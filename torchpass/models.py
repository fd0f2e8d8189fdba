"""The domain models: what a failure report, an incident and its outcome are.

Every workflow, activity, signal and update takes one of these and returns one. They are validated at the
edges (a malformed signal is rejected with a typed error, it never kills a worker) and serialise to JSON
through Temporal's pydantic data converter.
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, NonNegativeInt, field_validator


def utcnow() -> datetime:
    return datetime.now(UTC)


class Model(BaseModel):
    """Base of every torchpass model: immutable, strict about unknown fields."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class FailureKind(StrEnum):
    """What a source observed. The classification table maps each kind to a brief category."""

    # Planned: a supported signal asks to move work off a node.
    NODE_CORDON = "node_cordon"
    NODE_DRAIN = "node_drain"
    # Job, process or training execution interruption.
    PROCESS_EXIT = "process_exit"
    CONNECTION_LOST = "connection_lost"
    HEARTBEAT_LOST = "heartbeat_lost"
    HANG = "hang"
    POD_DELETED = "pod_deleted"
    KERNEL_PANIC = "kernel_panic"
    OOM_KILL = "oom_kill"
    CUDA_ERROR = "cuda_error"
    NCCL_ERROR = "nccl_error"
    # A collective failed or timed out while every rank stayed alive and connected (a fabric blip, a
    # rank stalled past the collective timeout): the group re-forms in place, nobody is replaced.
    COLLECTIVE_TIMEOUT = "collective_timeout"
    # Host, GPU or local fabric failure.
    GPU_FELL_OFF_BUS = "gpu_fell_off_bus"
    GPU_ECC_UNCORRECTABLE = "gpu_ecc_uncorrectable"
    GPU_LOST = "gpu_lost"
    GPU_TEMPERATURE = "gpu_temperature"
    NVLINK_ERROR = "nvlink_error"
    NIC_ERROR = "nic_error"
    NODE_POWER_LOSS = "node_power_loss"
    NODE_NOT_READY = "node_not_ready"
    NODE_FAILURE = "node_failure"
    # Shared infrastructure (disqualifying).
    FABRIC_OUTAGE = "fabric_outage"
    FILESYSTEM_UNMOUNTED = "filesystem_unmounted"
    FILESYSTEM_FULL = "filesystem_full"
    HOST_MEMORY_EXHAUSTED = "host_memory_exhausted"
    # Unable to recover (disqualifying).
    SILENT_DATA_CORRUPTION = "silent_data_corruption"


class EventSource(StrEnum):
    COORDINATOR = "coordinator"
    RANK = "rank"
    KUBERNETES = "kubernetes"
    SLURM = "slurm"
    NVML = "nvml"
    OPERATOR = "operator"


class Evidence(Model):
    """One observation of a failure by one source."""

    kind: FailureKind
    source: EventSource
    job_id: str = Field(min_length=1, max_length=200)
    failure_domain: str = Field(min_length=1, max_length=200, description="node or host that failed")
    slots: tuple[NonNegativeInt, ...] = Field(default=(), description="rank slots affected, if known")
    detail: str = Field(default="", max_length=4000)
    observed_at: AwareDatetime
    exit_code: int | None = None
    xid: int | None = None
    scheduler: str | None = Field(default=None, description="'slurm' or 'kubernetes' where that matters")


class ContractRef(Model):
    """The YOCO contract a job belongs to: where its incidents' outcomes are recorded."""

    customer_id: str = Field(min_length=1, max_length=200)
    contract_id: str = Field(min_length=1, max_length=200)


class FailureReport(Model):
    """Signal-with-start payload: one report folded into the incident of its job and failure domain."""

    evidence: Evidence
    job_task_queue: str = Field(min_length=1)
    generation: NonNegativeInt = Field(description="world generation of the job when the report was made")
    contract: ContractRef | None = Field(default=None, description="the job's contract, if it has one")


class Category(StrEnum):
    """The brief's rows: three qualifying, two disqualifying."""

    PLANNED = "planned"
    INTERRUPTION = "interruption"
    HOST_GPU_FABRIC = "host_gpu_fabric"
    SHARED_INFRASTRUCTURE = "shared_infrastructure"
    UNABLE_TO_RECOVER = "unable_to_recover"


QUALIFYING_CATEGORIES = frozenset({Category.PLANNED, Category.INTERRUPTION, Category.HOST_GPU_FABRIC})


class Classification(Model):
    category: Category
    qualifying: bool
    reason: str


class ClassifyInput(Model):
    evidence: tuple[Evidence, ...] = Field(min_length=1)
    lost_slots: tuple[NonNegativeInt, ...] = ()
    world_size: NonNegativeInt
    redundancy: NonNegativeInt = Field(description="replicas of every shard; 4-rank data parallel has 4")
    spare_available: bool = True


class Phase(StrEnum):
    DETECT = "detect"
    CONFIRM = "confirm"
    CLASSIFY = "classify"
    RESERVE = "reserve"
    FREEZE = "freeze"
    TRANSFER = "transfer"
    REJOIN = "rejoin"
    FALLBACK = "fallback"
    RECORD = "record"


class PhaseTiming(Model):
    phase: Phase
    seconds: float = Field(ge=0, description="wall time of the phase seen by the workflow")
    work_seconds: float | None = Field(default=None, ge=0, description="time spent inside the activity")


# --- job-side activity inputs and results --------------------------------------------------------


class IncidentRef(Model):
    """Identifies the incident an activity acts for; every job-side activity is idempotent on it."""

    incident_id: str = Field(min_length=1)
    job_id: str = Field(min_length=1)


class ConfirmInput(Model):
    incident: IncidentRef
    evidence: tuple[Evidence, ...] = Field(min_length=1)


class ConfirmResult(Model):
    confirmed: bool
    lost_slots: tuple[NonNegativeInt, ...]
    fenced_slots: tuple[NonNegativeInt, ...]
    world_size: NonNegativeInt
    redundancy: NonNegativeInt
    generation: NonNegativeInt
    covered: bool = Field(
        description="the job runs under a YOCO contract; whether the outcome counts (opted in and "
        "validated at detection) is the contract's decision, recorded in its ledger"
    )
    detail: str = ""
    work_seconds: float = 0.0


class ReserveResult(Model):
    spare_ids: tuple[str, ...]
    work_seconds: float = 0.0


class FreezeResult(Model):
    completed_steps: dict[int, int] = Field(description="slot -> last completed step, per survivor")
    target_step: int = Field(description="the step every rank will hold after the transfer")
    work_seconds: float = 0.0


class TransferProof(Model):
    donor_slot: NonNegativeInt
    receiver_slots: tuple[NonNegativeInt, ...]
    donor_digest: str
    receiver_digests: dict[int, str]
    step_before: int = Field(description="last completed step when the failure struck")
    step_after: int = Field(description="step held by every rank after the transfer")
    bytes: NonNegativeInt
    seconds: float = Field(ge=0, description="donor's snapshot, stream and both digests, end to end")
    stream_seconds: float | None = Field(
        default=None, ge=0, description="the bytes on the wire alone, summed over receivers"
    )


class TransferResult(Model):
    proof: TransferProof
    work_seconds: float = 0.0


class RejoinResult(Model):
    generation: NonNegativeInt
    resumed_step: int
    resumed_at: AwareDatetime
    work_seconds: float = 0.0


class FallbackResult(Model):
    restored_step: int = Field(description="step of the checkpoint the job restarted from (-1: none)")
    failed_at_step: int
    steps_recomputed: NonNegativeInt
    resumed_at: AwareDatetime | None = None
    work_seconds: float = 0.0


class FallbackInput(Model):
    incident: IncidentRef
    reason: str


class Disposition(StrEnum):
    MIGRATED = "migrated"
    FALLBACK_RESTART = "fallback_restart"
    FAILED = "failed"
    NOT_A_FAILURE = "not_a_failure"


class MigrationOutcome(Model):
    """The record of one incident: what billing counts and what an SRE reads."""

    incident_id: str
    job_id: str
    failure_domain: str
    kind: FailureKind
    evidence_count: NonNegativeInt
    classification: Classification
    covered: bool = Field(description="the job runs under a YOCO contract (see ConfirmResult.covered)")
    disposition: Disposition
    success: bool = Field(description="live-migrated: no restart, no rollback, no recomputed step")
    lost_slots: tuple[NonNegativeInt, ...] = ()
    steps_recomputed: NonNegativeInt = 0
    phases: tuple[PhaseTiming, ...] = ()
    proof: TransferProof | None = None
    fallback: FallbackResult | None = None
    error: str | None = None
    detected_at: AwareDatetime
    recovered_at: AwareDatetime | None = None
    recovery_seconds: float | None = Field(default=None, description="failure observed -> training again")

    @field_validator("phases")
    @classmethod
    def _phases_unique(cls, phases: tuple[PhaseTiming, ...]) -> tuple[PhaseTiming, ...]:
        names = [p.phase for p in phases]
        if len(names) != len(set(names)):
            raise ValueError(f"phase listed twice: {names}")
        return phases


class CompleteInput(Model):
    incident: IncidentRef
    outcome: MigrationOutcome


class IncidentStatus(Model):
    """What MigrationWorkflow's `status` query answers while the incident runs."""

    phase: str
    evidence_count: NonNegativeInt
    disposition: Disposition | None = None
