"""What a job is: the spec `torchpass run` launches and the result it reports."""

from __future__ import annotations

import secrets
from enum import StrEnum
from pathlib import Path

from pydantic import Field, field_validator, model_validator

from torchpass.incident.outcome import MigrationOutcome
from torchpass.models import ContractRef, Model


def new_job_id() -> str:
    return f"job-{secrets.token_hex(4)}"


class JobSpec(Model):
    """A training job under the agent: the script, its world and its warm spares."""

    job_id: str = Field(default_factory=new_job_id, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    script: Path
    args: tuple[str, ...] = ()
    nproc: int = Field(default=2, ge=1, le=1024)
    spares: int = Field(default=1, ge=0, le=64)
    state_dir: Path
    hang_timeout: float = Field(
        default=10.0,
        gt=0,
        description="seconds a rank may go without a heartbeat, or keep its peers waiting in a "
        "collective, before it is taken for hung (10: room for uneven steps and interpreter "
        "pauses; lower it for faster detection where steps are even)",
    )
    collective_timeout: float = Field(
        default=60.0,
        gt=0,
        description="seconds one collective may take before it fails (gloo/NCCL)",
    )
    recovery_timeout: float = Field(
        default=300.0,
        gt=0,
        description="seconds a frozen rank waits for its instructions before it stops",
    )
    checkpoint_every: int = Field(default=50, ge=0)
    verify_every: int = Field(
        default=100,
        ge=0,
        description="steps between comparisons of the replicas' state digests; 0: never",
    )
    keep_checkpoints: int = Field(
        default=2,
        ge=1,
        le=1000,
        description="fallback checkpoints kept while the job runs (the latest)",
    )
    enrolment_key_file: Path | None = Field(
        default=None,
        description="the cluster's enrolment key (its private half, 0600): the job's key is "
        "vouched for by it, as a contract that names the enrolment key requires (docs/security.md)",
    )
    keep_checkpoints_after: bool = Field(
        default=False,
        description="keep them once the job finished; by default a finished job's are removed (a "
        "failed job's stay, to restart it from)",
    )
    fresh: bool = Field(
        default=False,
        description="start at step 0 even if an earlier run of this job id did not finish (by "
        "default it resumes from that run's latest checkpoint)",
    )
    seed: int = 0
    threads: int = Field(default=1, ge=1)
    startup_timeout: float = Field(default=120.0, gt=0)
    finish_grace: float = Field(
        default=60.0,
        gt=0,
        le=86400,
        description="seconds the ranks' code after the training loop (saving the model, "
        "evaluation) may run once every rank finished; a rank still running then is stopped and "
        "the job is not ok",
    )
    control_plane_wait: float = Field(
        default=5.0,
        gt=0,
        le=3600,
        description="seconds an incident waits for its workflow's first step; past it (Temporal or "
        "the control worker away) the job carries the recovery out itself and files the record "
        "later",
    )
    late_window: float = Field(
        default=600.0,
        ge=0,
        le=3600,
        description="seconds an incident's workflow stays open once its outcome is recorded, "
        "taking the evidence that comes late (a Kubernetes NotReady some 40 s after a node died, a "
        "Slurm DOWN after SlurmdTimeout) into its history; 0: it closes at once",
    )
    contract: ContractRef | None = Field(
        default=None, description="YOCO contract its outcomes go to"
    )
    host: str = Field(
        default="127.0.0.1",
        min_length=1,
        max_length=253,
        description="the address the coordinator listens on (control channel, rendezvous store) "
        "and gives its ranks and node agents: one every node can reach, never a wildcard",
    )
    nodes: int = Field(
        default=0,
        ge=0,
        le=1024,
        description="node agents (`torchpass node`) the job waits for and runs its ranks and "
        "spares on; 0: they run on this host, started by the coordinator itself",
    )

    node_timeout: float = Field(
        default=5.0,
        gt=0,
        le=600,
        description="seconds a node agent may go unheard (it heart-beats twice a second) before "
        "its node counts as lost, every process on it with it (a hung or cut-off host)",
    )
    agent: bool = Field(
        default=True,
        description="the script runs the torchpass agent; False (`--no-agent`): an unmodified "
        "torchrun script, run with torchrun's environment, whose failures restart the whole job",
    )
    max_restarts: int = Field(
        default=3,
        ge=0,
        le=1000,
        description="whole-job restarts a job without the agent gets before it fails (torchrun's "
        "flag)",
    )
    spare_nodes: int = Field(
        default=0,
        ge=0,
        le=64,
        description="idle spare nodes the cluster detector keeps for this job, each a node agent "
        "it starts on a node of the scheduler's spare pool (Slurm: `torchpass detect slurm "
        "--spare-partition` or `--spare-reservation`) with as many warm spares as a node runs "
        "ranks; 0: none",
    )
    batch_host: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        description="under Slurm, the allocation's batch host (`$SLURMD_NODENAME` in the batch "
        "script): it runs the batch script and this coordinator, so Slurm ends the whole job with "
        "it, the brief's 'node 0 failures with Slurm'; no other node is special (the one running "
        "rank 0 included)",
    )
    stripe_donors: int = Field(
        default=3,
        ge=1,
        le=8,
        description="replicas a rank receiving the state takes slices from at once, one per node "
        "(a node's link is what limits a stream; ranks on one host serve one at a time)",
    )

    @model_validator(mode="after")
    def _no_spares_without_agent(self) -> JobSpec:
        if not self.agent and self.spares:
            raise ValueError(
                "a job without the agent (--no-agent) restarts whole: spares are of no use to it"
            )
        if self.spare_nodes and not self.nodes:
            raise ValueError(
                "spare nodes (--spare-nodes) join a job that runs on node agents (--nnodes)"
            )
        if not self.agent and self.nodes:
            raise ValueError(
                "a job without the agent (--no-agent) runs its ranks on one host (its rank 0 hosts "
                "the script's own store there): run it on one node, or adopt the agent to run "
                "across nodes"
            )
        return self

    @field_validator("host")
    @classmethod
    def _reachable(cls, host: str) -> str:
        if host in ("0.0.0.0", "::", "*", "") or any(c.isspace() or c in "/[]" for c in host):
            raise ValueError(
                f"{host!r}: give the one address the ranks and nodes reach the coordinator at"
            )
        return host

    @field_validator("script")
    @classmethod
    def _script_exists(cls, script: Path) -> Path:
        if not script.is_file():
            raise ValueError(f"training script not found: {script}")
        return script

    @property
    def job_dir(self) -> Path:
        return self.state_dir / "jobs" / self.job_id


class JobState(StrEnum):
    STARTING = "starting"
    TRAINING = "training"
    FINISHED = "finished"
    USER_ERROR = "user_error"  # the training script raised: the user's bug, not a migration
    FAILED = "failed"
    # Ctrl-C or SIGTERM: stopped in order, every rank at one step boundary (run it again to resume)
    STOPPED = "stopped"


class Resumed(Model):
    """The earlier run of the same job id that this run resumed: why it ended, how far its ranks
    got, and the checkpoint this run restarted from (`torchpass run` again after a lost coordinator
    or a stop)."""

    previous: str = Field(max_length=600, description="why the earlier run ended")
    last_completed: int = Field(
        ge=-1, description="its most advanced completed step, as its ranks reported"
    )
    checkpoint_step: int = Field(
        ge=-1, description="the restart's checkpoint step; -1: none, from step 0"
    )
    checkpoint: str | None = Field(default=None, max_length=4096)


class JobResult(Model):
    job_id: str
    status: JobState = Field(description="finished, user_error or failed")
    steps_completed: int
    final_digest: str | None = None
    generation: int
    steps_recomputed: int = Field(
        default=0, description="completed steps run again, counted by the coordinator"
    )
    incidents: tuple[MigrationOutcome, ...] = ()
    refuted_claims: tuple[MigrationOutcome, ...] = Field(
        default=(),
        description="the latest failure claims the job refuted (a failure it never had, forged or "
        "mistaken: not a failure, never counted), at most 20; they are not among `incidents`",
    )
    refuted_claims_total: int = Field(
        default=0, ge=0, description="every failure claim the job refuted"
    )
    reports_undelivered: int = Field(
        default=0, description="failure reports Temporal never received"
    )
    incidents_unfiled: int = Field(
        default=0,
        description="incidents the job handled itself whose workflow never filed them before it "
        "ended (their records stay in the job's local/ directory)",
    )
    resumed: Resumed | None = Field(
        default=None, description="the unfinished earlier run this one resumed"
    )
    restarts: int = Field(
        default=0, ge=0, description="whole-job restarts (checkpoint fallbacks) it took"
    )
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status is JobState.FINISHED
