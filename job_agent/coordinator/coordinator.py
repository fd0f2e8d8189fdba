"""The per-job coordinator: the job's processes, its control channel, and the job side of its
incidents.

It runs off the training ranks (so no training node is special): it hosts the rendezvous store,
launches the ranks and a pool of warm spares, and reads every frame they send. What it sees goes to
its parts: membership (`members.Roster`), detection (`detection.Detector` -> evidence), operator
requests (`injection.Injector`), the spare pool (`spares.SparePool`), the state transport
(`transfer`), the steps' measurements (`progress.StepTracker`) and the incident in progress
(`incident.IncidentTracker`, whose reports become incident workflows). The recovery steps
(`steps.IncidentSteps`) act through it.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from datetime import timedelta

from job_agent import wire
from job_agent.coordinator import resume
from job_agent.coordinator.channel import ControlServer
from job_agent.coordinator.clock import SYSTEM, Clock
from job_agent.coordinator.detect.cluster import ClusterSignals
from job_agent.coordinator.detect.conditions import HostConditions
from job_agent.coordinator.detect.detection import Detector
from job_agent.coordinator.detect.injection import Injector
from job_agent.coordinator.detect.replicas import ReplicaChecks
from job_agent.coordinator.detect.watch import watch
from job_agent.coordinator.ending import job_result, judge_exits, put_away, stop_at_a_step_boundary
from job_agent.coordinator.inbound import ENDED, Inbound
from job_agent.coordinator.incident.tracker import IncidentTracker, Reporter
from job_agent.coordinator.incident.transport import DirectTransport, StateTransport
from job_agent.coordinator.interrupt import stopped_by_signals
from job_agent.coordinator.jobs import register
from job_agent.coordinator.members import Member, Pending, Roster
from job_agent.coordinator.node_admission import wait_for_nodes
from job_agent.coordinator.node_launcher import NodeLauncher
from job_agent.coordinator.private_files import open_private
from job_agent.coordinator.progress import StepTracker
from job_agent.coordinator.resume import Checkpoints, ProgressFile
from job_agent.coordinator.spares import LocalSparePool, SparePool
from job_agent.coordinator.store_server import StoreServer
from job_agent.coordinator.takeback import prior_coordinator, take_back
from job_agent.coordinator.waiting import Changes, JobFailed
from job_agent.launch.launcher import Launcher, LocalLauncher, agent_env, command, free_port
from job_agent.wire.operator import MemberState
from job_agent.wire.rank import Role
from job_agent.wire.store import STORE_PREFIX
from torchpass.incident.outcome import MigrationOutcome
from torchpass.job import JobResult, JobSpec, JobState, Resumed
from torchpass.models import Evidence
from torchpass.signing import is_signed

SHUTDOWN_GRACE = timedelta(seconds=10)
# for a stopped job's ranks to freeze at one step boundary, and again to say what they hold
STOP_WAIT = timedelta(seconds=5)
FILE_WAIT = timedelta(seconds=30)


class Coordinator:
    """One per job. All state is touched on the event loop thread only."""

    def __init__(
        self,
        spec: JobSpec,
        reporter: Reporter,
        launcher: Launcher | None = None,
        clock: Clock = SYSTEM,
    ) -> None:
        self.spec = spec
        self.clock = clock
        self.job_id = spec.job_id
        self.world_size = spec.nproc
        self.covered = spec.contract is not None
        self.startup_timeout = timedelta(seconds=spec.startup_timeout)
        self.hang_timeout = timedelta(seconds=spec.hang_timeout)
        self.stripe_donors = spec.stripe_donors
        self.state = JobState.STARTING
        # the ranks were started: one lost before training is the script's failure
        self.launching = False
        self.error: str | None = None
        self.held: list[Member] = []  # the ranks as the job began to end (`ending.job_result`)
        self.checkpoints = Checkpoints()
        self._generation = -1
        self.restarts, self._launch = 0, (0, 0)
        # A lost coordinator's multi-node job may still train: its secret and ports, to take it
        # back.
        self._prior = prior_coordinator(spec)
        self._secret = self._prior.secret if self._prior else secrets.token_bytes(32)
        control_port, store_port = (p.control_port, p.store_port) if (p := self._prior) else (0, 0)
        self.roster = Roster(clock)
        self.replicas = ReplicaChecks(self.job_id, self.world_size, self.roster, self.add_evidence)
        self.nodes = (
            NodeLauncher(self.job_id, spec.nodes, self.roster.is_spare, spec.job_dir, clock)
            if spec.nodes
            else None
        )
        self.launcher = launcher or self.nodes or LocalLauncher(*command(spec))
        self._spawned = 0
        self._done = asyncio.get_running_loop().create_future()
        self._watcher: asyncio.Task[None] | None = None
        # each lost connection's check, until it reports
        self.tasks: set[asyncio.Task[None]] = set()
        # Authenticated: torch's TCPStore serves anyone. Both listen on the job's address, never a
        # wildcard.
        self._store = StoreServer(self._secret, spec.host, store_port)
        loop = asyncio.get_running_loop()
        inbound = Inbound(self)
        self._server = ControlServer(
            self._secret, loop, inbound.on_frame, inbound.on_close, spec.host, control_port
        )
        self._address = f"{spec.host}:{self._server.port}"
        self._store_address = f"{spec.host}:{self._store.port}"
        self.changes = Changes(clock)
        self._progress_file = ProgressFile(spec.job_dir)
        self.progress = StepTracker(self._progress_file.write)
        self.resumed: Resumed | None = None
        # what the cluster took away
        avoid = self.nodes.avoid if self.nodes is not None else set[str]()
        self.spares: SparePool = LocalSparePool(
            self.roster, lambda: self.spawn(Role.SPARE, -1), self.fence, avoid
        )
        self.transport: StateTransport = DirectTransport(self.changes)
        self.incidents = IncidentTracker.of_job(spec, lambda: self._generation, reporter)
        self.incidents.holders = self.roster.holders
        self.cluster = ClusterSignals(
            self.job_id, self.roster, self.launcher, avoid, self.incidents, self.add_evidence
        )
        self.cluster.training = lambda: self.state is JobState.TRAINING
        self.detector = Detector(self.job_id, self.roster, self.hang_timeout, clock)
        self.conditions = HostConditions(self.job_id, self.roster, self.incidents, self.nodes)
        self.injector = Injector(self.job_id, self.world_size, self.roster, self.launcher)

    @property
    def generation(self) -> int:
        return self._generation

    # --- lifecycle
    # -----------------------------------------------------------------------------------

    async def run(self) -> JobResult:
        with stopped_by_signals(lambda why: self.fail(why, JobState.STOPPED)):
            return await self._run()

    async def _run(self) -> JobResult:
        taken_back = None
        if self._prior is not None and self.nodes is not None:
            taken_back = await take_back(self, self.nodes)  # the job still trains on its nodes
        if taken_back is None:
            self.resumed = resume.prepare(self.spec.job_dir, self.spec.fresh)
        register(self.spec, self._secret, self._address, self._store_address)
        # the steps it completed are measured as recomputed when run again
        if self.resumed is not None:
            self.progress.completed(self.resumed.last_completed)
            if self.resumed.checkpoint is not None:
                self.checkpoints.append((self.resumed.checkpoint_step, self.resumed.checkpoint))
        self._watcher = asyncio.ensure_future(watch(self))
        try:
            if taken_back is None:
                self.launching = True  # the ranks start now (a job taken back has its own)
                await self._start_processes()
                await self.changes.wait_for(
                    lambda: len(self.roster.ranks(MemberState.READY)) == self.world_size,
                    self.startup_timeout,
                    "the ranks to start",
                )
                self.regroup()
            self.state = JobState.TRAINING
            for ev in taken_back or ():  # ranks lost while the coordinator was away
                self.add_evidence(ev)
            await self._done
        except TimeoutError:
            self.fail("the ranks did not all join within the start-up timeout")
        except JobFailed as e:
            self.fail(str(e))
        return await self._shutdown()

    async def _start_processes(self) -> None:
        """The ranks and the warm spares: on this host, or on the job's nodes once they have
        joined."""
        spares = self.spec.spares
        if self.nodes is not None:  # theirs: the warm spares the nodes announced
            spares = await wait_for_nodes(self.nodes, self.changes, self.spec)
        self.restart_ranks(self.latest_checkpoint()[1])
        for _ in range(spares):
            self.spawn(Role.SPARE, -1)

    def took_back(self, generation: int, spawned: int) -> None:
        """The job was taken back (`takeback.py`) in `generation`, its agents numbered to
        `spawned`."""
        self._generation, self._spawned = generation, spawned

    def regroup(self) -> int:
        """Form the next generation of the world with every current rank; returns its number."""
        self._generation += 1
        self.injector.on_regroup()
        self._store.drop_before(STORE_PREFIX, self._generation - 1)
        self.progress.begin_generation()
        for m in self.roster.ranks():
            m.state = MemberState.JOINING
            m.joined = None
            m.send(wire.Regroup(generation=self._generation, world_size=self.world_size))
        return self._generation

    def abandon(self, generation: int) -> None:
        """`generation`'s group will never form: the ranks blocked forming it stop waiting (the
        store)."""
        self._store.abandon(STORE_PREFIX, generation)

    async def _shutdown(self) -> JobResult:
        # Nothing reacts to the exits that follow (a spare stopped now is not replaced).
        if self._watcher is not None:
            self._watcher.cancel()
        self.held = self.roster.ranks()
        finished, stopped = self.state is JobState.FINISHED, self.state is JobState.STOPPED
        if stopped:  # said once, by the command; the ranks go quietly
            await stop_at_a_step_boundary(self.held, STOP_WAIT.total_seconds())
        reason = "" if finished or stopped else f"job {self.job_id} stopped: {self.error}"
        for m in self.roster.members.values():
            if m.alive:
                m.send(wire.Exit(code=0 if finished else 1, reason=reason))
        grace = self.spec.finish_grace if finished else SHUTDOWN_GRACE.total_seconds()
        deadline = time.monotonic() + grace
        # A spare still starting is told to go as it connects; a migration's last step is still
        # recorded.
        while time.monotonic() < deadline and (
            any(self.launcher.poll(a) is None for a in [*self.roster.members, *self.roster.pending])
            or (finished and self.incidents.current is not None)
        ):
            await asyncio.sleep(0.05)
        late = {m.agent_id for m in self.roster.ranks() if self.launcher.poll(m.agent_id) is None}
        await asyncio.to_thread(self.launcher.shutdown, timedelta(seconds=5))
        judge_exits(self, self.launcher, late)
        # The job handled some itself: let their workflows file them.
        await self.incidents.records.filed(FILE_WAIT)
        self.incidents.cancel()
        self._server.close()
        self._store.close()
        result = job_result(self)
        put_away(self.spec, result, self._progress_file)
        return result

    def fail(self, error: str | None, state: JobState = JobState.FAILED) -> None:
        """The job ends (`error` None: it finished); every wait on it fails from now on."""
        if self.state in ENDED:
            return
        self.state, self.error = state, error
        self.changes.stop(error or "the job finished")
        if not self._done.done():
            self._done.set_result(None)

    def spawn(self, role: Role, slot: int, restore: str | None = None) -> str:
        self._spawned += 1
        agent_id = f"{role.value}{slot if slot >= 0 else ''}-{self._spawned}"
        env = agent_env(
            self.spec,
            agent_id,
            role.value,
            slot,
            self._address,
            self._store_address,
            restore,
            self._launch,
        )
        self.roster.pending[agent_id] = Pending(self.launcher.spawn(agent_id, env), role)
        return agent_id

    # --- what the incident steps may do (steps.JobControl)
    # ----------------------------------------------

    def fence(self, m: Member) -> None:
        """Kill for good: a fenced process is never let back in."""
        m.fenced = True
        self.launcher.kill(m.agent_id)

    def restart_ranks(self, restore: str | None) -> None:
        self.restarts += self.state is JobState.TRAINING
        # torchrun's
        self._launch = (self.restarts, 0 if self.spec.agent else free_port(self.spec.host))
        for slot in range(self.world_size):
            self.spawn(Role.RANK, slot, restore=restore)

    def latest_checkpoint(self) -> tuple[int, str | None]:
        return self.checkpoints[-1] if self.checkpoints else (-1, None)

    def end_incident(self, outcome: MigrationOutcome, refuted: bool = False) -> None:
        """The incident's workflow is done with the job; detection resumes, queued failures go
        next. A refuted claim is no incident of the job's: it is not in its incident log."""

        if self.incidents.end(outcome, self.roster.repaired, refuted) and not refuted:
            with open_private(self.spec.job_dir / "incidents.jsonl", "a") as f:
                f.write(outcome.model_dump_json() + "\n")

    def add_evidence(self, ev: Evidence) -> None:
        self.incidents.add(ev)
        for cause in self.conditions.explaining(ev):  # a full disk, the host out of memory, ...
            self.incidents.add(cause)

    def on_transfer(self, donor: Member, receivers: list[Member]) -> None:
        self.injector.on_transfer(donor, receivers)

    def signed(self, ev: Evidence) -> bool:
        """Whether `ev` carries a signature under this job's secret (`torchpass.signing`)."""
        return is_signed(self._secret, ev)
