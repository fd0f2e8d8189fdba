"""What the cluster detectors read off the scheduler's objects, table-driven, and the one subprocess
function every Slurm command goes through (real processes). The detectors run end to end against the
stub API server and the real Slurm daemons in `tests/integration`."""

from __future__ import annotations

import sys
from datetime import UTC, datetime

import pytest
from kubernetes import client as k

from torchpass.models import FailureKind
from workers.detectors import slurm
from workers.detectors.kube import UNSCHEDULABLE_TAINT, node_seen, pod_seen
from workers.detectors.slurm import NodeState, SlurmError

K = FailureKind
T0 = datetime(2026, 12, 6, 5, 0, tzinfo=UTC)


def _node(unschedulable: bool = False, taint: bool = False, ready: str = "True") -> k.V1Node:
    taints = [k.V1Taint(key=UNSCHEDULABLE_TAINT, effect="NoSchedule")] if taint else None
    cond = k.V1NodeCondition(
        type="Ready", status=ready, last_transition_time=T0, reason="KubeletNotReady"
    )
    return k.V1Node(
        metadata=k.V1ObjectMeta(name="gpu-7", uid="u7"),
        spec=k.V1NodeSpec(unschedulable=unschedulable, taints=taints),
        status=k.V1NodeStatus(conditions=[cond]),
    )


@pytest.mark.parametrize(
    ("node", "kinds"),
    [
        (_node(), []),
        (_node(unschedulable=True), [K.NODE_CORDON]),
        (_node(taint=True), [K.NODE_CORDON]),  # the taint alone, as some controllers leave it
        (_node(ready="False"), [K.NODE_NOT_READY]),
        (_node(ready="Unknown"), [K.NODE_NOT_READY]),  # the kubelet stopped reporting: a power loss
        (_node(unschedulable=True, ready="Unknown"), [K.NODE_CORDON, K.NODE_NOT_READY]),
    ],
)
def test_a_nodes_state_says_what_the_jobs_hear(node: k.V1Node, kinds: list[FailureKind]) -> None:
    seen = node_seen(node)
    assert [s.kind for s in seen] == kinds
    assert all(s.node == "gpu-7" and s.job is None for s in seen)


def test_the_same_node_state_read_twice_has_one_key_and_a_new_transition_another() -> None:
    """A re-list gives the same keys (nothing starts twice); NotReady again after a recovery is
    new."""
    assert node_seen(_node(ready="False")) == node_seen(_node(ready="False"))
    later = _node(ready="False")
    assert later.status is not None and later.status.conditions
    later.status.conditions[0].last_transition_time = T0.replace(hour=6)
    assert node_seen(later)[0].key != node_seen(_node(ready="False"))[0].key


def _pod(
    deleting: bool = False, phase: str = "Running", reason: str | None = None, **kw: object
) -> k.V1Pod:
    labels = kw.get("labels", {"torchpass.io/job": "job-1"})
    meta = k.V1ObjectMeta(name="job-1-node-2", namespace="ml", uid="p2", labels=labels)
    meta.deletion_timestamp = T0 if deleting else None
    return k.V1Pod(
        metadata=meta,
        spec=k.V1PodSpec(containers=[], node_name=kw.get("node", "gpu-7")),
        status=k.V1PodStatus(phase=phase, reason=reason),
    )


@pytest.mark.parametrize(
    ("event", "pod", "says"),
    [
        ("MODIFIED", _pod(), None),
        ("DELETED", _pod(), "deleted"),
        ("MODIFIED", _pod(deleting=True), "deleted"),  # terminating: its grace period runs
        ("MODIFIED", _pod(phase="Failed", reason="Evicted"), "evicted"),
        ("DELETED", _pod(labels={"app": "other"}), None),  # not a job's pod
        ("DELETED", _pod(node=None), None),  # never scheduled: no node's ranks
    ],
)
def test_a_jobs_pod_gone_is_an_interruption_of_that_job_on_its_node(
    event: str, pod: k.V1Pod, says: str | None
) -> None:
    seen = pod_seen(event, pod, "torchpass.io/job")
    if says is None:
        assert seen is None
        return
    assert seen is not None and (seen.kind, seen.node, seen.job) == (
        K.POD_DELETED,
        "gpu-7",
        "job-1",
    )
    assert says in seen.reason


@pytest.mark.parametrize(
    ("state", "kind"),
    [
        ("idle", None),
        ("mixed", None),
        ("allocated", None),
        ("drained", K.NODE_DRAIN),
        ("draining", K.NODE_DRAIN),
        ("drain", K.NODE_DRAIN),
        ("down", K.NODE_FAILURE),
        ("down*", K.NODE_FAILURE),
        ("idle*", K.NODE_FAILURE),  # not responding
        ("drained*", K.NODE_FAILURE),  # drained, and then it stopped responding: a failure
        ("fail", K.NODE_FAILURE),
        ("failing", K.NODE_FAILURE),
    ],
)
def test_a_slurm_nodes_state_says_what_the_jobs_hear(state: str, kind: FailureKind | None) -> None:
    seen = slurm.node_seen(NodeState("node2", state, "patching", "2026-12-06T05:00:00"))
    assert (seen.kind if seen else None) is kind
    if seen is not None:
        assert seen.node == "node2" and seen.job is None and "2026-12-06T05:00:00" in seen.key


def test_every_slurm_command_is_bounded_and_its_failure_is_typed() -> None:
    """Real processes: a command that hangs is stopped at its timeout, one that fails says why in
    its own words, one that is not installed is the same typed error."""
    with pytest.raises(SlurmError, match="timed out"):
        slurm.slurm([sys.executable, "-c", "import time; time.sleep(5)"], timeout=0.3)
    with pytest.raises(SlurmError, match="exit 3: no such node"):
        slurm.slurm(
            [sys.executable, "-c", "import sys; sys.stderr.write('no such node'); sys.exit(3)"]
        )
    with pytest.raises(SlurmError, match="scontrol-not-here"):
        slurm.slurm(["scontrol-not-here", "show", "node"])
    assert slurm.slurm([sys.executable, "-c", "print('ok')"]) == "ok\n"
