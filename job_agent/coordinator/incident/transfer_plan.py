"""The plan of a recovery's state transfer: which replica serves, which spare takes each lost slot,
and the plan re-made when a donor, a receiver or another rank is lost on the way (`IncidentSteps`
runs it from `transfer_state`, and from `rejoin` for a rank lost after the state moved)."""

from __future__ import annotations

import contextlib
from datetime import timedelta

from job_agent import wire
from job_agent.coordinator.incident.donors import receivers
from job_agent.coordinator.incident.job_control import JobControl, Tick
from job_agent.coordinator.incident.lifecycle import Incident, IncidentError
from job_agent.coordinator.members import Member
from job_agent.wire.rank import Assign, Role
from torchpass.errors import ErrorType
from torchpass.incident.proof import transfer_problems
from torchpass.incident.steps import ReceiverProof, TransferProof

# Transfers one recovery may start, each after a loss, before it gives up (each needs a spare or a
# donor).
MAX_REPLANS = 4


def mismatch(problems: list[str]) -> IncidentError:
    return IncidentError(ErrorType.PROOF_MISMATCH, "proof does not hold: " + "; ".join(problems))


class TransferPlanner:
    """Holds a recovery's spares and moves the state to every slot that needs it, re-planning
    around each loss; `transport` moves the bytes."""

    def __init__(self, job: JobControl, transfer_timeout: timedelta, spare_wait: timedelta) -> None:
        self.job = job
        self.transfer_timeout = transfer_timeout
        self.spare_wait = spare_wait

    async def hold_spares(self, inc: Incident, need: int) -> list[Member]:
        """`need` live spares held for `inc` (those it holds first); NoSpareAvailable when there are
        not."""
        job = self.job

        def held() -> int:
            return len([m for m in job.spares.held(inc.workflow_id) if m.alive])

        # A spare still warming up (the pool refills after each migration) is worth a few seconds'
        # wait: far cheaper than a checkpoint restart.
        with contextlib.suppress(TimeoutError):
            await job.changes.wait_for(
                lambda: held() + len(job.spares.ready()) >= need or job.spares.warming() == 0,
                self.spare_wait,
                "a warm spare",
            )
        if held() + len(job.spares.ready()) < need:
            raise IncidentError(
                ErrorType.NO_SPARE, f"{need} spare(s) needed, {len(job.spares.ready())} warm"
            )
        # A spare on a lost rank's own node first (not one a planned move leaves); then one on a
        # node that runs no rank (a spare node: a whole node's ranks land together, the training
        # nodes keep theirs).
        near = {n for s in inc.lost - inc.leaving if (n := job.roster.home(s)) is not None}
        spare_nodes = {m.node for m in job.spares.ready()} - {m.node for m in job.roster.ranks()}
        return [m for m in job.spares.reserve(inc.workflow_id, need, near, spare_nodes) if m.alive]

    async def transfer(self, inc: Incident, tick: Tick) -> TransferProof:
        """Every slot that needs the state gets it from a replica at the frozen step. A donor,
        receiver or other rank lost on the way is one more loss of this recovery: the plan is
        re-made with the replicas and spares left (another donor, the next spare), and what was
        installed stays. Called again (by rejoin, for a rank lost after the state moved) it supplies
        only what is missing."""
        job = self.job
        if inc.frozen is None:
            raise IncidentError(ErrorType.OUT_OF_ORDER, "transfer before freeze")
        target, sup = inc.frozen.target_step, inc.transfers
        while True:
            live = {
                s: k
                for s, k in inc.frozen.completed_steps.items()
                if s not in inc.lost and job.roster.at(s)
            }
            # The ranks a planned move takes out give their own state first (a shard with no replica
            # has no other donor); then the survivors holding the frozen step.
            donors = [
                m for m in job.roster.departing() if m.slot in inc.leaving and m.completed == target
            ]
            donors += [self._member(s) for s, k in sorted(live.items()) if k == target]
            if not donors:
                # Retried: survivors still settling after a loss may serve on the next attempt.
                raise IncidentError(
                    ErrorType.TRANSFER_FAILED, f"no healthy replica holding step {target} is left"
                )
            new = await self._assign_spares(inc)
            need = [
                s
                for s in receivers(live, target, frozenset(new))
                if s not in sup.got or sup.got[s][0] != self._member(s).agent_id
            ]
            if not need:
                break
            shard, shards = self._shard_of(need, donors), job.roster.shards
            # data parallel: every slot holds it
            one = len({shards.get(d.slot) for d in donors}) == 1
            # a shard a move
            need = [s for s in need if shards.get(s) == shard or (one and s not in shards)]
            donors = [d for d in donors if shards.get(d.slot) == shard]
            if not donors:
                raise IncidentError(
                    ErrorType.BEYOND_REDUNDANCY,
                    f"no healthy replica of rank {need[0]}'s shard holds step {target}",
                )
            if sup.moves - len(sup.shards) > MAX_REPLANS:
                raise IncidentError(
                    ErrorType.TRANSFER_FAILED,
                    f"gave up after {sup.moves} transfers, each losing a process",
                )
            sources, targets = self._donors(donors), [self._member(s) for s in need]
            sup.moves += 1  # a move after each shard's first is the plan re-made around a loss
            sup.shards.add(shard)
            job.on_transfer(sources[0], targets)
            try:
                moved = await job.transport.move(sources, targets, self.transfer_timeout, tick)
            except IncidentError:
                lost = [m for m in (*sources, *targets) if not m.alive]
                if not lost:
                    raise
                for m in lost:
                    inc.lost.add(m.slot)
                for m in targets:  # whoever installed the state before the loss keeps it
                    r = m.answers.received() if m.answers is not None else None
                    if m.alive and r is not None:
                        sup.got[m.slot] = (m.agent_id, r, sources[0].slot)
                continue
            sup.served.extend(moved.served.items())
            # a donor that served (the first may not have)
            first = next(iter(moved.served), sources[0].slot)
            for m in targets:
                sup.got[m.slot] = (m.agent_id, moved.received[m.slot], first)
            # A donor lost while the others finished its slices is a loss of this recovery: the next
            # round gives its slot a spare and the state.
            inc.lost.update(m.slot for m in sources if not m.alive)
        proof = self._proof(
            inc, target, sup.got, sup.served, max(0, sup.moves - max(1, len(sup.shards)))
        )
        problems = transfer_problems(proof, target)
        if problems:
            raise mismatch(problems)
        return proof

    def _proof(
        self,
        inc: Incident,
        target: int,
        got: dict[int, tuple[str, wire.Received, int]],
        served: list[tuple[int, wire.Served]],
        replans: int,
    ) -> TransferProof:
        """What the ranks said of the transfer, as one proof (`torchpass.incident.proof` checks
        it)."""
        assert inc.frozen is not None
        live = {s: k for s, k in inc.frozen.completed_steps.items() if s not in inc.lost}
        # The first donor of the last transfer (a re-made plan's donors are the ones that count).
        donor_slot, last = next(
            ((d, x) for d, x in served if x.transfer == served[-1][1].transfer), (min(live), None)
        )
        return TransferProof(
            donor_slot=donor_slot,
            donor_step=last.step if last else target,
            receiver_slots=tuple(sorted(got)),
            donor_digest=last.digest if last else "",
            receivers=tuple(
                ReceiverProof(
                    slot=s,
                    stream_digest=r.stream_digest,
                    installed_digest=r.installed_digest,
                    installed_step=r.step,
                    bytes=r.bytes,
                    seconds=r.seconds,
                    stripes=r.stripes,
                    dropped=r.dropped,
                )
                for s, (_, r, _) in sorted(got.items())
            ),
            receiver_digests={s: r.installed_digest for s, (_, r, _) in got.items()},
            survivor_steps={s: k for s, k in live.items() if s not in got},
            step_before=inc.frozen.step_before if inc.frozen.step_before is not None else target,
            step_after=target,
            bytes=sum(x.bytes for _, x in served),
            seconds=sum(
                max(x.seconds for _, x in served if x.transfer == t)
                for t in {x.transfer for _, x in served}
            ),
            stream_seconds=sum(x.stream_seconds or 0.0 for _, x in served) if served else None,
            donor_of={s: d for s, (_, _, d) in got.items()},
            replans=replans,
            lost_during=tuple(sorted(inc.lost - inc.confirmed)),
            donor_digests={d: x.digest for d, x in served},
            donor_shards={d: self.job.roster.shards.get(d, "") for d, _ in served},
            receiver_shards={
                s: self.job.roster.shards[s] for s in got if s in self.job.roster.shards
            },
        )

    async def _assign_spares(self, inc: Incident) -> dict[int, Member]:
        """Give each lost slot one live spare held for the incident: the newcomer takes the dead
        rank's exact place. A slot whose spare was lost on the way gets the next one."""
        held = await self.hold_spares(inc, len(inc.lost))
        taken = {m.slot: m for m in held if m.role is Role.RANK and m.slot in inc.lost}
        free = sorted((m for m in held if m.role is Role.SPARE), key=lambda m: m.agent_id)
        for slot in sorted(inc.lost - taken.keys()):
            # A spare on the lost rank's own node first (not on the node a planned move leaves).
            home = None if slot in inc.leaving else self.job.roster.home(slot)
            m = taken[slot] = free.pop(next((i for i, f in enumerate(free) if f.node == home), 0))
            m.slot, m.role = slot, Role.RANK
            m.send(Assign(slot=slot))
        return taken

    def _shard_of(self, need: list[int], donors: list[Member]) -> str | None:
        """The shard to move next: the first slot's (a data-parallel job has one). A slot whose rank
        never reported its shard (lost while the coordinator was away) holds the job's only one, if
        it has one."""
        shard = self.job.roster.shards.get(need[0])
        held = {self.job.roster.shards.get(d.slot) for d in donors}
        if shard is None and len(held) == 1:
            return held.pop()
        if shard is None:
            raise IncidentError(
                ErrorType.TRANSFER_FAILED,
                f"rank {need[0]} never reported its shard and the replicas hold several",
            )
        return shard

    def _donors(self, donors: list[Member]) -> list[Member]:
        """The replicas to take the state from at once: one per node (a node's link is what limits
        its streams), in the order given, at most the job's stripe width."""
        per_node: dict[str, Member] = {}
        for m in donors:
            per_node.setdefault(m.node, m)
        return list(per_node.values())[: self.job.stripe_donors]

    def _member(self, slot: int) -> Member:
        m = self.job.roster.at(slot)
        if m is None:
            raise IncidentError(ErrorType.TRANSFER_FAILED, f"no live process holds slot {slot}")
        return m
