"""The Kubernetes spare-node keeper (`workers.detectors.kube_spares`): the real `kubernetes` client
against the stub API server (`tests/kube`: no API server can run on these machines), the jobs'
wishes and status given directly. Which Node it reserves, what Pod it creates there, what it
refuses, its bound. It runs end to end on real node agents in `tests/integration/test_kube.py`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config

from job_agent import wire
from tests.kube.stub_apiserver import StubApiServer
from workers.detectors import kube_spares
from workers.detectors.kube import KubeSettings
from workers.detectors.kube_spares import APP_LABEL, SPARE_APP, KubeSpares
from workers.detectors.spare_nodes import RETRY_STARTS, Wanted

pytestmark = pytest.mark.timeout(60)
NS, LABEL = "torchpass", "torchpass.io/spare-node=true"


def _node(
    name: str, spare: bool = True, ready: str = "True", cordoned: bool = False
) -> dict[str, Any]:
    labels = {"torchpass.io/spare-node": "true"} if spare else {}
    cond = {"type": "Ready", "status": ready}
    meta = {"name": name, "labels": labels}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": meta,
        "spec": {"unschedulable": cordoned},
        "status": {"conditions": [cond]},
    }


def _template(job: str) -> dict[str, Any]:
    labels = {"torchpass.io/job": job, APP_LABEL: SPARE_APP}
    spec = {
        "restartPolicy": "Never",
        "containers": [{"name": "node", "image": "torchpass", "command": ["true"]}],
    }
    meta = {"name": f"{job}-spare", "namespace": NS, "labels": labels}
    template = {"metadata": {"labels": {APP_LABEL: SPARE_APP}}, "spec": spec}
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": meta, "template": template}


def _wanted(job: str, nodes: tuple[str, ...] = ("t1", "t2"), idle: tuple[str, ...] = ()) -> Wanted:
    status = wire.Status(
        job_id=job,
        state="training",
        generation=0,
        world_size=4,
        ranks=(),
        spares=2,
        nodes=nodes,
        idle_nodes=idle,
    )
    return Wanted(job, 1, 8, "/app/train.py", (), status)


@pytest.fixture
def server() -> Iterator[StubApiServer]:
    with StubApiServer() as stub:
        stub.add({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
        yield stub


def _keeper(server: StubApiServer, tmp_path: Path) -> KubeSpares:
    api = client.CoreV1Api(
        config.new_client_from_config(config_file=str(server.kubeconfig(tmp_path / "kc")))
    )
    return KubeSpares(api, tmp_path, KubeSettings(namespace=NS), LABEL)


def _asking(monkeypatch: pytest.MonkeyPatch, *jobs: Wanted) -> None:
    monkeypatch.setattr(
        kube_spares, "wanted", lambda state_dir, timeout: (list(jobs), {j.job_id for j in jobs})
    )


def test_the_free_labelled_ready_node_is_reserved_by_creating_the_agent_there(
    server: StubApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Of five Nodes only s4 will do: t1 is unlabelled, s1 cordoned, s2 NotReady, s3 runs another
    job's spare-node Pod. The Pod is the job's template, bound to s4, labelled with the job."""
    for n in (
        _node("t1", spare=False),
        _node("s1", cordoned=True),
        _node("s2", ready="Unknown"),
        _node("s3"),
        _node("s4"),
    ):
        server.add(n)
    server.add(_template("job-a"))
    other = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "b-spare-x",
            "namespace": NS,
            "labels": {"torchpass.io/job": "job-b", APP_LABEL: SPARE_APP},
        },
        "spec": {"nodeName": "s3", "containers": []},
        "status": {"phase": "Running"},
    }
    server.add(other)
    _asking(monkeypatch, _wanted("job-a"))
    (name,) = _keeper(server, tmp_path).keep()
    pod = server.get("pods", name, NS)
    assert pod["spec"]["nodeName"] == "s4" and name.startswith("job-a-spare-")
    assert pod["metadata"]["labels"] == {"torchpass.io/job": "job-a", APP_LABEL: SPARE_APP}
    assert pod["spec"]["restartPolicy"] == "Never"
    template = server.get("podtemplates", "job-a-spare", NS)
    # deleted with the job's objects, by the collector
    (owner,) = pod["metadata"]["ownerReferences"]
    assert owner == {
        "apiVersion": "v1",
        "kind": "PodTemplate",
        "name": "job-a-spare",
        "uid": template["metadata"]["uid"],
    }


def test_nothing_is_created_while_one_waits_or_a_spare_node_is_idle(
    server: StubApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for n in (_node("s1"), _node("s2")):
        server.add(n)
    server.add(_template("job-a"))
    keeper = _keeper(server, tmp_path)
    _asking(monkeypatch, _wanted("job-a"))
    assert len(keeper.keep()) == 1
    assert keeper.keep() == []  # its Pod is pending: on its way
    _asking(monkeypatch, _wanted("job-a", nodes=("t1", "s9"), idle=("s9",)))
    assert keeper.keep() == []  # an idle spare node of its own


def test_no_template_or_no_free_node_creates_nothing(
    server: StubApiServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    server.add(_node("s1"))
    _asking(monkeypatch, _wanted("job-a"))
    keeper = _keeper(server, tmp_path)
    assert keeper.keep() == [] and "no PodTemplate" in caplog.text
    server.add(_template("job-a"))
    server.add(_node("s1", cordoned=True))
    assert keeper.keep() == [] and "no free spare node" in caplog.text
    assert server.objects("pods", NS) == []


def test_pods_that_end_at_once_are_created_again_only_within_the_bound(
    server: StubApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server.add(_node("s1"))
    server.add(_template("job-a"))
    _asking(monkeypatch, _wanted("job-a"))
    keeper = _keeper(server, tmp_path)
    created = []
    for _ in range(8):
        created += keeper.keep()
        for pod in server.objects("pods", NS):  # its agent could not start: the Pod failed
            server.add({**pod, "status": {"phase": "Failed"}})
    assert len(created) == 1 + RETRY_STARTS
