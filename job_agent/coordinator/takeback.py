"""Taking a running multi-node job back after its coordinator was lost (killed, or its host
rebooted).

Between failures a job needs no coordinator: its ranks train over their own collective group, and
its node agents keep them running while they wait for it (`torchpass node --coordinator-wait`).
Started again with the same job id, state directory and address, a coordinator finds what the dead
one registered (the job's secret, its control and store ports: `prior_coordinator`), listens there
again, and waits for the nodes to rejoin. Each node says what it runs and what ended while it had no
coordinator; each of those processes rejoins and says where it stands (its generation, its last
completed step, frozen or not). The job goes on in the generation it was in: nothing restarts,
nothing is recomputed. A rank that ended meanwhile, or never came back, is a loss like any other,
reported once the job is back and migrated live. If no node rejoins, the job restarts from its
checkpoint, as after any lost coordinator.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Protocol

from pydantic import ValidationError

from job_agent.coordinator.incident.tracker import IncidentTracker
from job_agent.coordinator.jobs import alive, registered_pid
from job_agent.coordinator.members import Member, Roster
from job_agent.coordinator.node_launcher import NodeLauncher
from job_agent.coordinator.progress import StepTracker
from job_agent.coordinator.waiting import Changes
from job_agent.launch.launcher import Launcher, signal_name
from torchpass.incident.outcome import MigrationOutcome
from torchpass.job import JobSpec
from torchpass.models import EventSource, Evidence, FailureKind

log = logging.getLogger("torchpass.coordinator")
FIRST_NODE_WAIT = timedelta(seconds=15)  # nodes alive and waiting try again twice a second
PROCESSES_WAIT = timedelta(seconds=10)
MAX_PRIOR_OUTCOMES = 100_000


class Job(Protocol):
    """What taking a job back reads and sets (its new coordinator)."""

    spec: JobSpec
    job_id: str
    world_size: int
    roster: Roster
    launcher: Launcher
    changes: Changes
    progress: StepTracker
    incidents: IncidentTracker

    @property
    def generation(self) -> int: ...

    def took_back(self, generation: int, spawned: int) -> None: ...
    def fence(self, m: Member) -> None: ...


@dataclass(frozen=True)
class Prior:
    """What the lost coordinator registered: the job's secret and the ports its peers know."""

    secret: bytes
    control_port: int
    store_port: int


def prior_coordinator(spec: JobSpec) -> Prior | None:
    """The registration a lost coordinator of this multi-node job left (registered, not running,
    never unregistered), if it listened at this coordinator's address; None otherwise (or with
    `--fresh`)."""
    if not spec.nodes or spec.fresh:
        return None
    pid = registered_pid(spec.job_dir)
    if pid is None or pid == os.getpid() or alive(pid):
        return None
    try:
        info = json.loads((spec.job_dir / "job.json").read_text())
        secret = bytes.fromhex((spec.job_dir / "secret").read_text().strip())
        host, _, control = str(info["coordinator"]).rpartition(":")
        store_host, _, store = str(info["store"]).rpartition(":")
        ports = int(control), int(store)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if host != spec.host or store_host != spec.host or len(secret) != 32:
        return None
    return Prior(secret, *ports)


async def take_back(c: Job, nodes: NodeLauncher) -> list[Evidence] | None:
    """Wait for the job's nodes and processes to rejoin; the losses to report once the job trains
    again (slots whose rank ended or never came back), or None when no node rejoined."""
    nodes.rejoining = True
    known = nodes.roll()  # spare nodes too: closing the door on one would fence its warm spares

    def every_node() -> bool:
        back = nodes.joined()
        return sum(1 for n in back if n.slots) >= nodes.expected and known <= {n.name for n in back}

    try:
        try:
            await c.changes.wait_for(
                lambda: bool(nodes.joined()), FIRST_NODE_WAIT, "a node to rejoin"
            )
        except TimeoutError:
            return None
        with contextlib.suppress(TimeoutError):
            await c.changes.wait_for(
                every_node, timedelta(seconds=c.spec.node_timeout), "every node to rejoin"
            )
    finally:
        nodes.rejoining = False
    nodes.started = True
    with contextlib.suppress(TimeoutError):
        await c.changes.wait_for(
            lambda: not c.roster.pending, PROCESSES_WAIT, "their processes to rejoin"
        )
    for agent in list(c.roster.pending):  # alive on its node but never back: fenced, its slot lost
        del c.roster.pending[agent]
        c.launcher.kill(agent)
    generation, completed = -1, -1
    for m in c.roster.ranks():
        joined = m.joined
        if joined is not None:
            m.completed = max(m.completed, joined.completed)
            generation, completed = max(generation, joined.generation), max(completed, m.completed)
    stale = _fence_stale(c, generation)
    c.took_back(max(generation, 0), nodes.highest_agent_number())
    c.progress.completed(completed)
    c.incidents.outcomes.extend(_prior_outcomes(c.spec))
    log.warning(
        "job %s taken back in generation %d: %d node(s), %d rank(s) rejoined",
        c.job_id,
        c.generation,
        len(nodes.joined()),
        len(c.roster.ranks()),
    )
    return _lost_meanwhile(c, nodes, stale)


def _generation_of(m: Member) -> int:
    return m.joined.generation if m.joined is not None else -1


def _fence_stale(c: Job, newest: int) -> dict[int, str]:
    """Fence what cannot go on in the world as it stands, and say why for each slot it empties: a
    rank that rejoined in an older generation than the newest (it missed a re-formation: the group
    it knows is gone), and a second process claiming a slot another holds (the one in the newest
    generation and furthest along stays). A rank that never joined a group (generation -1) is left
    to form one."""
    why: dict[int, str] = {}
    held: set[int] = set()
    by_standing = sorted(
        c.roster.ranks(), key=lambda m: (_generation_of(m), m.completed), reverse=True
    )
    for m in by_standing:
        gen = _generation_of(m)
        if m.slot in held:
            log.warning(
                "job %s: %s claims slot %d, held already: fenced", c.job_id, m.agent_id, m.slot
            )
            c.fence(m)
        elif -1 < gen < newest:
            log.warning(
                "job %s: %s rejoined in generation %d of %d: fenced",
                c.job_id,
                m.agent_id,
                gen,
                newest,
            )
            c.fence(m)
            why[m.slot] = f"was left in generation {gen} while the job went on in {newest}"
        else:
            held.add(m.slot)
    return why


def _lost_meanwhile(c: Job, nodes: NodeLauncher, stale: dict[int, str]) -> list[Evidence]:
    out = []
    for slot in range(c.world_size):
        if any(m.slot == slot and not m.fenced for m in c.roster.ranks()):
            continue
        node, code = nodes.ended_in(slot)
        if slot in stale:
            node, code = c.roster.home(slot) or node, None
            kind, what = FailureKind.CONNECTION_LOST, stale[slot]
        elif code is None:
            kind, what = FailureKind.CONNECTION_LOST, "did not rejoin"
        else:
            kind, what = FailureKind.PROCESS_EXIT, f"ended ({signal_name(code)})"
        out.append(
            Evidence(
                kind=kind,
                source=EventSource.COORDINATOR,
                job_id=c.job_id,
                failure_domain=node,
                slots=(slot,),
                detail=f"rank {slot} {what} while the job's coordinator was away",
                observed_at=datetime.now(UTC),
                exit_code=code,
            )
        )
    return out


def _prior_outcomes(spec: JobSpec) -> list[MigrationOutcome]:
    """The incidents the lost coordinator recorded (its `incidents.jsonl`): the job's result has
    them all."""
    out: list[MigrationOutcome] = []
    with contextlib.suppress(OSError), (spec.job_dir / "incidents.jsonl").open() as f:
        for line in f:
            if len(out) >= MAX_PRIOR_OUTCOMES:
                break
            try:
                out.append(MigrationOutcome.model_validate_json(line))
            except ValidationError as e:
                log.error(
                    "an unreadable incident record in %s/incidents.jsonl skipped: %s",
                    spec.job_dir,
                    e,
                )
    return out
