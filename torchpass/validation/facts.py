"""The facts validation activities gather and the checks judge: what a job's coordinator says of the
job and its ranks (`JobDescription`), what the control worker sees of itself and of Temporal, which
schedulers it found. Nothing here imports temporalio: the job agent builds `JobDescription` too."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, NonNegativeInt

from torchpass.models import Model


class ValidationTarget(Model):
    """The job a validation activity looks at."""

    job_id: str = Field(min_length=1)
    source: str | None = Field(
        default=None,
        max_length=1100,
        description="the validation run asking (workflow id/run id): the job signs it with its key",
    )


class RankEnvironment(Model):
    """What the torch of the ranks at `slots` (on `nodes`) says of their hosts, as each rank
    reported it."""

    slots: tuple[NonNegativeInt, ...] = Field(max_length=65536)
    nodes: tuple[str, ...] = Field(default=(), max_length=4096)
    torch_version: str = Field(max_length=64)
    backend: Literal["gloo", "nccl"]
    backend_available: bool
    cuda_available: bool
    nccl_version: str | None = Field(default=None, max_length=64)
    cuda_version: str | None = Field(default=None, max_length=64)
    driver_version: str | None = Field(default=None, max_length=64)

    def stack(self) -> str:
        """The software stack as one line: what must be the same on every node."""
        return (
            f"torch {self.torch_version}, CUDA {self.cuda_version or 'none'}, driver "
            f"{self.driver_version or 'none'}, {self.backend}"
            + (f" (NCCL {self.nccl_version})" if self.nccl_version else "")
        )


class JobDescription(Model):
    """What a job's coordinator says about itself (the `describe_job` activity). The ranks' torch
    and backend are in `environments`, one per distinct answer of the connected ranks (a job of one
    kind of host has one); the single fields before it are what a job described before ranks
    reported their own (kept so that recorded histories still read)."""

    job_id: str
    agent_version: str = Field(description="torchpass.__version__ of the job's agent")
    state: str = Field(description="coordinator state: starting, training, finished, failed, ...")
    generation: int
    world_size: int = Field(ge=1)
    ranks_connected: NonNegativeInt = Field(description="live rank slots held by a connected agent")
    live_migration: bool = Field(
        default=True,
        description="its ranks run the agent (False: `--no-agent`, a whole-job restart)",
    )
    spares_ready: NonNegativeInt = Field(description="warm spares free to be reserved")
    spares_warming: NonNegativeInt = Field(description="spares launched but not yet warm")
    backend: Literal["gloo", "nccl"] | None = None
    backend_available: bool = False
    torch_version: str | None = None
    cuda_available: bool = False
    nccl_version: str | None = None
    parallelism: Literal["data_parallel"] = "data_parallel"
    shard_replicas: dict[str, int] = Field(
        description="shard -> number of ranks holding a replica of it"
    )
    environments: tuple[RankEnvironment, ...] = Field(default=(), max_length=1024)
    key: str | None = Field(
        default=None, max_length=64, description="the public key the job attests its incidents with"
    )
    proof: str | None = Field(
        default=None,
        max_length=128,
        description="the job's signature, with that key, over its id and the validation run asking",
    )
    endorsement: str | None = Field(
        default=None,
        max_length=128,
        description="its cluster's enrolment key's signature over its id and key, where it has one",
    )

    def rank_environments(self) -> tuple[RankEnvironment, ...]:
        """The ranks' environments; for a description from before they were reported, its one
        answer."""
        if self.environments or self.backend is None or self.torch_version is None:
            return self.environments
        legacy = RankEnvironment(
            slots=(),
            torch_version=self.torch_version,
            backend=self.backend,
            backend_available=self.backend_available,
            cuda_available=self.cuda_available,
            nccl_version=self.nccl_version,
        )
        return (legacy,)


class ControlPlaneFacts(Model):
    """What the control worker running the validation sees of itself and of Temporal."""

    task_queue: str
    namespace: str
    temporal_server_version: str | None = None
    temporal_error: str | None = None
    torch_version: str | None = Field(default=None, description="None: torch could not be imported")
    torch_error: str | None = None
    gloo_available: bool = False
    nccl_available: bool = False
    cuda_available: bool = False
    nccl_version: str | None = None


class SchedulerProbe(Model):
    """One scheduler looked for: found or not, and what was seen."""

    scheduler: Literal["slurm", "kubernetes"]
    found: bool
    detail: str = Field(max_length=2000)


class SchedulerFacts(Model):
    probes: tuple[SchedulerProbe, ...]
    allow_local: bool = Field(
        default=False, description="development override: no scheduler is waived"
    )
