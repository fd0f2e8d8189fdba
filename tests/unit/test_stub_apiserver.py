"""The stub Kubernetes API server (tests/kube/stub_apiserver.py) answers the real ``kubernetes``
client and the real ``kubectl`` as a kube-apiserver would, for the calls torchpass's detectors and
deploy files make."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

from tests.kube.stub_apiserver import UNSCHEDULABLE_TAINT, Call, StubApiServer

pytestmark = pytest.mark.timeout(60)

Kubectl = Callable[..., subprocess.CompletedProcess[str]]


def node(name: str, **labels: str) -> dict[str, Any]:
    ready = {"type": "Ready", "status": "True"}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels},
        "spec": {},
        "status": {"conditions": [ready]},
    }


def pod(
    name: str, node_name: str, namespace: str = "default", owner: tuple[str, str] | None = None
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace}
    if owner:
        ref = {
            "apiVersion": "apps/v1",
            "kind": owner[0],
            "name": owner[1],
            "uid": f"uid-{owner[1]}",
        }
        meta["ownerReferences"] = [{**ref, "controller": True}]
    spec = {"nodeName": node_name, "containers": [{"name": "main", "image": "busybox"}]}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": spec,
        "status": {"phase": "Running"},
    }


def reason(error: pytest.ExceptionInfo[ApiException]) -> str:
    """The reason of the Status the server answered with."""
    return str(json.loads(error.value.body or "{}")["reason"])


@pytest.fixture
def server() -> Iterator[StubApiServer]:
    with StubApiServer() as stub:
        yield stub


@pytest.fixture
def v1(server: StubApiServer, tmp_path: Path) -> Iterator[Any]:
    """The real client (a CoreV1Api, typed Any here: its models make every field Optional),
    configured by ``load_kube_config`` from the stub's kubeconfig."""
    configuration = client.Configuration()
    config.load_kube_config(
        config_file=str(server.kubeconfig(tmp_path / "kubeconfig")),
        client_configuration=configuration,
    )
    with client.ApiClient(configuration) as api:
        yield client.CoreV1Api(api)


@pytest.fixture
def kubectl(server: StubApiServer, tmp_path: Path) -> Kubectl:
    """The real kubectl against the stub, its discovery cache in tmp_path."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed")
    kubeconfig = server.kubeconfig(tmp_path / "kubeconfig")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [
            "kubectl",
            "--kubeconfig",
            str(kubeconfig),
            "--cache-dir",
            str(tmp_path / "cache"),
            *args,
        ]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
        assert result.returncode == 0, f"kubectl {' '.join(args)}: {result.stdout}\n{result.stderr}"
        return result

    return run


def test_client_lists_gets_and_patches_nodes(server: StubApiServer, v1: Any) -> None:
    """The real client lists nodes by label selector, reads one, patches its labels and status
    (status only through /status, as on a cluster), and a patch that changes nothing keeps the
    resourceVersion."""
    server.add(node("gpu-1", pool="gpu", zone="a"))
    server.add(node("gpu-2", pool="gpu", zone="b"))
    server.add(node("cpu-1", pool="cpu"))

    def names(sel: str) -> list[str]:
        return [n.metadata.name for n in v1.list_node(label_selector=sel).items]

    assert names("pool=gpu") == ["gpu-1", "gpu-2"]
    assert names("pool=gpu,zone!=a") == ["gpu-2"]
    assert names("zone in (a,b)") == ["gpu-1", "gpu-2"]
    assert names("zone notin (a),pool") == ["cpu-1", "gpu-2"]
    assert names("!zone") == ["cpu-1"]

    listed = v1.list_node()
    assert int(listed.metadata.resource_version) >= int(listed.items[0].metadata.resource_version)
    before = v1.read_node("gpu-1")
    assert before.status.conditions[0].type == "Ready"
    after = v1.patch_node(
        "gpu-1", {"metadata": {"labels": {"torchpass/suspect": "true", "zone": None}}}
    )
    assert after.metadata.labels == {"pool": "gpu", "torchpass/suspect": "true"}
    assert int(after.metadata.resource_version) > int(before.metadata.resource_version)
    assert v1.patch_node(
        "gpu-1", {"metadata": {"labels": {"pool": "gpu"}}}
    ).metadata.resource_version == (after.metadata.resource_version)

    down = {"status": {"conditions": [{"type": "Ready", "status": "False"}]}}
    # ignored, as on a cluster
    assert v1.patch_node("gpu-1", down).status.conditions[0].status == "True"
    assert v1.patch_node_status("gpu-1", down).status.conditions[0].status == "False"
    with pytest.raises(ApiException) as missing:
        v1.read_node("nope")
    assert missing.value.status == 404
    assert reason(missing) == "NotFound"


def test_client_field_selectors_and_patch_kinds(server: StubApiServer, v1: Any) -> None:
    """The real client: field selectors on the fields a cluster supports (others are a 400), JSON
    patch (RFC 6902) and merge patch, and a replace with a stale resourceVersion is a 409
    Conflict."""
    server.add(node("n1"))
    server.add(pod("a", "n1"))
    server.add({**pod("b", "n2", namespace="kube-system"), "status": {"phase": "Succeeded"}})
    names = lambda pods: [p.metadata.name for p in pods.items]  # noqa: E731
    assert names(v1.list_pod_for_all_namespaces(field_selector="spec.nodeName=n1")) == ["a"]
    assert names(v1.list_pod_for_all_namespaces(field_selector="status.phase!=Succeeded")) == ["a"]
    assert names(v1.list_namespaced_pod("kube-system", field_selector="metadata.name=b")) == ["b"]
    assert names(v1.list_pod_for_all_namespaces(field_selector="metadata.namespace=default")) == [
        "a"
    ]
    with pytest.raises(ApiException) as unsupported:
        v1.list_pod_for_all_namespaces(field_selector="spec.priority=1")
    assert unsupported.value.status == 400

    ops = [
        {
            "op": "add",
            "path": "/spec/taints",
            "value": [{"key": "gpu-xid", "effect": "NoSchedule"}],
        },
        {"op": "add", "path": "/metadata/labels", "value": {"a/b": "1"}},
        {"op": "replace", "path": "/metadata/labels/a~1b", "value": "2"},
    ]
    patched = v1.patch_node("n1", ops)
    assert patched.spec.taints[0].key == "gpu-xid" and patched.metadata.labels == {"a/b": "2"}
    with pytest.raises(ApiException) as failed:
        v1.patch_node("n1", [{"op": "test", "path": "/metadata/labels/a~1b", "value": "1"}])
    assert failed.value.status == 422
    merged = v1.patch_node(
        "n1", {"metadata": {"labels": None}}, _content_type="application/merge-patch+json"
    )
    assert merged.metadata.labels is None

    stale = v1.read_node("n1")
    v1.patch_node("n1", {"metadata": {"labels": {"x": "1"}}})
    with pytest.raises(ApiException) as conflict:
        v1.replace_node("n1", stale)
    assert conflict.value.status == 409
    assert reason(conflict) == "Conflict"


def test_client_creates_evicts_and_deletes_pods(server: StubApiServer, v1: Any) -> None:
    """The real client creates pods (409 AlreadyExists on a taken name; generateName; 404 in a
    namespace that does not exist), evicts one through policy/v1 Eviction and deletes another: both
    are gone."""
    body = {
        "metadata": {"name": "w0"},
        "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "x"}]},
    }
    created = v1.create_namespaced_pod("default", body)
    assert created.status.phase == "Pending" and created.metadata.uid
    with pytest.raises(ApiException) as taken:
        v1.create_namespaced_pod("default", body)
    assert taken.value.status == 409
    assert reason(taken) == "AlreadyExists"
    generated = v1.create_namespaced_pod(
        "default", {"metadata": {"generateName": "w-"}, "spec": body["spec"]}
    )
    assert generated.metadata.name.startswith("w-") and len(generated.metadata.name) == 7
    with pytest.raises(ApiException) as no_namespace:
        v1.create_namespaced_pod("nowhere", body)
    assert no_namespace.value.status == 404

    eviction = {
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": "w0", "namespace": "default"},
    }
    v1.create_namespaced_pod_eviction("w0", "default", eviction)
    assert (
        v1.delete_namespaced_pod(generated.metadata.name, "default").metadata.name
        == generated.metadata.name
    )
    assert server.objects("pods") == []
    with pytest.raises(ApiException) as gone:
        v1.delete_namespaced_pod("w0", "default")
    assert gone.value.status == 404


def test_watch_sees_added_modified_deleted(server: StubApiServer, v1: Any) -> None:
    """``Watch().stream(v1.list_node, resource_version=rv)`` of the real client replays what came
    after rv and then sees changes live: ADDED, MODIFIED (a Ready condition flipped, a cordon),
    DELETED."""
    rv = v1.list_node().metadata.resource_version
    server.add(node("n1"))  # before the watch: replayed from rv
    seen = []
    w = watch.Watch()
    for event in w.stream(v1.list_node, resource_version=rv, timeout_seconds=10):
        obj = event["object"]
        ready = obj.status.conditions[0].status if obj.status and obj.status.conditions else None
        seen.append((event["type"], obj.metadata.name, ready, obj.spec.unschedulable))
        if len(seen) == 1:
            server.set_node_condition("n1", "Ready", "False")
        elif len(seen) == 2:
            v1.patch_node("n1", {"spec": {"unschedulable": True}})
        elif len(seen) == 3:
            server.remove("nodes", "n1")
        else:
            w.stop()
    assert seen == [
        ("ADDED", "n1", "True", None),
        ("MODIFIED", "n1", "False", None),
        ("MODIFIED", "n1", "False", True),
        ("DELETED", "n1", "False", True),
    ]


def test_watch_with_a_selector_sees_objects_enter_and_leave_it(
    server: StubApiServer, v1: Any
) -> None:
    """A watch with a label selector, as on a cluster: a node relabelled out of the selector is
    DELETED to the watcher, back into it ADDED; without a resourceVersion the watch starts with the
    current objects."""
    server.add(node("n1", pool="gpu"))
    server.add(node("n2", pool="cpu"))
    seen = []
    w = watch.Watch()
    for event in w.stream(v1.list_node, label_selector="pool=gpu", timeout_seconds=10):
        seen.append((event["type"], event["object"].metadata.name))
        if len(seen) == 1:
            v1.patch_node("n2", {"metadata": {"labels": {"pool": "gpu"}}})
        elif len(seen) == 2:
            v1.patch_node("n1", {"metadata": {"labels": {"pool": "cpu"}}})
        else:
            w.stop()
    assert seen == [("ADDED", "n1"), ("ADDED", "n2"), ("DELETED", "n1")]


def test_watch_from_a_compacted_resource_version_is_410(server: StubApiServer, v1: Any) -> None:
    """After ``compact()`` a watch from an older resourceVersion gets the real server's ERROR event
    (Status 410 Expired): with ``timeout_seconds`` the real client raises ApiException 410; a
    re-list gives a resourceVersion to watch from again."""
    old = v1.list_node().metadata.resource_version
    server.add(node("n1"))
    server.compact()
    with pytest.raises(ApiException) as expired:
        for _ in watch.Watch().stream(v1.list_node, resource_version=old, timeout_seconds=10):
            pass
    assert expired.value.status == 410
    assert "Expired" in str(expired.value.reason)

    relisted = v1.list_node()
    server.add(node("n2"))
    w = watch.Watch()
    for event in w.stream(
        v1.list_node, resource_version=relisted.metadata.resource_version, timeout_seconds=10
    ):
        assert (event["type"], event["object"].metadata.name) == ("ADDED", "n2")
        w.stop()


def test_bookmarks_and_a_closed_watch_resumes(server: StubApiServer, v1: Any) -> None:
    """The real client's watch allowing bookmarks gets BOOKMARK events (kind, apiVersion,
    resourceVersion only); when the server ends the stream (``close_watches``) the client, given no
    timeout_seconds, watches again from the last resourceVersion it saw and misses nothing; a watch
    ends at its timeoutSeconds."""
    rv = v1.list_node().metadata.resource_version
    server.add(node("n1"))
    seen: list[tuple[str, str]] = []
    w = watch.Watch()
    for event in w.stream(
        v1.list_node, resource_version=rv, allow_watch_bookmarks=True, _request_timeout=20
    ):
        raw = event["raw_object"]
        seen.append(
            (event["type"], raw["metadata"].get("name", raw["metadata"]["resourceVersion"]))
        )
        if event["type"] == "ADDED" and raw["metadata"]["name"] == "n1":
            server.send_bookmarks()
        elif event["type"] == "BOOKMARK":
            assert set(raw) == {"kind", "apiVersion", "metadata"} and raw["kind"] == "Node"
            server.close_watches()
            server.add(node("n2"))
        else:
            w.stop()
    assert seen == [
        ("ADDED", "n1"),
        ("BOOKMARK", server.get("nodes", "n1")["metadata"]["resourceVersion"]),
        ("ADDED", "n2"),
    ]
    assert [c.verb for c in server.requests].count("watch") == 2

    assert (
        list(
            watch.Watch().stream(
                v1.list_node, resource_version=server.resource_version, timeout_seconds=1
            )
        )
        == []
    )


def test_request_log_records_rbac_verbs(server: StubApiServer, v1: Any, tmp_path: Path) -> None:
    """Every resource call the real client makes is logged as the RBAC verb, group, resource,
    subresource and namespace a Role must allow; discovery is not logged."""
    server.add(node("n1"))
    server.add(pod("p1", "n1"))
    server.add(pod("p2", "n1"))
    server.requests.clear()
    v1.list_node()
    v1.read_node("n1")
    v1.patch_node("n1", {"spec": {"unschedulable": True}})
    v1.patch_node_status("n1", {"status": {"conditions": []}})
    v1.replace_node("n1", v1.read_node("n1"))
    list(
        watch.Watch().stream(
            v1.list_pod_for_all_namespaces,
            resource_version=server.resource_version,
            timeout_seconds=1,
        )
    )
    v1.create_namespaced_pod_eviction("p1", "default", {"metadata": {"name": "p1"}})
    v1.delete_namespaced_pod("p2", "default")
    v1.create_namespace({"metadata": {"name": "tp"}})
    v1.delete_collection_namespaced_config_map("tp")
    apps = client.AppsV1Api(v1.api_client)
    apps.list_namespaced_daemon_set("tp")
    assert server.requests == [
        Call("list", "", "nodes", "", ""),
        Call("get", "", "nodes", "", ""),
        Call("patch", "", "nodes", "", ""),
        Call("patch", "", "nodes", "status", ""),
        Call("get", "", "nodes", "", ""),
        Call("update", "", "nodes", "", ""),
        Call("watch", "", "pods", "", ""),
        Call("create", "", "pods", "eviction", "default"),
        Call("delete", "", "pods", "", "default"),
        Call("create", "", "namespaces", "", ""),
        Call("deletecollection", "", "configmaps", "", "tp"),
        Call("list", "apps", "daemonsets", "", "tp"),
    ]


def test_kubectl_cordon_uncordon_and_get_nodes(server: StubApiServer, kubectl: Kubectl) -> None:
    """Real ``kubectl cordon`` sets spec.unschedulable and (as a cluster's node controller does) the
    unschedulable NoSchedule taint; ``kubectl uncordon`` takes both away; ``kubectl get nodes -o
    json``."""
    server.add(node("n1"))
    kubectl("cordon", "n1")
    spec = server.get("nodes", "n1")["spec"]
    assert spec["unschedulable"] is True
    assert spec["taints"] == [{"key": UNSCHEDULABLE_TAINT, "effect": "NoSchedule"}]
    listed = json.loads(kubectl("get", "nodes", "-o", "json").stdout)
    assert [(n["metadata"]["name"], n["spec"]["unschedulable"]) for n in listed["items"]] == [
        ("n1", True)
    ]
    kubectl("uncordon", "n1")
    assert server.get("nodes", "n1")["spec"] == {}
    assert [c.verb for c in server.requests if c.resource == "nodes"] == [
        "get",
        "patch",
        "list",
        "get",
        "patch",
    ]


def test_kubectl_delete_pod(server: StubApiServer, kubectl: Kubectl) -> None:
    """Real ``kubectl delete pod -n NS P`` deletes the pod (and its wait for the deletion
    returns)."""
    server.add(pod("p1", "n1", namespace="kube-system"))
    assert "deleted" in kubectl("delete", "pod", "-n", "kube-system", "p1").stdout
    assert server.objects("pods") == []
    assert Call("delete", "", "pods", "", "kube-system") in server.requests


def test_kubectl_drain_evicts_the_nodes_pods(server: StubApiServer, kubectl: Kubectl) -> None:
    """Real ``kubectl drain --ignore-daemonsets --force --delete-emptydir-data`` cordons the node,
    lists its pods by field selector, checks the DaemonSet of a DaemonSet pod, evicts the others
    (found in discovery as pods/eviction) and waits for them to go; pods of the DaemonSet and of
    other nodes stay."""
    server.add(node("n1"))
    server.add(node("n2"))
    server.add(
        {
            "apiVersion": "apps/v1",
            "kind": "DaemonSet",
            "metadata": {"name": "det", "namespace": "kube-system"},
        }
    )
    server.add(pod("det-1", "n1", namespace="kube-system", owner=("DaemonSet", "det")))
    scratch = pod("web-1", "n1", owner=("ReplicaSet", "web-5d9"))
    scratch["spec"]["volumes"] = [{"name": "scratch", "emptyDir": {}}]
    server.add(scratch)
    server.add(pod("bare", "n1"))
    server.add(pod("other", "n2"))
    kubectl(
        "drain", "n1", "--ignore-daemonsets", "--force", "--delete-emptydir-data", "--timeout=20s"
    )
    assert [(p["metadata"]["name"], p["spec"]["nodeName"]) for p in server.objects("pods")] == [
        ("other", "n2"),
        ("det-1", "n1"),
    ]
    assert server.get("nodes", "n1")["spec"]["unschedulable"] is True
    evictions = [c for c in server.requests if c.subresource == "eviction"]
    assert evictions == [Call("create", "", "pods", "eviction", "default")] * 2
    assert Call("list", "", "pods", "", "") in server.requests
    assert Call("get", "apps", "daemonsets", "", "kube-system") in server.requests


MANIFEST = """
apiVersion: v1
kind: Namespace
metadata: {name: torchpass}
---
apiVersion: v1
kind: ServiceAccount
metadata: {name: detector, namespace: torchpass}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: torchpass-detector}
rules:
- {apiGroups: [""], resources: [nodes, pods], verbs: [get, list, watch]}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: torchpass-detector}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: torchpass-detector}
subjects:
- {kind: ServiceAccount, name: detector, namespace: torchpass}
---
apiVersion: v1
kind: ConfigMap
metadata: {name: settings, namespace: torchpass}
data: {interval: "5"}
---
apiVersion: v1
kind: Secret
metadata: {name: token, namespace: torchpass}
stringData: {token: abc}
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: control, namespace: torchpass}
spec:
  replicas: 1
  selector: {matchLabels: {app: control}}
  template:
    metadata: {labels: {app: control}}
    spec:
      containers:
      - {name: control, image: "torchpass:1", ports: [{containerPort: 8080}]}
---
apiVersion: apps/v1
kind: DaemonSet
metadata: {name: detector, namespace: torchpass}
spec:
  selector: {matchLabels: {app: detector}}
  template:
    metadata: {labels: {app: detector}}
    spec:
      serviceAccountName: detector
      containers:
      - {name: detector, image: "torchpass:1"}
"""


def test_kubectl_apply_creates_then_patches(
    server: StubApiServer, kubectl: Kubectl, tmp_path: Path
) -> None:
    """Real ``kubectl apply --validate=false -f`` (the stub serves no OpenAPI) of a multi-document
    manifest creates every object (get, then create); applying it again succeeds, and a changed
    manifest is patched (strategic merge: the changed container keeps its ports)."""
    manifest = tmp_path / "deploy.yaml"
    manifest.write_text(MANIFEST)
    created = kubectl("apply", "--validate=false", "-f", str(manifest)).stdout
    assert created.count(" created") == 8
    assert server.get("namespaces", "torchpass")["status"] == {"phase": "Active"}
    assert server.get("serviceaccounts", "detector", "torchpass")["metadata"]["uid"]
    assert server.get("clusterroles", "torchpass-detector")["rules"][0]["verbs"] == [
        "get",
        "list",
        "watch",
    ]
    assert (
        server.get("clusterrolebindings", "torchpass-detector")["subjects"][0]["name"] == "detector"
    )
    assert server.get("configmaps", "settings", "torchpass")["data"] == {"interval": "5"}
    # stringData, as stored
    assert server.get("secrets", "token", "torchpass")["data"] == {"token": "YWJj"}
    assert server.get("deployments", "control", "torchpass")["spec"]["replicas"] == 1
    assert server.get("daemonsets", "detector", "torchpass")["spec"]["template"]["spec"][
        "serviceAccountName"
    ]
    assert Call("create", "apps", "daemonsets", "", "torchpass") in server.requests

    kubectl("apply", "--validate=false", "-f", str(manifest))
    manifest.write_text(
        MANIFEST.replace('interval: "5"', 'interval: "10"').replace("torchpass:1", "torchpass:2")
    )
    server.requests.clear()
    applied = kubectl("apply", "--validate=false", "-f", str(manifest)).stdout
    assert "configmap/settings configured" in applied and "namespace/torchpass unchanged" in applied
    assert server.get("configmaps", "settings", "torchpass")["data"] == {"interval": "10"}
    container = server.get("deployments", "control", "torchpass")["spec"]["template"]["spec"][
        "containers"
    ][0]
    assert container == {
        "name": "control",
        "image": "torchpass:2",
        "ports": [{"containerPort": 8080}],
    }
    assert Call("patch", "", "configmaps", "", "torchpass") in server.requests
    assert not [c for c in server.requests if c.verb == "create"]
