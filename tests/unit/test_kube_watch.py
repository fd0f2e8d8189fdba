"""The Kubernetes detector's Pods watch (`workers.detectors.kube.KubeDetector`), end to end on the
real `kubernetes` client against the stub API server (`tests/kube`: no API server can run on these
machines). A job's Pod deleted after the watch began, by real `kubectl delete pod` (by the client
where kubectl is missing) and then another by the client, is heard by the jobs as that job's
interruption on the Pod's node. The watch once received every Pod as a plain dict (the client reads
the type of what it streams from the lister's signature) and its thread died on the first one, so a
Pod deleted after the first listing went unheard."""

from __future__ import annotations

import shutil
import subprocess
import threading
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config

from tests.kube.stub_apiserver import StubApiServer
from tests.unit.job_driver import poll_until
from torchpass.models import FailureKind
from workers.detectors.kube import KubeDetector, KubeSettings
from workers.detectors.reports import Seen, Told

pytestmark = pytest.mark.timeout(60)
NS = "torchpass"


class Recorder:
    """The jobs, as the detector reaches them: what it told them."""

    def __init__(self) -> None:
        self.seen: list[Seen] = []

    def tell(self, seen: Seen) -> list[Told]:
        self.seen.append(seen)
        return []


def _heard(jobs: Recorder, pod: str) -> bool:
    return any(pod in s.reason for s in jobs.seen)


def _pod(name: str, job: str, node: str) -> dict[str, Any]:
    meta = {"name": name, "namespace": NS, "labels": {"torchpass.io/job": job}}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {"nodeName": node, "containers": []},
        "status": {"phase": "Running"},
    }


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
    kubeconfig = server.kubeconfig(tmp_path / "kc")
    api = client.CoreV1Api(config.new_client_from_config(config_file=str(kubeconfig)))
    jobs = Recorder()
    settings = KubeSettings(namespace=NS, resync_seconds=30, watch_seconds=5)
    detector = KubeDetector(api, jobs, settings)  # type: ignore[arg-type]
    thread = threading.Thread(target=detector.follow, args=("pods",), daemon=True)
    thread.start()
    try:
        poll_until(
            lambda: any(c.verb == "watch" for c in server.requests), "the detector's watch", 20
        )
        kubectl = shutil.which("kubectl")
        for name in ("train-0", "train-1"):  # one after the other: the first must not end the watch
            if name == "train-0" and kubectl:
                subprocess.run(
                    [kubectl, "--kubeconfig", str(kubeconfig), "-n", NS, "delete", "pod", name],
                    check=True,
                    capture_output=True,
                    timeout=30,
                )
            else:
                api.delete_namespaced_pod(name, NS)
            poll_until(partial(_heard, jobs, name), f"the deletion of {name} heard", 20)
        assert thread.is_alive()
    finally:
        detector.close()
        thread.join(10)
    gone = {s.node: s for s in jobs.seen}
    assert set(gone) == {"n1", "n2"}, jobs.seen
    assert all(s.kind is FailureKind.POD_DELETED and s.job == "job-a" for s in gone.values()), (
        jobs.seen
    )
