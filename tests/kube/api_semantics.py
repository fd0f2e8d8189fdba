"""What the Kubernetes API means, for the stub API server (stub_apiserver): the resources it serves,
Status errors, label and field selectors, merge, strategic merge and JSON patches, and the cordon
taint."""

from __future__ import annotations

import base64
import copy
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

Obj = dict[str, Any]
UNSCHEDULABLE_TAINT = "node.kubernetes.io/unschedulable"
_RBAC = "rbac.authorization.k8s.io/v1"


@dataclass(frozen=True)
class Resource:
    group_version: str
    name: str
    kind: str
    namespaced: bool
    short_names: tuple[str, ...] = ()
    has_status: bool = False  # a /status subresource: status changes only there

    @property
    def group(self) -> str:
        return self.group_version.rpartition("/")[0]


RESOURCES = (
    Resource("v1", "namespaces", "Namespace", False, ("ns",), True),
    Resource("v1", "nodes", "Node", False, ("no",), True),
    Resource("v1", "pods", "Pod", True, ("po",), True),
    Resource("v1", "configmaps", "ConfigMap", True, ("cm",)),
    Resource("v1", "podtemplates", "PodTemplate", True),
    Resource("v1", "secrets", "Secret", True),
    Resource("v1", "serviceaccounts", "ServiceAccount", True, ("sa",)),
    Resource("v1", "services", "Service", True, ("svc",), True),
    Resource("v1", "persistentvolumeclaims", "PersistentVolumeClaim", True, ("pvc",), True),
    Resource("v1", "events", "Event", True, ("ev",)),
    Resource("apps/v1", "deployments", "Deployment", True, ("deploy",), True),
    Resource("apps/v1", "daemonsets", "DaemonSet", True, ("ds",), True),
    Resource("apps/v1", "replicasets", "ReplicaSet", True, ("rs",), True),
    Resource("apps/v1", "statefulsets", "StatefulSet", True, ("sts",), True),
    Resource("policy/v1", "poddisruptionbudgets", "PodDisruptionBudget", True, ("pdb",), True),
    Resource(_RBAC, "roles", "Role", True),
    Resource(_RBAC, "rolebindings", "RoleBinding", True),
    Resource(_RBAC, "clusterroles", "ClusterRole", False),
    Resource(_RBAC, "clusterrolebindings", "ClusterRoleBinding", False),
    Resource("coordination.k8s.io/v1", "leases", "Lease", True),
)
BY_NAME = {r.name: r for r in RESOURCES}
BY_KIND = {(r.group_version, r.kind): r for r in RESOURCES}
_FIELDS = {  # the field selectors the real server takes beyond metadata.name and metadata.namespace
    "pods": {
        "spec.nodeName",
        "spec.restartPolicy",
        "spec.schedulerName",
        "spec.serviceAccountName",
        "spec.hostNetwork",
        "status.phase",
        "status.podIP",
        "status.nominatedNodeName",
    },
    "nodes": {"spec.unschedulable"},
    "namespaces": {"status.phase"},
    "secrets": {"type"},
    "events": {
        "involvedObject.kind",
        "involvedObject.name",
        "involvedObject.namespace",
        "reason",
        "type",
    },
}
# A strategic merge patch merges these lists by this key (and any list of objects that all have a
# name, by name); other lists it replaces, as a JSON merge patch does.
_MERGE_KEYS = {
    "conditions": "type",
    "taints": "key",
    "addresses": "type",
    "ownerReferences": "uid",
    "volumeMounts": "mountPath",
}


class ApiError(Exception):
    """A refused request, answered as a ``Status`` with its HTTP code."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status: Obj = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
        }
        self.status.update(message=message, reason=reason, code=code)


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def label_matcher(expr: str) -> Callable[[Obj], bool]:
    """``k=v``, ``k==v``, ``k!=v``, ``k``, ``!k``, ``k in (a,b)``, ``k notin (a,b)``; commas join
    (AND)."""
    terms: list[tuple[str, str, set[str]]] = []  # (op, key, values)
    for term in (t.strip() for t in re.split(r",(?![^(]*\))", expr) if t.strip()):
        m = re.fullmatch(
            r"(!?)([\w./-]+)\s*(?:(==|=|!=)\s*([\w.-]*)|\s+(in|notin)\s*\(([^)]*)\))?", term
        )
        if not m or (m[1] and (m[3] or m[5])):
            raise ApiError(400, "BadRequest", f"unable to parse requirement: {term!r}")
        if m[3]:  # k=v, k==v, k!=v
            terms.append(("=" if m[3] == "==" else m[3], m[2], {m[4]}))
        else:  # !k, k, k in (...), k notin (...)
            terms.append(
                (
                    "!" if m[1] else m[5] or "exists",
                    m[2],
                    {v.strip() for v in (m[6] or "").split(",")},
                )
            )

    def holds(op: str, key: str, values: set[str], labels: dict[str, str]) -> bool:
        if op in ("!", "exists"):
            return (key in labels) == (op == "exists")
        return (labels.get(key) in values) == (op in ("=", "in"))

    return lambda obj: all(holds(*t, obj["metadata"].get("labels") or {}) for t in terms)


def _field(obj: Obj, path: str) -> str:
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return "" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def field_matcher(expr: str, res: Resource) -> Callable[[Obj], bool]:
    """``path=value``, ``path==value``, ``path!=value`` on the fields the real server supports for
    ``res``."""
    terms: list[tuple[str, bool, str]] = []
    for term in (t.strip() for t in expr.split(",") if t.strip()):
        m = re.fullmatch(r"([\w.]+)(==|!=|=)(.*)", term)
        if not m:
            raise ApiError(400, "BadRequest", f"invalid field selector: {term!r}")
        if m[1] not in {"metadata.name", "metadata.namespace"} | _FIELDS.get(res.name, set()):
            raise ApiError(400, "BadRequest", f'field label not supported: {m[1]} for "{res.kind}"')
        terms.append((m[1], m[2] == "!=", m[3]))
    return lambda obj: all(
        (_field(obj, path) == value) != negated for path, negated, value in terms
    )


def _keyed(items: list[Any], key: str) -> bool:
    return all(isinstance(x, dict) and key in x for x in items)


def _merge(target: Any, patch: Any, strategic: bool) -> Any:
    """An RFC 7386 merge patch; ``strategic``: lists of objects merged by key, ``$patch`` honoured,
    other ``$`` directives ignored."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) and patch.get("$patch") != "replace" else {}
    for field, value in patch.items():
        old = out.get(field)
        key = _MERGE_KEYS.get(field, "name") if strategic else None
        if value is None:
            out.pop(field, None)
        elif key and isinstance(old, list) and isinstance(value, list) and _keyed(old + value, key):
            items = list(old)
            for item in value:
                at = next((i for i, x in enumerate(items) if x[key] == item[key]), None)
                if item.get("$patch") == "delete":
                    items = [x for i, x in enumerate(items) if i != at]
                elif at is None:
                    items.append(_merge({}, item, True))
                else:
                    items[at] = _merge(items[at], item, True)
            out[field] = items
        elif not (strategic and field.startswith("$")):
            out[field] = _merge(old, value, strategic)
    return out


def _json_patch(doc: Obj, ops: Any) -> Obj:
    """RFC 6902 add, replace, remove and test."""
    if not isinstance(ops, list):
        raise ApiError(400, "BadRequest", "a JSON patch must be a list of operations")
    doc = copy.deepcopy(doc)
    for op in ops:
        try:
            *parents, last = [
                p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]
            ]
            target: Any = doc
            for part in parents:
                target = target[int(part)] if isinstance(target, list) else target[part]
            key: Any = (
                (len(target) if last == "-" else int(last)) if isinstance(target, list) else last
            )
            # must be there
            current = target[key] if op["op"] in ("replace", "remove", "test") else None
            if op["op"] == "add" and isinstance(target, list):
                target.insert(key, op["value"])
            elif op["op"] in ("add", "replace"):
                target[key] = op["value"]
            elif op["op"] == "remove":
                del target[key]
            elif op["op"] != "test" or current != op.get("value"):
                raise ValueError(f"{op['op']} {op['path']} failed")
        except (KeyError, IndexError, ValueError, TypeError) as e:
            raise ApiError(422, "Invalid", f"the JSON patch could not be applied: {e!r}") from e
    return doc


def patched(old: Obj, body: Any, content_type: str) -> Obj:
    kind = content_type.split(";", maxsplit=1)[0].strip()
    if kind == "application/json-patch+json":
        return _json_patch(old, body)
    if kind not in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
        raise ApiError(415, "UnsupportedMediaType", f"the body is in an unsupported format: {kind}")
    if not isinstance(body, dict):
        raise ApiError(400, "BadRequest", "a merge patch must be a JSON object")
    return cast(Obj, _merge(old, body, "strategic" in kind))


def as_stored(res: Resource, obj: Obj) -> None:
    """What the cluster makes of an object written to it, beyond the writer's say: a Secret's
    write-only ``stringData`` goes into ``data`` (base64); a Node's ``spec.unschedulable`` brings
    the unschedulable taint (the node controller's part of a cordon) and its clearing takes the
    taint away."""
    if res.name == "secrets" and "stringData" in obj:
        encoded = {
            k: base64.b64encode(v.encode()).decode() for k, v in obj.pop("stringData").items()
        }
        obj["data"] = {**(obj.get("data") or {}), **encoded}
    if res.name != "nodes":
        return
    spec = obj.setdefault("spec", {})
    taints = [t for t in spec.get("taints") or [] if t.get("key") != UNSCHEDULABLE_TAINT]
    if spec.get("unschedulable"):
        taints.append({"key": UNSCHEDULABLE_TAINT, "effect": "NoSchedule"})
    spec["taints"] = taints
    if not taints:
        del spec["taints"]
