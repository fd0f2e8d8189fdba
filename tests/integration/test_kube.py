"""Kubernetes: the detector on a real multi-node job, and the deploy files, against the stub API
server.

No Kubernetes API server can run on these machines (no kube-apiserver, kind, k3s or envtest binary),
so `tests/kube`'s stub stands for it: the kube-apiserver's REST semantics for Nodes, Pods and what
`kubectl apply` sends, with watches, resourceVersions and 410 Gone. Everything else is real: the
`kubernetes` client inside `workers.detectors.kube.KubeDetector`, `kubectl` (cordon, kustomize,
apply), `torchpass node` agents on three hosts (network namespaces), torch.distributed ranks, the
incidents' MigrationWorkflows on the dev server.
"""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client as k8s
from kubernetes import config
from temporalio.client import Client

from job_agent import wire
from tests.integration.conftest import LONG_ARGS, ROOT, spec, start_job
from tests.integration.test_multinode import coordinator_of, log_of, node_argv, status
from tests.kube.stub_apiserver import Call, StubApiServer
from tests.unit.job_driver import until
from torchpass.dev.hosts import Fabric, fabric
from torchpass.ids import IncidentMessage
from torchpass.job import JobResult, JobSpec
from torchpass.models import (
    Category,
    Disposition,
    EventSource,
    Evidence,
    FailureKind,
    FailureReport,
)
from workers.detectors.kube import REASON_ANNOTATION, KubeDetector, KubeSettings
from workers.detectors.kube_spares import KubeSpares
from workers.detectors.reports import Jobs, Seen, Told

pytestmark = pytest.mark.integration
DEPLOY = ROOT / "deploy" / "kubernetes"


@pytest.fixture
def three_hosts() -> Iterator[Fabric]:
    with fabric(3) as f:
        print(f"kubernetes test hosts: {f.mode}")
        yield f


@pytest.fixture
def api(tmp_path: Path) -> Iterator[tuple[StubApiServer, Path]]:
    with StubApiServer() as server:
        yield server, server.kubeconfig(tmp_path / "kubeconfig")


class Heard(Jobs):
    """The jobs, and every answer they gave the detector (the test reads what the job said)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.told: list[tuple[Seen, Told]] = []

    def tell(self, seen: Seen) -> list[Told]:
        out = super().tell(seen)
        self.told += [(seen, t) for t in out]
        return out


def _detector(kubeconfig: Path, jobs: Jobs) -> tuple[KubeDetector, threading.Thread]:
    api = k8s.CoreV1Api(config.new_client_from_config(config_file=str(kubeconfig)))
    d = KubeDetector(
        api, jobs, KubeSettings(namespace="torchpass", resync_seconds=3, watch_seconds=2)
    )
    t = threading.Thread(target=d.run, daemon=True)
    t.start()
    return d, t


def _node(name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    ready = {"type": "Ready", "status": "True", "lastTransitionTime": "2026-12-06T00:00:00Z"}
    meta = {"name": name, "labels": labels or {}}
    return {"apiVersion": "v1", "kind": "Node", "metadata": meta, "status": {"conditions": [ready]}}


async def _settled(
    job: JobSpec, task: asyncio.Task[JobResult], incidents: int, spares: int
) -> wire.Status:
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        assert not task.done(), (await task).error
        s = await status(job)
        if (s.state, len(s.ranks), s.incidents, s.incident) == (
            "training",
            4,
            incidents,
            None,
        ) and s.spares >= spares:
            return s
        await asyncio.sleep(0.05)
    raise AssertionError(f"the job did not settle after {incidents} incident(s): {s}")


async def test_a_cordon_moves_a_nodes_ranks_live_and_a_power_loss_is_one_incident(
    client: Client,
    tmp_path: Path,
    three_hosts: Fabric,
    api: tuple[StubApiServer, Path],
    long_reference: JobResult,
) -> None:
    """`kubectl cordon` of a training node moves both its ranks to the spare node while they work
    (planned, live); a detector restarted afterwards re-lists the cordoned node and the job acts on
    nothing; then the other training node loses power (its agent and ranks killed at once): the job
    sees it first, and migrates it live. The cluster's NotReady comes only after that incident's
    outcome was recorded (as on a real cluster, some 40 s later): it is still one incident, the late
    evidence signalled into that incident's history (its workflow stays open for the job's late
    window), nothing started again, and the node is left cordoned with the reason. The job ends
    bitwise equal to the same job never interrupted."""
    server, kubeconfig = api
    hosts = three_hosts
    for h in hosts.hosts:
        server.add(_node(h.name))
    # the same math: still training when the late NotReady comes
    args = (*LONG_ARGS, "--pace", "0.02")
    job = spec(tmp_path, "kube-signals", args=args, nodes=2, host=hosts.coordinator)
    task = await start_job(client, job)
    address = await coordinator_of(job)
    train, spare = hosts.hosts[:2], hosts.hosts[2]
    procs = {
        h.name: hosts.start(
            h, node_argv(job, address, h, 2, 1, args=args), str(tmp_path / f"{h.name}.log")
        )
        for h in train
    }
    hosts.start(
        spare, node_argv(job, address, spare, 0, 2, args=args), str(tmp_path / f"{spare.name}.log")
    )
    jobs = Heard(job.state_dir, "kubernetes")
    detector, thread = _detector(kubeconfig, jobs)
    try:
        before = await _settled(job, task, incidents=0, spares=4)
        node_of = {r.slot: r.node for r in before.ranks}
        cordoned, powered = node_of[2], node_of[0]
        subprocess.run(
            ["kubectl", "--kubeconfig", str(kubeconfig), "cordon", cordoned], check=True, timeout=30
        )
        after = await _settled(job, task, incidents=1, spares=2)
        assert {r.node for r in after.ranks if r.slot in (2, 3)} == {spare.name}, after

        detector.close()
        thread.join(10)
        again = Heard(job.state_dir, "kubernetes")
        detector, thread = _detector(kubeconfig, again)
        await until(
            lambda: any(s.node == cordoned for s, _ in again.told),
            "the new detector to re-list the cordoned node",
            timeout=30,
        )
        assert not [t for _, t in again.told if t.acted], again.told
        # the first detector's cordon was acted on
        assert any(t.acted for _, t in jobs.told), jobs.told

        # the power goes: the node agent and its ranks at once; the job sees it
        hosts.stop(procs[powered])
        await _settled(job, task, incidents=2, spares=0)  # and migrates it: the outcome is recorded
        server.set_node_condition(
            powered, "Ready", "Unknown", "NodeStatusUnknown"
        )  # then, late, the kubelet's silence
        await until(
            lambda: any(s.kind is FailureKind.NODE_NOT_READY for s, _ in again.told),
            "the NotReady to reach the job",
            timeout=30,
        )
        result = await asyncio.wait_for(task, 180)
    finally:
        detector.close()
        thread.join(10)

    assert result.ok, (result.error, log_of(tmp_path, spare.name))
    planned, lost = result.incidents
    assert (
        planned.disposition is Disposition.MIGRATED
        and planned.classification.category is Category.PLANNED
    )
    assert (planned.kind, planned.failure_domain, planned.lost_slots) == (
        FailureKind.NODE_CORDON,
        cordoned,
        (2, 3),
    )
    assert lost.disposition is Disposition.MIGRATED and lost.success, lost
    assert (
        lost.classification.category is Category.HOST_GPU_FABRIC and lost.failure_domain == powered
    )
    assert lost.lost_slots == (0, 1), lost
    heard = [t for s, t in again.told if s.kind is FailureKind.NODE_NOT_READY]
    # each resync after it: already heard
    assert heard[0].acted and not any(t.acted for t in heard[1:])
    assert "'late': True" in heard[0].detail and lost.incident_id in heard[0].detail, heard[0]
    # the cluster's word is evidence of that incident
    reports = await _reports(client, lost.incident_id)
    assert any(
        e.kind is FailureKind.NODE_NOT_READY and e.source is EventSource.KUBERNETES for e in reports
    )
    assert any(
        e.kind is FailureKind.NODE_FAILURE and e.source is EventSource.COORDINATOR for e in reports
    )
    # the NotReady came after the outcome: late, in its history
    assert len(reports) > lost.evidence_count
    assert result.steps_recomputed == 0 and result.final_digest == long_reference.final_digest
    node = server.get("nodes", powered)
    assert (
        node["spec"]["unschedulable"]
        and "node_not_ready" in node["metadata"]["annotations"][REASON_ANNOTATION]
    )
    _assert_rbac_covers(server.requests)


async def test_a_spare_node_is_reserved_by_creating_its_agent_pod_there(
    client: Client,
    tmp_path: Path,
    three_hosts: Fabric,
    api: tuple[StubApiServer, Path],
    long_reference: JobResult,
) -> None:
    """Two training nodes, and a job asking for one spare node (`--spare-nodes 1`); the third host
    is a Node labelled torchpass.io/spare-node=true that runs nothing of the job. The detector's
    keeper reserves it by creating the job's spare-node Pod there, from the job's PodTemplate, bound
    to that Node. A stand-in kubelet (the stub runs no kubelet) runs the Pod's command on that host
    and marks it Running; the agent joins with two warm spares. A cordon then moves a training
    node's ranks onto them, live. The spare node busy, the keeper finds no other free labelled Node
    and creates nothing more. The job ends bitwise equal to the reference; every API call is one the
    RBAC allows."""
    server, kubeconfig = api
    hosts = three_hosts
    train, spare = hosts.hosts[:2], hosts.hosts[2]
    server.add({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "torchpass"}})
    for h in train:
        server.add(_node(h.name))
    server.add(_node(spare.name, {"torchpass.io/spare-node": "true"}))
    # Paced (the same math as LONG_ARGS alone): the spare node is asked for once the job trains, and
    # its spares start cold, so the job must still train when they are warm.
    args = (*LONG_ARGS, "--pace", "0.04")
    job = spec(tmp_path, "kube-spares", args=args, nodes=2, host=hosts.coordinator, spare_nodes=1)
    task = await start_job(client, job)
    address = await coordinator_of(job)
    for h in train:
        hosts.start(h, node_argv(job, address, h, 2, 1, args=args), str(tmp_path / f"{h.name}.log"))
    labels = {"torchpass.io/job": job.job_id, "app.kubernetes.io/name": "torchpass-spare-node"}
    command = node_argv(job, address, spare, 0, 2, args=args)  # the image's command, on that host
    container = {"name": "node", "image": "torchpass", "command": command}
    pod_spec = {"restartPolicy": "Never", "containers": [container]}
    server.add(
        {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {
                "name": "kube-spares-spare-node",
                "namespace": "torchpass",
                "labels": labels,
            },
            "template": {
                "metadata": {"labels": {"app.kubernetes.io/name": "torchpass-spare-node"}},
                "spec": pod_spec,
            },
        }
    )
    kubelet = _Kubelet(server, hosts, spare, tmp_path)
    api_client = k8s.CoreV1Api(config.new_client_from_config(config_file=str(kubeconfig)))
    settings = KubeSettings(
        namespace="torchpass", resync_seconds=3, watch_seconds=2, spare_seconds=0.5
    )
    keeper = KubeSpares(api_client, job.state_dir, settings, "torchpass.io/spare-node=true")
    passes: list[list[str]] = []  # what each pass of the keeper created

    def keep() -> list[str]:
        created = keeper.keep()
        passes.append(created)
        return created

    detector = KubeDetector(api_client, Jobs(job.state_dir, "kubernetes"), settings, keep)
    thread = threading.Thread(target=detector.run, daemon=True)
    thread.start()
    try:
        before = await _settled(job, task, incidents=0, spares=4)
        assert spare.name in before.nodes and spare.name in before.idle_nodes, before
        (pod,) = server.objects("pods", "torchpass")
        assert pod["spec"]["nodeName"] == spare.name and pod["metadata"]["labels"] == labels, pod
        cordoned = next(r.node for r in before.ranks if r.slot == 2)
        subprocess.run(
            ["kubectl", "--kubeconfig", str(kubeconfig), "cordon", cordoned], check=True, timeout=30
        )
        after = await _settled(job, task, incidents=1, spares=2)
        assert {r.node for r in after.ranks if r.slot in (2, 3)} == {spare.name}, after
        # the spare node took ranks, the cordoned one is no spare
        assert not after.idle_nodes, after
        seen = len(passes) + 1  # from the pass after the one that may be under way
        await until(
            lambda: len(passes) >= seen + 4, "four more passes of the spare keeper", timeout=30
        )
        assert not any(passes[seen:]), passes  # no free labelled Node: nothing created
        assert len(server.objects("pods", "torchpass")) == 1
        result = await asyncio.wait_for(task, 180)
    finally:
        detector.close()
        thread.join(10)
        kubelet.stop()
    assert result.ok, (result.error, log_of(tmp_path, "kubelet"))
    (planned,) = result.incidents
    assert (
        planned.disposition is Disposition.MIGRATED and planned.kind is FailureKind.NODE_CORDON
    ), planned
    assert result.steps_recomputed == 0 and result.final_digest == long_reference.final_digest
    _assert_rbac_covers(server.requests)


class _Kubelet:
    """Stands for the kubelet of `host` (the stub runs none): a Pod bound there is started by
    running its container's command on that host, and its status set to Running. Nothing else."""

    def __init__(self, server: StubApiServer, hosts: Fabric, host: Any, tmp_path: Path) -> None:
        self.server, self.hosts, self.host, self.log = server, hosts, host, tmp_path / "kubelet.log"
        self.started: set[str] = set()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.wait(0.1):
            for pod in self.server.objects("pods", "torchpass"):
                name = pod["metadata"]["name"]
                if pod["spec"].get("nodeName") != self.host.name or name in self.started:
                    continue
                self.started.add(name)
                self.hosts.start(self.host, pod["spec"]["containers"][0]["command"], str(self.log))
                self.server.add(
                    {**pod, "status": {"phase": "Running", "hostIP": self.host.address}}
                )

    def stop(self) -> None:
        self.done.set()
        self.thread.join(5)


async def _reports(client: Client, incident_id: str) -> list[Evidence]:
    """Every report the incident's workflow received: its start's and its signals'."""
    history = await client.get_workflow_handle(
        incident_id.split("/", maxsplit=1)[0]
    ).fetch_history()
    out = []
    for e in history.events:
        if e.HasField("workflow_execution_started_event_attributes"):
            payloads = e.workflow_execution_started_event_attributes.input.payloads
        elif e.workflow_execution_signaled_event_attributes.signal_name == IncidentMessage.REPORT:
            payloads = e.workflow_execution_signaled_event_attributes.input.payloads
        else:
            continue
        out.append(FailureReport.model_validate_json(payloads[0].data).evidence)
    return out


def _rendered(path: Path) -> list[dict[str, Any]]:
    out = subprocess.run(
        ["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=60, check=True
    )
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _allowed(docs: list[dict[str, Any]], account: str, call: Call) -> bool:
    """Whether the rendered RBAC lets `account` (in namespace torchpass) make `call`."""
    roles = {
        (d["kind"], d["metadata"]["name"]): d for d in docs if d["kind"] in ("Role", "ClusterRole")
    }
    for b in (d for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        if not any(s["kind"] == "ServiceAccount" and s["name"] == account for s in b["subjects"]):
            continue
        role = roles.get((b["roleRef"]["kind"], b["roleRef"]["name"]))
        if role is None or (
            b["kind"] == "RoleBinding" and call.namespace != b["metadata"]["namespace"]
        ):
            continue
        wanted = f"{call.resource}/{call.subresource}" if call.subresource else call.resource
        for rule in role["rules"]:
            if (
                call.group in rule["apiGroups"]
                and wanted in rule["resources"]
                and call.verb in rule["verbs"]
            ):
                return True
    return False


def _assert_rbac_covers(calls: list[Call]) -> None:
    """Every API call the detector made (and kubectl's cordon, the same verbs) is one the deploy
    files' RBAC allows the detector's service account; and the check itself fails on a call they do
    not allow."""
    docs = _rendered(DEPLOY)
    assert calls and {c.resource for c in calls} <= {"nodes", "pods", "podtemplates"}
    missing = sorted({c for c in calls if not _allowed(docs, "torchpass-detector", c)}, key=str)
    assert not missing, f"deploy/kubernetes/rbac.yaml does not allow: {missing}"
    assert not _allowed(docs, "torchpass-detector", Call("delete", "", "pods", "", "torchpass"))
    assert not _allowed(docs, "torchpass-control", Call("list", "", "nodes", "", ""))


def test_the_deploy_files_render_and_apply_to_the_api_server(
    api: tuple[StubApiServer, Path],
) -> None:
    """`kubectl kustomize` renders both kustomizations and `kubectl apply` creates every object (a
    second apply changes nothing): the cluster-wide part, then a job's coordinator and node
    agents."""
    server, kubeconfig = api
    for path in (DEPLOY, DEPLOY / "job"):
        rendered = subprocess.run(
            ["kubectl", "kustomize", str(path)],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        for _ in range(2):
            apply = [
                "kubectl",
                "--kubeconfig",
                str(kubeconfig),
                "apply",
                "--validate=false",
                "-f",
                "-",
            ]
            done = subprocess.run(
                apply, check=False, input=rendered, capture_output=True, text=True, timeout=60
            )
            assert done.returncode == 0, done.stderr
    names = {
        o["metadata"]["name"]
        for r in ("deployments", "daemonsets", "podtemplates")
        for o in server.objects(r, "torchpass")
    }
    assert names >= {
        "torchpass-control",
        "torchpass-detector",
        "example-torchpass-coordinator",
        "example-torchpass-node",
        "example-torchpass-spare-node",
    }
    node_agents = server.get("daemonsets", "example-torchpass-node", "torchpass")
    assert node_agents["spec"]["template"]["metadata"]["labels"]["torchpass.io/job"] == "example"
    assert server.get("clusterroles", "torchpass-detector-nodes")["rules"][0]["verbs"] == [
        "get",
        "list",
        "watch",
        "patch",
    ]
    assert server.get("secrets", "torchpass-secrets", "torchpass")["type"] == "Opaque"
