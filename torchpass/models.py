"""The domain models: what a failure is, how it was observed and classified, how an incident ended.

The job-side steps' inputs and results are in `torchpass.incident.steps`, an incident's record in
`torchpass.incident.outcome`. Every workflow, activity, signal and update takes one model and
returns one. They are validated at the edges (a malformed signal is rejected with a typed error, it
never kills a worker) and serialise to JSON through Temporal's pydantic data converter.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, NonNegativeInt


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
    NODE_AGENT = "node_agent"  # the node agent, of its own host (a filesystem, its memory)


class Evidence(Model):
    """One observation of a failure by one source."""

    kind: FailureKind
    source: EventSource
    job_id: str = Field(min_length=1, max_length=200)
    failure_domain: str = Field(
        min_length=1, max_length=200, description="node or host that failed"
    )
    slots: tuple[NonNegativeInt, ...] = Field(
        default=(), description="rank slots affected, if known"
    )
    detail: str = Field(default="", max_length=4000)
    observed_at: AwareDatetime
    last_progress_at: AwareDatetime | None = Field(
        default=None,
        description="a hang: when the rank last made progress (a step, a collective, a beat)",
    )
    exit_code: int | None = None
    xid: int | None = None
    scheduler: str | None = Field(
        default=None, description="'slurm' or 'kubernetes' where that matters"
    )
    signature: str | None = Field(
        default=None,
        max_length=64,
        description="a planned migration sent through Temporal: HMAC-SHA256 under the job's secret "
        "(torchpass.signing)",
    )


class ContractRef(Model):
    """The YOCO contract a job belongs to: where its incidents' outcomes are recorded."""

    customer_id: str = Field(min_length=1, max_length=200)
    contract_id: str = Field(min_length=1, max_length=200)


class FailureReport(Model):
    """Signal-with-start payload: one report folded into the incident of its job and failure
    domain."""

    evidence: Evidence
    job_task_queue: str = Field(min_length=1)
    generation: NonNegativeInt = Field(
        description="world generation of the job when the report was made"
    )
    contract: ContractRef | None = Field(
        default=None, description="the job's contract, if it has one"
    )
    linger_seconds: float = Field(
        default=0.0,
        ge=0,
        le=3600,
        description="how long the incident's workflow stays open once its outcome is recorded, "
        "taking late reports into its history (the job's --late-window); 0: it closes at once",
    )
    late: bool = Field(
        default=False,
        description="evidence that came after the incident's outcome was recorded (a NotReady seen "
        "after the move): signalled to that run alone, never starting an incident",
    )
    opens: bool = Field(
        default=False,
        description="the incident's first report: the run it reaches must not have recorded an "
        "outcome (one still open for late evidence is another incident's: the job moves to a fresh "
        "id)",
    )


class Category(StrEnum):
    """The brief's rows: three qualifying, two disqualifying; and our own failure to classify."""

    PLANNED = "planned"
    INTERRUPTION = "interruption"
    HOST_GPU_FABRIC = "host_gpu_fabric"
    SHARED_INFRASTRUCTURE = "shared_infrastructure"
    UNABLE_TO_RECOVER = "unable_to_recover"
    # The classification step itself failed: counted as qualifying, since torchpass's own failure
    # must never disqualify a customer's failure.
    UNCLASSIFIED = "unclassified"


QUALIFYING_CATEGORIES = frozenset(
    {Category.PLANNED, Category.INTERRUPTION, Category.HOST_GPU_FABRIC}
)


class Classification(Model):
    category: Category
    qualifying: bool
    reason: str = Field(max_length=4100)
    kind: FailureKind | None = Field(
        default=None,
        description="the kind of evidence that named the category (None: unclassified)",
    )


class ClassifyInput(Model):
    evidence: tuple[Evidence, ...] = Field(min_length=1)
    lost_slots: tuple[NonNegativeInt, ...] = ()
    world_size: NonNegativeInt
    redundancy: NonNegativeInt = Field(
        description="replicas of the least replicated shard, as measured"
    )
    shard_of: dict[int, str] = Field(
        default_factory=dict,
        description="slot -> the shard its rank reported holding (empty: not known)",
    )
    spare_available: bool = Field(
        default=True, description="enough spares ready or warming, as measured"
    )
    agent: bool = Field(
        default=True, description="the job runs the torchpass agent (live migration possible)"
    )
    leaving_slots: tuple[NonNegativeInt, ...] = Field(
        default=(),
        description="lost slots a planned move takes out while healthy (each its own donor)",
    )
    batch_host: str | None = Field(
        default=None,
        max_length=253,
        description="the job's Slurm batch host (None: not under Slurm)",
    )


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
    work_seconds: float | None = Field(
        default=None, ge=0, description="time spent inside the activity"
    )


class Disposition(StrEnum):
    MIGRATED = "migrated"
    FALLBACK_RESTART = "fallback_restart"
    FAILED = "failed"
    NOT_A_FAILURE = "not_a_failure"
