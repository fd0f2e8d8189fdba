"""Spare nodes for jobs on Kubernetes: the job's node agent Pod created on a free, labelled spare
Node (run by the Kubernetes detector, `torchpass detect kubernetes --spare-node-label`).

A job started with `--spare-nodes N --remote` (deploy/kubernetes/job: the coordinator's flags) asks
for N idle spare nodes. How its spare-node agent runs is a PodTemplate in the jobs' namespace,
labelled with the job and `app.kubernetes.io/name: torchpass-spare-node`
(`deploy/kubernetes/job/spare-node.yaml`). At each pass the keeper counts the job's idle nodes (its
own status: joined, no rank, not cordoned) and its spare-node Pods not yet joined (pending, or
running before their agent joined). For each one missing it takes a free spare Node (labelled,
Ready, schedulable, not one of the job's nodes, running no spare-node Pod of any job) and creates a
Pod from the template bound to it (`spec.nodeName`): reserving the node is creating its agent there.
The agent joins the job as a spare node; once a cordon moved ranks onto it, it is idle no more and
the next pass takes another free node, if there is one.

Bounded like the Slurm keeper (`workers.detectors.spare_nodes.Budget`). Needs `create` on pods and
`list` on podtemplates in the namespace (deploy/kubernetes/rbac.yaml); it deletes nothing: a
spare-node Pod's agent exits with its job (restartPolicy Never), and the Pod is owned by the job's
PodTemplate, so Kubernetes' garbage collector deletes it with the job's objects.
"""

from __future__ import annotations

import copy
import logging
from datetime import timedelta
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from workers.detectors.kube import KubeSettings, node_seen
from workers.detectors.reports import ASK_TIMEOUT
from workers.detectors.spare_nodes import Budget, Wanted, missing, wanted

log = logging.getLogger("torchpass.kube")
APP_LABEL = "app.kubernetes.io/name"
SPARE_APP = "torchpass-spare-node"
_LIVE = (None, "Pending", "Running")


class KubeSpares:
    """Keeps every job's spare nodes; `keep` is called at each pass of the Kubernetes detector."""

    def __init__(
        self,
        api: client.CoreV1Api,
        state_dir: Path,
        settings: KubeSettings,
        node_label: str,
        timeout: timedelta = ASK_TIMEOUT,
    ) -> None:
        self.api = api
        self.state_dir = state_dir
        self.settings = settings
        self.node_label = node_label  # a label selector: the Nodes spare nodes come from
        self._timeout = timeout
        self._budget = Budget()

    def keep(self) -> list[str]:
        """One pass over the jobs; the names of the Pods it created."""
        jobs, _ = wanted(self.state_dir, self._timeout)
        if not jobs:
            return []
        ns = self.settings.namespace
        try:
            pods: list[Any] = (
                self.api.list_namespaced_pod(ns, label_selector=f"{APP_LABEL}={SPARE_APP}").items
                or []
            )
            nodes: list[Any] = self.api.list_node(label_selector=self.node_label).items or []
        except (ApiException, HTTPError, OSError, ValueError) as e:
            log.warning("spare nodes: the cluster could not be read; none kept this time: %r", e)
            return []
        live = [p for p in pods if p.metadata.deletion_timestamp is None and _phase(p) in _LIVE]
        taken = {p.spec.node_name for p in live if p.spec is not None and p.spec.node_name}
        free = [n.metadata.name for n in nodes if _ready(n) and n.metadata.name not in taken]
        created = []
        for w in jobs:
            mine = [
                p
                for p in live
                if (p.metadata.labels or {}).get(self.settings.job_label) == w.job_id
            ]
            running_on = [p.spec.node_name if _phase(p) == "Running" else None for p in mine]
            for _ in range(missing(w.count, w.status, running_on)):
                node = next((n for n in free if n not in w.status.nodes), None)
                if node is None:
                    log.warning(
                        "job %s: no free spare node (label %s) for its spare node",
                        w.job_id,
                        self.node_label,
                    )
                    break
                if (
                    not self._budget.take(w.job_id, w.count)
                    or (name := self._create(w, node)) is None
                ):
                    break
                free.remove(node)
                created.append(name)
        return created

    def _create(self, w: Wanted, node: str) -> str | None:
        ns, label = self.settings.namespace, self.settings.job_label
        try:
            templates: list[Any] = self.api.list_namespaced_pod_template(
                ns, label_selector=f"{label}={w.job_id},{APP_LABEL}={SPARE_APP}"
            ).items
        except (ApiException, HTTPError, OSError, ValueError) as e:
            log.warning("job %s: its spare-node template could not be read: %r", w.job_id, e)
            return None
        if not templates:
            log.error(
                "job %s asks for spare nodes but has no PodTemplate labelled %s=%s",
                w.job_id,
                APP_LABEL,
                SPARE_APP,
            )
            return None
        source: Any = templates[0]
        template: Any = copy.deepcopy(source.template)
        labels = {**(template.metadata.labels or {}), label: w.job_id, APP_LABEL: SPARE_APP}
        # Owned by the job's template: deleting the job's objects (`kubectl delete -k`) has
        # Kubernetes' garbage collector delete its spare-node Pods, ended or not, with no delete
        # right here.
        owner = client.V1OwnerReference(
            api_version="v1", kind="PodTemplate", name=source.metadata.name, uid=source.metadata.uid
        )
        meta = client.V1ObjectMeta(
            generate_name=f"{source.metadata.name}-", labels=labels, owner_references=[owner]
        )
        template.spec.node_name = node  # the node reserved: the scheduler is not asked
        try:
            pod: Any = self.api.create_namespaced_pod(
                ns, client.V1Pod(metadata=meta, spec=template.spec)
            )
        except (ApiException, HTTPError, OSError, ValueError) as e:
            log.warning("job %s: its spare node on %s could not be created: %r", w.job_id, node, e)
            return None
        log.warning("job %s: spare node agent %s created on %s", w.job_id, pod.metadata.name, node)
        return str(pod.metadata.name)


def _phase(pod: Any) -> str | None:
    return pod.status.phase if pod.status is not None else None


def _ready(node: Any) -> bool:
    """Ready, not cordoned (what the detector reports of a node is its trouble: nothing, here)."""
    conditions = (
        node.status.conditions if node.status is not None and node.status.conditions else ()
    )
    return not node_seen(node) and any(c.type == "Ready" and c.status == "True" for c in conditions)
