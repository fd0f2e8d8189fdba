"""The Kubernetes detector: Nodes and the jobs' Pods, watched through the `kubernetes` client.

What it reports (`workers.detectors.reports.Seen`), each to the jobs it concerns:

- a Node cordoned (`spec.unschedulable`, or the `node.kubernetes.io/unschedulable` taint) -> a
  planned move of every rank on it while it still works (`kubectl cordon`, `kubectl drain`);
- a Node whose Ready condition is False or Unknown -> a node failure (the job takes it for one only
  if it no longer hears from the node itself);
- a Pod of a job (label `torchpass.io/job`) deleted, evicted or terminating -> an interruption of
  that job's ranks on the Pod's node.

Each kind of object is listed, then watched from the list's resourceVersion. A watch that ends is
resumed from the last resourceVersion seen (bookmarks included); one the server no longer serves
(410 Gone) and any other error lead to a fresh list, after a bounded back-off; and every `resync`
seconds the lists are read again whatever happened, so that a job that could not be reached hears it
then. Everything is said again on each list: the observations' keys make that harmless.

After a job acted on a node's failure, the node is left cordoned with the reason in an annotation
(`torchpass.io/reason`), so that nothing is scheduled on it until somebody repairs it and uncordons
it.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException
from pydantic import BaseModel, ConfigDict, Field
from urllib3.exceptions import HTTPError

from torchpass.models import FailureKind
from workers.detectors.reports import Jobs, Seen, acted

log = logging.getLogger("torchpass.kube")
UNSCHEDULABLE_TAINT = "node.kubernetes.io/unschedulable"
REASON_ANNOTATION = "torchpass.io/reason"
MAX_BACKOFF = 30.0


class KubeSettings(BaseModel):
    """Where the jobs' Pods are and how they are labelled; how often everything is read again."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    namespace: str = Field(default="torchpass", min_length=1, max_length=63)
    job_label: str = Field(default="torchpass.io/job", min_length=1, max_length=253)
    resync_seconds: float = Field(default=60.0, gt=0, le=3600)
    watch_seconds: int = Field(
        default=30, gt=0, le=3600, description="server-side bound of one watch"
    )
    spare_seconds: float = Field(
        default=5.0, gt=0, le=3600, description="between passes of the spare keeper"
    )
    cordon_after_failure: bool = True


def node_seen(node: Any) -> list[Seen]:
    """What a Node object says that a job must hear (the `kubernetes` client's V1Node)."""
    meta, spec = node.metadata, node.spec
    name, uid = meta.name, meta.uid or meta.name
    out = []
    taints = [
        t
        for t in (spec.taints if spec is not None and spec.taints else ())
        if t.key == UNSCHEDULABLE_TAINT
    ]
    if (spec is not None and spec.unschedulable) or taints:
        why = (meta.annotations or {}).get(REASON_ANNOTATION) or "cordoned"
        out.append(Seen(name, FailureKind.NODE_CORDON, f"{uid}:cordon", f"node cordoned: {why}"))
    conditions = (
        node.status.conditions if node.status is not None and node.status.conditions else ()
    )
    for c in conditions:
        if c.type == "Ready" and c.status != "True":
            since = _when(c.last_transition_time)
            why = f"Ready={c.status}" + (
                f" ({c.reason}: {c.message})" if c.reason or c.message else ""
            )
            out.append(
                Seen(name, FailureKind.NODE_NOT_READY, f"{uid}:ready:{c.status}:{since}", why)
            )
    return out


def pod_seen(event: str, pod: Any, job_label: str) -> Seen | None:
    """A job's Pod deleted, evicted or terminating: an interruption of that job on the Pod's
    node."""
    meta = pod.metadata
    job = (meta.labels or {}).get(job_label)
    node = pod.spec.node_name if pod.spec is not None else None
    if not job or not node:
        return None
    phase = pod.status.phase if pod.status is not None else None
    reason = pod.status.reason if pod.status is not None else None
    if event == "DELETED" or meta.deletion_timestamp is not None:
        why = f"pod {meta.namespace}/{meta.name} deleted"
    elif phase == "Failed" and reason == "Evicted":
        why = f"pod {meta.namespace}/{meta.name} evicted"
    else:
        return None
    return Seen(node, FailureKind.POD_DELETED, f"{meta.uid or meta.name}:gone", why, job=job)


def _when(t: datetime | None) -> str:
    return t.astimezone(UTC).isoformat() if t is not None else "-"


class KubeDetector:
    """Watches Nodes (cluster-wide) and the jobs' Pods (in `settings.namespace`) until `stop` is
    set."""

    def __init__(
        self,
        api: client.CoreV1Api,
        jobs: Jobs,
        settings: KubeSettings | None = None,
        keep_spares: Callable[[], object] | None = None,
    ) -> None:
        self.api = api
        self.jobs = jobs
        self.settings = settings or KubeSettings()
        self.keep_spares = (
            keep_spares  # `workers.detectors.kube_spares.KubeSpares.keep`, every `spare_seconds`
        )
        self.stop = threading.Event()
        self._watches: list[watch.Watch] = []
        self._lock = threading.Lock()

    def run(self) -> None:
        """Both watches, each in a thread of its own (and the spare keeper in a third), until
        `close`."""
        threads = [
            threading.Thread(
                target=self.follow, args=(kind,), name=f"torchpass-kube-{kind}", daemon=True
            )
            for kind in ("nodes", "pods")
        ]
        if self.keep_spares is not None:
            threads.append(
                threading.Thread(target=self._keep, name="torchpass-kube-spares", daemon=True)
            )
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def _keep(self) -> None:
        assert self.keep_spares is not None
        while not self.stop.wait(self.settings.spare_seconds):
            try:
                self.keep_spares()
            except Exception:  # one bad pass must not end the keeping
                log.exception("spare nodes: a pass failed")

    def close(self) -> None:
        self.stop.set()
        with self._lock:
            for w in self._watches:
                w.stop()

    # --- one kind of object: list, watch, resync
    # -----------------------------------------------------

    def follow(self, kind: str) -> None:
        lister, handle = self._of(kind)
        backoff = 1.0
        while not self.stop.is_set():
            try:
                rv = self._list(lister, handle)
                self._watch(lister, handle, rv)
                backoff = 1.0
            except ApiException as e:
                if e.status == 410:  # the server no longer has what followed our resourceVersion
                    log.info("%s watch expired (410 Gone): listing again", kind)
                    continue
                log.warning(
                    "%s: the API server answered %s %s; listing again in %.0f s",
                    kind,
                    e.status,
                    e.reason,
                    backoff,
                )
                self.stop.wait(backoff)
                backoff = min(MAX_BACKOFF, backoff * 2)
            except (HTTPError, OSError, ValueError) as e:
                if self.stop.is_set():
                    return  # `close` cut the watch
                log.warning("%s: %r; listing again in %.0f s", kind, e, backoff)
                self.stop.wait(backoff)
                backoff = min(MAX_BACKOFF, backoff * 2)

    def _of(self, kind: str) -> tuple[Callable[..., Any], Callable[[str, Any], None]]:
        if kind == "nodes":
            return self.api.list_node, self._node
        ns, label = self.settings.namespace, self.settings.job_label

        # A partial, not a closure: the watch reads the type of what it streams from the lister's
        # signature (V1PodList). A closure's says nothing, so every watched Pod came as a plain
        # dict, and the first one killed the Pods' thread.
        pods = functools.partial(self.api.list_namespaced_pod, ns, label_selector=label)
        return pods, self._pod

    def _list(self, lister: Callable[..., Any], handle: Callable[[str, Any], None]) -> str:
        listed = lister()
        for obj in listed.items or ():
            handle("LISTED", obj)
        return str(listed.metadata.resource_version)

    def _watch(
        self, lister: Callable[..., Any], handle: Callable[[str, Any], None], rv: str
    ) -> None:
        """Until the next resync: each watch resumed from the last resourceVersion it saw."""
        resync_at = time.monotonic() + self.settings.resync_seconds
        while not self.stop.is_set() and (left := resync_at - time.monotonic()) > 0:
            w = watch.Watch()
            with self._lock:
                self._watches.append(w)
            try:
                bound = max(1, min(self.settings.watch_seconds, int(left)))
                for ev in self._events(w, lister, rv, bound):
                    try:
                        handle(ev["type"], ev["object"])
                    except Exception as e:  # an object not as expected: said, and the watch goes on
                        log.error("a watched %s event could not be read: %r", ev["type"], e)
                rv = w.resource_version or rv
            finally:
                with self._lock:
                    self._watches.remove(w)

    def _events(
        self, w: watch.Watch, lister: Callable[..., Any], rv: str, bound: int
    ) -> Iterator[dict[str, Any]]:
        for ev in w.stream(
            lister, resource_version=rv, timeout_seconds=bound, allow_watch_bookmarks=True
        ):
            if self.stop.is_set():
                w.stop()
                return
            if ev["type"] in ("ADDED", "MODIFIED", "DELETED"):
                yield ev

    # --- what each object says
    # -----------------------------------------------------------------------

    def _node(self, event: str, node: Any) -> None:
        if event == "DELETED":
            return
        for seen in node_seen(node):
            told = self.jobs.tell(seen)
            if (
                acted(told)
                and seen.kind is not FailureKind.NODE_CORDON
                and self.settings.cordon_after_failure
            ):
                self._leave_cordoned(seen, acted(told))

    def _pod(self, event: str, pod: Any) -> None:
        seen = pod_seen(event, pod, self.settings.job_label)
        if seen is not None:
            self.jobs.tell(seen)

    def _leave_cordoned(self, seen: Seen, jobs: list[str]) -> None:
        """The node failed under a job that acted on it: cordoned, with why, until somebody repairs
        it."""
        why = f"torchpass: {seen.kind.value} ({seen.reason}); job(s) {', '.join(jobs)} moved off it"
        body = {
            "spec": {"unschedulable": True},
            "metadata": {"annotations": {REASON_ANNOTATION: why[:1000]}},
        }
        try:
            self.api.patch_node(seen.node, body)
        except (ApiException, HTTPError, OSError) as e:
            log.warning("node %s not cordoned after the failure: %r", seen.node, e)
