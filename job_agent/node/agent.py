"""`torchpass node`: the node agent, one per host of a multi-node job.

It joins the job's coordinator over the authenticated control channel, then starts the ranks and
warm spares the coordinator places on this node, each running the node's own command (the script and
arguments its operator gave it, never a command sent over the network), and tells the coordinator
when each one ends. It fences (kills) and stops or continues them when told. Its processes advertise
the node's address to their peers (their state servers listen there), read the job's secret from the
node's own copy of it, and die with the agent (a parent-death signal): a node agent that is gone has
no process left running.

The agent leaves, stopping its processes, when the coordinator says the job has ended or when its
connection to the coordinator is lost.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import stat
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

from job_agent import wire
from job_agent.launch.launcher import LocalLauncher
from job_agent.node.health_watch import HealthWatch
from job_agent.node.interfaces import collective_interface
from job_agent.node.settings import NodeSettings
from job_agent.wire import protocol
from job_agent.wire.node import NodeProcess, SignalAction
from job_agent.wire.protocol import EXIT_COORDINATOR_LOST
from torchpass.errors import ErrorType

log = logging.getLogger("torchpass.node")
CONNECT_TIMEOUT = timedelta(seconds=30)
HEARTBEAT = timedelta(seconds=0.5)
STOP_GRACE = timedelta(seconds=5)
REJOIN_EVERY = timedelta(seconds=0.5)
EXIT_REFUSED = 3


class BadSecret(Exception):
    """The node's copy of the job's secret is missing or unreadable."""


def _read_secret(path: Path) -> bytes:
    """The job's secret from the node's copy, which must be its owner's alone (`BadSecret`
    otherwise, naming the fix)."""
    try:
        fd = os.open(path, os.O_RDONLY)
        with os.fdopen(fd) as f:
            mode = stat.S_IMODE(os.fstat(f.fileno()).st_mode)
            secret = bytes.fromhex(f.read().strip())
    except (OSError, ValueError) as e:
        raise BadSecret(f"cannot read the job's secret from {path}: {e}") from None
    if mode & 0o077:
        raise BadSecret(
            f"the job's secret {path} is open to other users of this host (mode {mode:04o}); "
            f"make it its owner's alone: chmod 600 {path}"
        )
    return secret


class NodeRefused(Exception):
    """The coordinator did not admit this node (another job's, a name already taken, ...)."""


class NodeAgent:
    def __init__(self, settings: NodeSettings) -> None:
        self.settings = settings
        self._secret = _read_secret(settings.secret_file)
        # Forked from a warm interpreter (`job_agent.launch.forkserver`), as a single host's are:
        # each says its pid and GPU in its hello (`torchpass status` shows them), as /proc cannot
        # show a fork's environment.
        self._launcher = LocalLauncher(str(settings.script), settings.args)
        self._collective_interface = collective_interface(settings.host, os.environ)
        self._send_lock = threading.Lock()
        self._done = threading.Event()
        self._started: dict[str, int] = {}  # agent -> the slot it was started for (-1: a spare)
        self._exits: dict[str, int] = {}
        self._first_slot = -1  # of the slots this node holds: its first rank's
        # processes this agent was told to kill: their SIGKILL is no OOM
        self._killed: set[str] = set()
        self._health = HealthWatch(settings, self._launcher, self._send, self._done)
        self._sock = self._join(rejoin=False)

    def _join(self, rejoin: bool) -> socket.socket:
        """Connect and say hello (a rejoin says what it runs); the connection once welcomed."""
        s = self.settings
        sock = protocol.connect(*s.coordinator_addr(), self._secret, CONNECT_TIMEOUT)
        procs = tuple(
            NodeProcess(agent_id=a, slot=slot, code=self._exits.get(a))
            for a, slot in self._started.items()
        )
        hello = wire.NodeHello(
            job_id=s.job_id,
            node=s.node,
            host=s.host,
            slots=s.slots,
            spares=s.spares,
            pid=os.getpid(),
            rejoin=rejoin,
            first_slot=self._first_slot,
            processes=procs if rejoin else (),
        )
        try:
            protocol.send_frame(sock, hello)
            reply = protocol.recv_frame(sock)
        except (OSError, ConnectionError, protocol.ProtocolError):
            sock.close()
            raise
        if not isinstance(reply, wire.Welcome):
            sock.close()
            raise NodeRefused(
                reply.reason if isinstance(reply, wire.Reject | wire.Error) else reply.t
            )
        return sock

    def run(self) -> int:
        """Serve the coordinator until the job ends (0) or the coordinator is lost for good; from
        the main thread, so that the processes' parent-death signal follows the agent itself."""
        threading.Thread(
            target=self._heartbeats, name="torchpass-node-heartbeat", daemon=True
        ).start()
        if self.settings.gpu_check_every:
            threading.Thread(
                target=self._health.gpus, name="torchpass-node-gpus", daemon=True
            ).start()
        if self.settings.host_check_every:
            threading.Thread(
                target=self._health.host, name="torchpass-node-host", daemon=True
            ).start()
        try:
            while True:
                try:
                    frame = protocol.recv_frame(self._sock)
                except (OSError, ConnectionError, protocol.ProtocolError) as e:
                    if not self._rejoin(e):
                        return EXIT_COORDINATOR_LOST
                    continue
                if isinstance(frame, wire.Exit):
                    return 0
                self._on_frame(frame)
        finally:
            self._done.set()
            self._launcher.shutdown(STOP_GRACE)
            self._sock.close()

    def _rejoin(self, why: Exception) -> bool:
        """The coordinator is lost: its processes go on training while the node waits
        `coordinator_wait` for it to be back at the same address (restarted with the job's state
        directory). False: it never came back, or refused the node (fenced: the node was lost to the
        job); its processes then stop."""
        node, wait = self.settings.node, self.settings.coordinator_wait
        log.error("node %s: lost the job's coordinator (%s); rejoining for %.0f s", node, why, wait)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            time.sleep(REJOIN_EVERY.total_seconds())
            try:
                sock = self._join(rejoin=True)
            except NodeRefused as e:
                log.error(
                    "node %s: the coordinator refused it back (%s); stopping its processes", node, e
                )
                return False
            except (OSError, ConnectionError, protocol.ProtocolError):
                continue
            with self._send_lock:
                self._sock.close()
                self._sock = sock
            log.warning("node %s: rejoined the job's coordinator", node)
            return True
        log.error("node %s: no coordinator within %.0f s; stopping its processes", node, wait)
        return False

    def _on_frame(self, frame: wire.Frame) -> None:
        match frame:
            case wire.Spawn(agent_id=agent_id, env=env):
                self._spawn(agent_id, env)
            case wire.Signal(agent_id=agent_id, action=action):
                act = {
                    SignalAction.KILL: self._kill,
                    SignalAction.STOP: self._launcher.suspend,
                    SignalAction.CONT: self._launcher.resume,
                }[action]
                act(agent_id)
            case wire.Ok():
                pass  # joined a running job: its first spares' Spawns came before this
            case _:
                self._send(
                    wire.Error(
                        code=ErrorType.UNKNOWN_FRAME, reason=f"a node does not take {frame.t!r}"
                    )
                )

    def _spawn(self, agent_id: str, env: dict[str, str]) -> None:
        if agent_id in self._started:
            return  # said twice: the process is already there
        device = self._health.device_for_a_new_process()
        slot = (
            int(env.get("TORCHPASS_SLOT", "-1"))
            if env.get("TORCHPASS_SLOT", "").lstrip("-").isdigit()
            else -1
        )
        self._started[agent_id] = slot
        if self._first_slot < 0 and env.get("TORCHPASS_ROLE") == "rank":
            # a node's ranks are started in slot order, its first slot first
            self._first_slot = slot
        mine = {
            "TORCHPASS_REJOIN_FOR": str(self.settings.coordinator_wait),
            "TORCHPASS_SECRET_FILE": str(self.settings.secret_file),
            "TORCHPASS_ADVERTISE_HOST": self.settings.host,
            "LOCAL_RANK": str(device),
            # as NVML numbers GPUs
            "CUDA_DEVICE_ORDER": os.environ.get("CUDA_DEVICE_ORDER", "PCI_BUS_ID"),
            **self._collective_interface,
        }
        try:
            self._launcher.spawn(agent_id, {**env, **mine})
        except (OSError, RuntimeError) as e:
            log.error("node %s: could not start %s: %s", self.settings.node, agent_id, e)
            self._send(wire.Exited(agent_id=agent_id, code=127))
            return
        threading.Thread(
            target=self._reap, args=(agent_id,), name=f"torchpass-wait-{agent_id}", daemon=True
        ).start()

    def _kill(self, agent_id: str) -> None:
        self._killed.add(agent_id)
        self._launcher.kill(agent_id)

    def _reap(self, agent_id: str) -> None:
        code = self._launcher.wait(agent_id)
        if code == -signal.SIGKILL and agent_id not in self._killed and not self._done.is_set():
            # said before its exit: the coordinator learns why with it
            self._health.oom_killed(agent_id)
        self._exits[agent_id] = code  # said again on a rejoin, if the coordinator was away
        self._send(wire.Exited(agent_id=agent_id, code=code))

    def _heartbeats(self) -> None:
        while not self._done.wait(HEARTBEAT.total_seconds()):
            self._send(wire.Heartbeat())

    def _send(self, frame: wire.Frame) -> None:
        try:
            with self._send_lock:
                protocol.send_frame(self._sock, frame)
        except OSError:
            pass  # the reader sees the loss and ends the agent


def run_node(settings: NodeSettings) -> int:
    try:
        agent = NodeAgent(settings)
    except BadSecret as e:
        print(f"torchpass node: {e}", file=sys.stderr)
        return EXIT_REFUSED
    except NodeRefused as e:
        print(f"torchpass node: the coordinator refused node {settings.node}: {e}", file=sys.stderr)
        return EXIT_REFUSED
    except (OSError, ConnectionError, protocol.ProtocolError) as e:
        # A wrong secret ends the handshake: the coordinator hangs up on a peer that cannot prove
        # it.
        print(
            f"torchpass node: node {settings.node} could not join the coordinator at "
            f"{settings.coordinator} (refused, or unreachable; is the secret file this job's?): "
            f"{e}",
            file=sys.stderr,
        )
        return EXIT_REFUSED
    print(
        f"torchpass node {settings.node}: joined job {settings.job_id} at {settings.coordinator}",
        flush=True,
    )
    return agent.run()
