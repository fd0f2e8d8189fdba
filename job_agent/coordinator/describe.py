"""What a running job says about itself for environment validation: its world, spares, torch and
layout.

Read on the coordinator's event loop (the `describe_job` activity); it changes nothing. The torch,
CUDA and backend are what each rank said of its own host in its hello: the coordinator imports no
torch, and in a multi-node job the ranks' hosts are not its own.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import torchpass
from job_agent import wire
from job_agent.coordinator.members import Member
from torchpass.validation.facts import JobDescription, RankEnvironment

if TYPE_CHECKING:
    from job_agent.coordinator.coordinator import Coordinator


def describe(c: Coordinator) -> JobDescription:
    """The job as its coordinator sees it now.

    The ranks' environments are grouped by what they said (one entry for a job of one kind of host);
    a rank that has not said is in none. The replicas per shard are counted from the shard each rank
    reported holding; a rank that has not reported one is a shard of its own (never assumed to be a
    replica).
    """
    replicas = Counter(
        c.roster.shards.get(slot, f"unreported-rank-{slot}") for slot in range(c.world_size)
    )
    return JobDescription(
        job_id=c.job_id,
        agent_version=torchpass.__version__,
        state=c.state.value,
        generation=c.generation,
        world_size=c.world_size,
        ranks_connected=len(c.roster.ranks()),
        live_migration=c.spec.agent,
        spares_ready=len(c.spares.ready()),
        spares_warming=c.spares.warming(),
        shard_replicas=dict(replicas),
        environments=environments(c.roster.ranks()),
    )


def environments(ranks: list[Member]) -> tuple[RankEnvironment, ...]:
    """The ranks grouped by the environment each reported, in slot order, with the nodes they run
    on."""
    groups: dict[wire.Environment, list[Member]] = {}
    for m in sorted(ranks, key=lambda m: m.slot):
        if m.environment is not None:
            groups.setdefault(m.environment, []).append(m)
    return tuple(
        RankEnvironment(
            slots=tuple(m.slot for m in members),
            nodes=tuple(dict.fromkeys(m.node for m in members)),
            **env.model_dump(),
        )
        for env, members in groups.items()
    )
