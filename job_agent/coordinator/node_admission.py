"""A job's node agents joining and leaving, as its coordinator decides: a node's hello admitted or
refused, the start waiting for the nodes that hold every slot, and a node gone silent cut off as
lost. (Where each process runs on them is `node_launcher.py`.)"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from datetime import timedelta

from job_agent import wire
from job_agent.coordinator.channel import cut, send
from job_agent.coordinator.members import Pending, Roster
from job_agent.coordinator.node_launcher import NodeLauncher
from job_agent.coordinator.waiting import Changes, JobFailed
from job_agent.wire.rank import Role
from torchpass.job import JobSpec

log = logging.getLogger("torchpass.coordinator")


def cut_silent(nodes: NodeLauncher, roster: Roster, timeout: timedelta) -> None:
    """A node agent unheard past `timeout` (a hung or cut-off host) is lost with every process on
    it: the connections of its agent and of its processes are shut from this side, and their closing
    reports the loss as an agent's death would (one node loss; its processes fenced, their own
    losses part of it). When the host comes back its agent finds its connection gone and stops them:
    they never rejoin."""
    for node in nodes.silent(timeout):
        node.lost_why = (
            f"its agent unheard for {nodes.clock.monotonic() - node.last_heard:.1f} s "
            "(hung or cut off)"
        )
        log.error("node %s lost: %s", node.name, node.lost_why)
        for agent in node.placed:
            if (m := roster.members.get(agent)) is not None:
                m.fenced = True
                cut(m.conn)
        cut(node.conn)


def admit_node(
    nodes: NodeLauncher | None,
    roster: Roster,
    conn: socket.socket,
    hello: wire.NodeHello,
    start_spare: Callable[[], object],
) -> wire.Frame:
    """The answer to a node agent's hello: welcome, or refused with why. A node joining a job
    already running (a spare node, a replacement) gets the warm spares it announced at once; the
    processes of a node that rejoined may rejoin in turn."""
    if nodes is None:
        return wire.Reject(reason=f"job {hello.job_id} runs on one host: it takes no node agents")
    refused = nodes.join(conn, hello)
    if refused is not None:
        return wire.Reject(reason=refused)
    if hello.rejoin:
        for p in hello.processes:
            if p.code is None:
                role = Role.SPARE if p.slot < 0 else Role.RANK
                roster.pending[p.agent_id] = Pending(hello.node, role)
        return wire.Welcome()
    send(conn, wire.Welcome())  # before its first Spawn
    for _ in range(hello.spares if nodes.started else 0):
        start_spare()
    return wire.Ok()


async def wait_for_nodes(nodes: NodeLauncher, changes: Changes, spec: JobSpec) -> int:
    """Until the job's nodes have joined holding every slot: the warm spares they keep between them.
    JobFailed, saying what came, past the start-up timeout."""
    timeout = timedelta(seconds=spec.startup_timeout)
    try:
        await changes.wait_for(lambda: nodes.ready_for(spec.nproc), timeout, "the nodes to join")
    except TimeoutError:
        joined = nodes.joined()
        raise JobFailed(
            f"{len(joined)} of {spec.nodes} nodes joined within the start-up timeout, holding "
            f"{sum(n.slots for n in joined)} of the {spec.nproc} slots"
        ) from None
    nodes.started = True
    return nodes.warm_spares()
