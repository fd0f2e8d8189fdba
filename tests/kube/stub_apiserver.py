"""A stub Kubernetes API server for tests, in standard-library Python.

It stands for the kube-apiserver's REST semantics that the torchpass detectors and deploy files use:
Nodes, Pods and what ``kubectl apply`` of a typical manifest sends (Namespaces, ConfigMaps, Secrets,
ServiceAccounts, Services, Deployments, DaemonSets, PodTemplates, RBAC, Leases), in memory:
list/get/create/replace/patch/ delete and pod eviction, label and field selectors, chunked watch
streams from a resourceVersion with BOOKMARKs and the 410 "Expired" of a compacted history,
``Status`` errors, and the discovery documents kubectl reads. A stub because no kube-apiserver,
kind, k3s, kwok or envtest binary can run on the machines the tests run on (the project's testing
notes, "Kubernetes: no API server can run here"): the real ``kubernetes`` client and ``kubectl``
talk to this instead. What the API means (selectors, patches) is in ``api_semantics``.

Faithful where code could pass here and fail on a cluster: a write to an object leaves its status
alone and a write to ``/status`` changes only the status; a no-op write keeps the resourceVersion; a
selector watch sees an object leave the selector as DELETED; list items carry no kind/apiVersion; an
unsupported field selector is a 400; a namespaced create needs its Namespace; cordon adds the
``node.kubernetes.io/unschedulable`` NoSchedule taint (the node controller's work). Not modelled:
authentication and authorization (any token passes; ``requests`` logs each call as an RBAC verb, to
check a Role covers it), admission and name validation, graceful deletion (a pod goes at once),
controllers and garbage collection, PodDisruptionBudgets, server-side apply, protobuf, pagination
(``limit`` is ignored), OpenAPI (404: ``kubectl apply --validate=false``).
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import functools
import json
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, cast
from urllib.parse import parse_qs, urlsplit

from tests.kube.api_semantics import (
    BY_KIND,
    BY_NAME,
    RESOURCES,
    UNSCHEDULABLE_TAINT,
    ApiError,
    Obj,
    Resource,
    as_stored,
    field_matcher,
    label_matcher,
    now,
    patched,
)

__all__ = ["UNSCHEDULABLE_TAINT", "ApiError", "Call", "StubApiServer"]


@dataclass(frozen=True)
class Call:
    """One resource request: the RBAC verb and what a rule must name to allow it (group "":
    core)."""

    verb: str
    group: str
    resource: str
    subresource: str
    namespace: str


_SUCCESS: Obj = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"}


class StubApiServer:
    """``start()``/``stop()``, or ``with StubApiServer() as server``; ``url``; ``kubeconfig(path)``.

    Seeding and inspection: ``add``, ``get``, ``objects``, ``remove``, ``set_node_condition``, and
    ``requests`` (every resource call, in order). Hooks: ``compact()`` (any older resourceVersion is
    now too old: 410), ``close_watches()`` (ends every open watch), ``send_bookmarks()`` (a
    BOOKMARK, if allowed).
    """

    def __init__(self, *, bookmark_interval: float = 2.0, history_limit: int = 10_000) -> None:
        self.bookmark_interval = bookmark_interval
        self.history_limit = history_limit
        self.requests: list[Call] = []
        self._cond = threading.Condition(threading.RLock())
        self._objects: dict[tuple[str, str, str], Obj] = {}  # by (resource, namespace, name)
        # (rv, type, resource, object, the object before): objects in here never change
        self._history: list[tuple[int, str, Resource, Obj, Obj | None]] = []
        # a watch from a resourceVersion older than _compacted gets 410
        self._rv = self._compacted = 0
        self._closes = self._bookmarks = 0
        self._stopped = False
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._connections: set[socket.socket] = set()
        for ns in ("default", "kube-system", "kube-public", "kube-node-lease"):
            namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}
            self.add({**namespace, "status": {"phase": "Active"}})

    def start(self) -> StubApiServer:
        self._httpd = _HTTPServer(("127.0.0.1", 0), _Handler)
        self._httpd.stub = self
        # stop() waits for a poll
        serve = functools.partial(self._httpd.serve_forever, poll_interval=0.05)
        self._thread = threading.Thread(target=serve, name="stub-apiserver", daemon=True)
        self._thread.start()
        return self

    @property
    def url(self) -> str:
        assert self._httpd is not None, "not started"
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        for conn in list(self._connections):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> StubApiServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def kubeconfig(self, path: str | Path) -> Path:
        """A kubeconfig for ``kubectl --kubeconfig`` and ``load_kube_config``: plain http, a bearer
        token."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "stub",
            "preferences": {},
            "clusters": [{"name": "stub", "cluster": {"server": self.url}}],
            "users": [{"name": "stub", "user": {"token": "stub-token"}}],
            "contexts": [{"name": "stub", "context": {"cluster": "stub", "user": "stub"}}],
        }
        Path(path).write_text(json.dumps(config, indent=2))
        return Path(path)

    @property
    def resource_version(self) -> str:
        return str(self._rv)

    def add(self, obj: Obj) -> Obj:
        """Store ``obj`` as given, status included (namespace "default" if none): ADDED, or
        MODIFIED."""
        res = BY_KIND.get((obj["apiVersion"], obj["kind"]))
        if res is None:
            raise ValueError(f"no resource for {obj['apiVersion']} {obj['kind']}")
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        if res.namespaced:
            meta.setdefault("namespace", "default")
        with self._cond:
            old = self._objects.get((res.name, meta.get("namespace", ""), meta["name"]))
            meta.setdefault("uid", old["metadata"]["uid"] if old else str(uuid.uuid4()))
            meta.setdefault(
                "creationTimestamp", old["metadata"]["creationTimestamp"] if old else now()
            )
            as_stored(res, obj)
            return self._commit(res, "MODIFIED" if old else "ADDED", obj, old)

    def get(self, resource: str, name: str, namespace: str = "") -> Obj:
        """A copy of the stored object (``resource`` as in URLs: "nodes", "pods"); KeyError if
        none."""
        with self._cond:
            return copy.deepcopy(self._objects[(resource, namespace, name)])

    def objects(self, resource: str, namespace: str | None = None) -> list[Obj]:
        with self._cond:
            items = sorted(self._objects.items())
            return [
                copy.deepcopy(o)
                for (r, ns, _), o in items
                if r == resource and namespace in (None, ns)
            ]

    def remove(self, resource: str, name: str, namespace: str = "") -> Obj:
        with self._cond:
            return self._delete(BY_NAME[resource], namespace, name)

    def set_node_condition(self, name: str, type_: str, status: str, reason: str = "") -> Obj:
        """Set a Node's condition (``type_`` "Ready"; ``status`` "True", "False" or "Unknown"):
        MODIFIED."""
        with self._cond:
            old = self._existing(BY_NAME["nodes"], "", name)
            node = copy.deepcopy(old)
            conditions = node.setdefault("status", {}).setdefault("conditions", [])
            cond = next((c for c in conditions if c.get("type") == type_), None)
            if cond is None:
                conditions.append(cond := {"type": type_})
            if cond.get("status") != status:
                cond["lastTransitionTime"] = now()
            cond.update(
                status=status, reason=reason or f"Stub{type_}{status}", lastHeartbeatTime=now()
            )
            return self._commit(BY_NAME["nodes"], "MODIFIED", node, old)

    def compact(self) -> None:
        with self._cond:
            self._history.clear()
            self._compacted = self._rv
            self._cond.notify_all()

    def close_watches(self) -> None:
        with self._cond:
            self._closes += 1
            self._cond.notify_all()

    def send_bookmarks(self) -> None:
        with self._cond:
            self._bookmarks += 1
            self._cond.notify_all()

    # The store: callers hold self._cond; a stored object is never changed in place, only replaced.
    def _existing(self, res: Resource, ns: str, name: str) -> Obj:
        obj = self._objects.get((res.name, ns, name))
        if obj is None:
            raise ApiError(404, "NotFound", f'{res.name} "{name}" not found')
        return obj

    def _commit(self, res: Resource, type_: str, obj: Obj, before: Obj | None) -> Obj:
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        obj["apiVersion"], obj["kind"] = res.group_version, res.kind
        key = (res.name, obj["metadata"].get("namespace", ""), obj["metadata"]["name"])
        if type_ == "DELETED":
            del self._objects[key]
        else:
            self._objects[key] = obj
        self._history.append((self._rv, type_, res, copy.deepcopy(obj), before))
        if len(self._history) > self.history_limit:
            self._compacted = self._history[len(self._history) // 2 - 1][0]
            del self._history[: len(self._history) // 2]
        self._cond.notify_all()
        return copy.deepcopy(obj)

    def _create(self, res: Resource, ns: str, obj: Obj) -> Obj:
        meta = obj.setdefault("metadata", {})
        if res.namespaced and meta.setdefault("namespace", ns) != ns:
            raise ApiError(
                400, "BadRequest", "the namespace of the object does not match the request's"
            )
        if res.namespaced and ("namespaces", "", ns) not in self._objects:
            raise ApiError(404, "NotFound", f'namespaces "{ns}" not found')
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + "".join(
                random.choices("bcdfghjklmnpqrstvwxz2456789", k=5)
            )
        if not meta.get("name"):
            raise ApiError(
                422, "Invalid", "metadata.name: Required value: name or generateName is required"
            )
        if (res.name, ns, meta["name"]) in self._objects:
            raise ApiError(409, "AlreadyExists", f'{res.name} "{meta["name"]}" already exists')
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=now())
        # the server sets its status (a Node brings its own)
        if res.has_status and res.name != "nodes":
            phase = {"pods": "Pending", "namespaces": "Active"}.get(res.name)
            obj["status"] = {"phase": phase} if phase else {}
        as_stored(res, obj)
        return self._commit(res, "ADDED", obj, None)

    def _update(self, res: Resource, ns: str, name: str, sub: str, obj: Obj) -> Obj:
        old = self._existing(res, ns, name)
        meta, rv = obj.setdefault("metadata", {}), old["metadata"]["resourceVersion"]
        if meta.get("name", name) != name:
            raise ApiError(
                400, "BadRequest", f"the object's name ({meta['name']}) does not match the URL"
            )
        if meta.get("resourceVersion", rv) != rv:
            message = (
                f'Operation cannot be fulfilled on {res.name} "{name}": '
                "the object has been modified"
            )
            raise ApiError(
                409, "Conflict", message + "; please apply your changes to the latest version"
            )
        if sub == "status":
            obj = {**copy.deepcopy(old), "status": obj.get("status", {})}
        else:
            kept = ("name", "namespace", "uid", "creationTimestamp")
            obj["metadata"] = {
                **meta,
                **{k: old["metadata"][k] for k in kept if k in old["metadata"]},
            }
            if res.has_status:  # status changes only through /status
                obj["status"] = copy.deepcopy(old.get("status"))
            obj = {k: v for k, v in obj.items() if v is not None}
            as_stored(res, obj)
        obj["metadata"]["resourceVersion"] = rv
        obj["apiVersion"], obj["kind"] = res.group_version, res.kind
        return copy.deepcopy(old) if obj == old else self._commit(res, "MODIFIED", obj, old)

    def _delete(self, res: Resource, ns: str, name: str) -> Obj:
        old = self._existing(res, ns, name)
        for r, o_ns, o_name in [
            k for k in self._objects if res.name == "namespaces" and k[1] == name
        ]:
            self._delete(BY_NAME[r], o_ns, o_name)
        return self._commit(res, "DELETED", copy.deepcopy(old), old)

    def _list(self, res: Resource, ns: str, query: dict[str, str]) -> list[Obj]:
        labels = label_matcher(query.get("labelSelector", ""))
        fields = field_matcher(query.get("fieldSelector", ""), res)
        items = sorted(
            (k, o) for k, o in self._objects.items() if k[0] == res.name and ns in ("", k[1])
        )
        return [o for _, o in items if labels(o) and fields(o)]

    # Requests.
    def _route(self, path: str) -> tuple[Resource, str, str, str]:
        """(resource, namespace, name, subresource) of a resource path; 404 for anything else."""
        parts = [p for p in path.split("/") if p]
        gv, rest = (
            ("v1", parts[2:]) if parts[:2] == ["api", "v1"] else ("/".join(parts[1:3]), parts[3:])
        )
        rest = rest if parts[:1] in (["api"], ["apis"]) else []
        ns = rest[1] if len(rest) >= 3 and rest[0] == "namespaces" and rest[2] != "status" else ""
        rest = rest[2:] if ns else rest
        res = BY_NAME.get(rest[0]) if rest else None
        name, sub = [*rest[1:], "", ""][:2]
        subresources = {
            "",
            "status" if res and res.has_status else "",
            "eviction" if res == BY_NAME["pods"] else "",
        }
        if not res or res.group_version != gv or len(rest) > 3 or sub not in subresources:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if (ns and not res.namespaced) or (name and res.namespaced and not ns):
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        return res, ns, name, sub

    def _handle(
        self, method: str, path: str, query: dict[str, str], body: Any, ct: str
    ) -> tuple[int, Obj]:
        res, ns, name, sub = self._route(path)
        if method in ("POST", "PUT", "PATCH") and not isinstance(body, dict | list):
            raise ApiError(400, "BadRequest", "the request has no JSON body")
        with self._cond:
            if method == "GET" and not name:
                strip = ("kind", "apiVersion")  # as the real server's list items
                items = [
                    {k: v for k, v in o.items() if k not in strip}
                    for o in self._list(res, ns, query)
                ]
                out = {"kind": f"{res.kind}List", "apiVersion": res.group_version, "items": items}
                return 200, {**out, "metadata": {"resourceVersion": str(self._rv)}}
            if method == "GET":
                return 200, copy.deepcopy(self._existing(res, ns, name))
            if method == "POST" and sub == "eviction":
                if body.get("metadata", {}).get("name", name) != name:
                    raise ApiError(
                        400, "BadRequest", "the name of the Eviction does not match the pod's"
                    )
                self._delete(res, ns, name)
                return 201, {**_SUCCESS, "code": 201}
            if method == "POST" and not name:
                return 201, self._create(res, ns, body)
            if method in ("PUT", "PATCH") and name:
                new = (
                    patched(self._existing(res, ns, name), body, ct) if method == "PATCH" else body
                )
                return 200, self._update(res, ns, name, sub, new)
            if method == "DELETE" and name and not sub:
                gone = self._delete(res, ns, name)
                details = {
                    "name": name,
                    "group": res.group,
                    "kind": res.name,
                    "uid": gone["metadata"]["uid"],
                }
                return 200, gone if res.name in ("pods", "namespaces") else {
                    **_SUCCESS,
                    "details": details,
                }
            if method == "DELETE" and not sub:
                items = [
                    self._delete(res, ns, o["metadata"]["name"]) for o in self._list(res, ns, query)
                ]
                return 200, {
                    "kind": f"{res.kind}List",
                    "apiVersion": res.group_version,
                    "items": items,
                }
        raise ApiError(405, "MethodNotAllowed", f"{method} is not allowed on {path}")

    def _watch(self, res: Resource, ns: str, query: dict[str, str]) -> Iterator[Obj]:
        """Checks the request now (an error is a plain response), then returns the stream of events:
        the current objects as ADDED (no resourceVersion, or "0"), or every event after the
        resourceVersion (410 if compacted), then each as it comes, BOOKMARKs if allowed, until
        timeoutSeconds, ``close_watches`` or ``stop``."""
        labels = label_matcher(query.get("labelSelector", ""))
        fields = field_matcher(query.get("fieldSelector", ""), res)
        start = query.get("resourceVersion", "")
        if not start.isdigit() and start:
            raise ApiError(400, "BadRequest", f"invalid resourceVersion {start!r}")
        with self._cond:
            initial = (
                [{"type": "ADDED", "object": o} for o in self._list(res, ns, query)]
                if start in ("", "0")
                else []
            )
            last, closes, marks = int(start or 0) or self._rv, self._closes, self._bookmarks
        bookmarks = query.get("allowWatchBookmarks") in ("true", "1")
        deadline = time.monotonic() + float(query.get("timeoutSeconds") or 1800)
        match: Callable[[Obj], bool] = lambda o: labels(o) and fields(o)  # noqa: E731

        def stream(last: int, marks: int) -> Iterator[Obj]:
            yield from copy.deepcopy(initial)
            end, next_mark = False, time.monotonic() + self.bookmark_interval
            while not end:
                events: list[Obj] = []
                with self._cond:
                    while not events and not end:
                        now = time.monotonic()
                        if last < self._compacted:
                            message = f"too old resource version: {last} ({self._compacted})"
                            gone = ApiError(410, "Expired", message).status
                            events.append({"type": "ERROR", "object": gone})
                        end = (
                            bool(events)
                            or self._stopped
                            or self._closes != closes
                            or now >= deadline
                        )
                        if not end:
                            events, last = self._events(res, ns, match, last), self._rv
                        if not end and bookmarks and (now >= next_mark or self._bookmarks != marks):
                            marks, next_mark = self._bookmarks, now + self.bookmark_interval
                            meta = {"resourceVersion": str(last)}
                            mark = {
                                "kind": res.kind,
                                "apiVersion": res.group_version,
                                "metadata": meta,
                            }
                            events.append({"type": "BOOKMARK", "object": mark})
                        if not events and not end:
                            self._cond.wait(
                                min(deadline, next_mark if bookmarks else deadline) - now
                            )
                yield from events

        return stream(last, marks)

    def _events(self, res: Resource, ns: str, match: Callable[[Obj], bool], last: int) -> list[Obj]:
        """The events after ``last`` a watch of (res, ns, selector) sees: an object that comes into
        the selector as ADDED, one that leaves it as DELETED."""
        events = []
        first = bisect.bisect_right(self._history, last, key=lambda e: e[0])
        for _, kind, r, obj, before in self._history[first:]:
            if r != res or ns not in ("", obj["metadata"].get("namespace")):
                continue
            now_in, was_in = match(obj), before is not None and match(before)
            shown = (
                kind if kind != "MODIFIED" or now_in == was_in else "ADDED" if now_in else "DELETED"
            )
            if now_in or (was_in and shown == "DELETED"):
                events.append({"type": shown, "object": obj})
        return events

    def _discovery(self, path: str) -> Obj | None:
        path = path.rstrip("/")
        gvs = list(dict.fromkeys(r.group_version for r in RESOURCES))
        groups: list[Obj] = []
        for gv in gvs[1:]:  # gvs[0]: "v1", the core group, is /api's
            version = {"groupVersion": gv, "version": gv.split("/")[1]}
            groups.append(
                {"name": gv.split("/")[0], "versions": [version], "preferredVersion": version}
            )
        if path == "/version":
            return {
                "major": "1",
                "minor": "32",
                "gitVersion": "v1.32.0-stub",
                "platform": "linux/amd64",
            }
        if path == "/api":
            address = [
                {"clientCIDR": "0.0.0.0/0", "serverAddress": self.url.removeprefix("http://")}
            ]
            return {
                "kind": "APIVersions",
                "versions": ["v1"],
                "serverAddressByClientCIDRs": address,
            }
        if path == "/apis":
            return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}
        if path.startswith("/apis/") and path.count("/") == 2:
            named = [g for g in groups if g["name"] == path[6:]]
            return {"kind": "APIGroup", "apiVersion": "v1", **named[0]} if named else None
        gv = (
            "v1"
            if path == "/api/v1"
            else path.removeprefix("/apis/")
            if path.startswith("/apis/")
            else ""
        )
        if gv not in gvs:
            return None
        resources: list[Obj] = []
        for r in (r for r in RESOURCES if r.group_version == gv):
            verbs = [
                "create",
                "delete",
                "deletecollection",
                "get",
                "list",
                "patch",
                "update",
                "watch",
            ]
            one = {
                "name": r.name,
                "singularName": r.kind.lower(),
                "namespaced": r.namespaced,
                "kind": r.kind,
            }
            resources.append({**one, "verbs": verbs, "shortNames": list(r.short_names)})
            if r.has_status:
                status_verbs = ["get", "patch", "update"]
                resources.append(
                    {**one, "name": f"{r.name}/status", "singularName": "", "verbs": status_verbs}
                )
        if gv == "v1":  # kubectl drain evicts (rather than deletes) when it finds this
            eviction = {
                "name": "pods/eviction",
                "singularName": "",
                "namespaced": True,
                "kind": "Eviction",
            }
            resources.append({**eviction, "group": "policy", "version": "v1", "verbs": ["create"]})
        return {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": gv,
            "resources": resources,
        }


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    stub: StubApiServer


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, and chunked watch streams

    @property
    def stub(self) -> StubApiServer:
        return cast(_HTTPServer, self.server).stub

    def setup(self) -> None:
        super().setup()
        # else 40 ms a request
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.stub._connections.add(self.connection)

    def finish(self) -> None:
        self.stub._connections.discard(self.connection)
        super().finish()

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _serve(self) -> None:
        url, stub = urlsplit(self.path), self.stub
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            doc = stub._discovery(url.path) if self.command == "GET" else None
            if doc is not None:
                return self._send(200, doc)
            res, ns, name, sub = stub._route(url.path)
            watch = self.command == "GET" and not name and query.get("watch") in ("true", "1")
            read = "get" if name else "watch" if watch else "list"
            verbs = {"GET": read, "POST": "create", "PUT": "update", "PATCH": "patch"}
            verb = verbs.get(self.command) or ("delete" if name else "deletecollection")
            with stub._cond:
                stub.requests.append(Call(verb, res.group, res.name, sub, ns))
            if watch:
                return self._stream(stub._watch(res, ns, query))
            body = json.loads(raw) if raw else None
            self._send(
                *stub._handle(
                    self.command, url.path, query, body, self.headers["Content-Type"] or ""
                )
            )
        except ApiError as e:
            self._send(e.status["code"], e.status)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            self._send(400, ApiError(400, "BadRequest", f"bad request: {e!r}").status)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _serve

    def _send(self, code: int, doc: Obj) -> None:
        data = json.dumps(doc).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _stream(self, events: Iterator[Obj]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for event in events:
                data = json.dumps(event).encode() + b"\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.write(b"0\r\n\r\n")
        except OSError:  # the client went away
            self.close_connection = True
