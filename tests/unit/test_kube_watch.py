"""The Kubernetes detector's Pods watch (`workers.kube.KubeDetector`), end to end on the real `kubernetes`
client against the stub API server (`tests/kube`: no API server can run on these machines): a job's Pod
deleted after the watch began is heard by the jobs as that job's interruption on the Pod's node. The watch
once received every Pod as a plain dict (the client reads what it streams from the lister's docstring) and
its thread died on the first one, so a Pod deleted after the first listing was never heard."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config

from tests.kube.stub_apiserver import StubApiServer
from torchpass.models import FailureKind
from workers.detect import Seen, Told
from workers.kube import KubeDetector, KubeSettings

pytestmark = pytest.mark.timeout(60)
NS = "torchpass"


class Recorder:
    """The jobs, as the detector reaches them: what it told them."""

    def __init__(self) -> None:
        self.seen: list[Seen] = []

    def tell(self, seen: Seen) -> list[Told]:
        self.seen.append(seen)
        return []


def _pod(name: str, job: str, node: str) -> dict[str, Any]:
    meta = {"name": name, "namespace": NS, "labels": {"torchpass.io/job": job}}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"nodeName": node, "containers": []}, "status": {"phase": "Running"}}  # fmt: skip


@pytest.fixture
def server() -> Iterator[StubApiServer]:
    with StubApiServer() as stub:
        stub.add({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
        yield stub


def test_a_jobs_pod_deleted_while_watched_is_heard_and_the_watch_lives_on(
    server: StubApiServer, tmp_path: Path
) -> None:
    server.add(_pod("train-0", "job-a", "n1"))
    server.add(_pod("train-1", "job-a", "n2"))
    api = client.CoreV1Api(config.new_client_from_config(config_file=str(server.kubeconfig(tmp_path / "kc"))))
    jobs = Recorder()
    detector = KubeDetector(api, jobs, KubeSettings(namespace=NS, resync_seconds=30, watch_seconds=5))  # type: ignore[arg-type]
    thread = threading.Thread(target=detector.follow, args=("pods",), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not any(c.verb == "watch" for c in server.requests) and time.monotonic() < deadline:
            time.sleep(0.02)
        for name in ("train-0", "train-1"):  # one after the other: the first must not end the watch
            api.delete_namespaced_pod(name, NS)
            while not any(name in s.reason for s in jobs.seen) and time.monotonic() < deadline:
                time.sleep(0.02)
        assert thread.is_alive()
    finally:
        detector.close()
        thread.join(10)
    gone = {s.node: s for s in jobs.seen}
    assert set(gone) == {"n1", "n2"}, jobs.seen
    assert all(s.kind is FailureKind.POD_DELETED and s.job == "job-a" for s in gone.values()), jobs.seen
