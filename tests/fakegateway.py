"""An in-memory API server and gateways: the handler's and the operator's, without one.

torch tests its rendezvous executor through a fake state holder; this is ours.
:class:`FakeApiServer` holds the runs and Leases of one namespace (and the
objects the operator keeps beside a run, and Events, by their request path)
and keeps the parts of the API server's contract the node and the operator
rely on:

- every write gives the object a new ``resourceVersion``, strictly increasing
  across all objects (etcd's revision);
- a write fenced by a ``resourceVersion`` that is not the stored one is a 409,
  a write of a missing object a 404, a create of an existing name a 409;
- a run's status is written only through its status (a create drops it);
- a merge patch naming another ``metadata.uid`` is a 422 (a uid is
  immutable), a DELETE whose ``preconditions.uid`` is not the object's a 409;
  a server-side apply creates the object or replaces it, keeping its uid;
- a JSON patch applies all or nothing, and a ``test`` of a value that differs,
  or of a field that is missing, fails the patch with a 422;
- watches deliver ADDED/MODIFIED/DELETED in resourceVersion order, from a
  given ``resourceVersion`` (never the state as of it) or, from none, the
  object as it is first; a field selector that stops matching is a DELETED
  of the object as it now is, one that starts matching an ADDED; a watch
  from a ``resourceVersion`` older than the kept history gets a 410 ERROR
  event (:meth:`FakeApiServer.compact`); the server ends a watch after its
  ``timeout_seconds``.

:class:`FakeGateway` is one client's view of one run (each node holds its
own; :class:`~elasticrun.api.gateway.RunAccess`, and the operator's
:class:`~elasticrun.api.gateway.RunControl`), answering the protocol outcomes
exactly as :class:`~elasticrun.api.gateway.RunGateway` does (409 of a seal,
422 of an announce, 404 of a read as ``None`` or ``False``).  :class:`FakeOperatorGateway` is the
operator's :class:`~elasticrun.api.gateway.OperatorAccess`: one
:class:`FakeGateway` per run, applies, deletions and Events.  Their fault
injection (:meth:`Faults.fail_next`, :meth:`Faults.on_next`) fails or
interleaves the next calls of one method, or of every method (``"*"``).
An unset ``status.signal`` is compared as ``""`` by the narrow watch's
selector (the API server's value for a missing selectable field), and so is an
unset ``status.stableRound`` by a member's quiet watch (``watch_round``), whose
events carry the run's metadata only, as ``PartialObjectMetadata``.
"""

from __future__ import annotations

import builtins
import copy
import itertools
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar
from urllib.parse import unquote

from elasticrun.api import crd
from elasticrun.api.gateway import (
    OperatorAccess,
    RunAccess,
    RunControl,
    annotations_removal,
    announce_patch,
    end_selector,
    round_selector,
    settled_selector,
    signal_selector,
    status_body,
)
from elasticrun.api.kube import (
    ApiConnectionError,
    ApiError,
    events_path,
    lease_path,
    leases_path,
    run_path,
    runs_path,
)
from elasticrun.api.leases import leases_of
from elasticrun.api.model import RunSpec, RunStatus, new_run_manifest
from elasticrun.api.naming import label_value, lease_name
from elasticrun.api.slices import slices_path

RUN, LEASE = "run", "lease"
#: (kind, name): RUN or LEASE, else the collection's path (``.../roles``, ``.../events``).
Key = tuple[str, str]
#: Whether a watch wants an object (as stored, or None once deleted).
Selector = Callable[[dict[str, Any] | None], bool]
Fault = Literal["connection", "conflict"]
_T = TypeVar("_T")
#: The error statuses :class:`~elasticrun.api.gateway.RunGateway` answers as None or False.
NOT_FOUND, CONFLICT, TEST_FAILED = frozenset({404}), frozenset({409}), frozenset({422})


def api_error(status: int, reason: str, message: str) -> ApiError:
    """The error the real client raises for an error status."""
    return ApiError(status, reason, message, {"kind": "Status", "code": status,
                                              "reason": reason, "message": message})


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge, ``None`` removes a key, anything else replaces."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    merged = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = merge_patch(merged.get(key), value)
    return merged


def field_selected(obj: dict[str, Any] | None, selector: str) -> bool:
    """Whether ``obj`` matches a field selector of ``path=value`` and ``path!=value`` terms,
    all of which must hold; a missing field is ``""``, as the API server compares it."""
    if obj is None:
        return False
    for term in selector.split(","):
        path, unequal, value = term.partition("!=")
        if not unequal:
            path, _, value = term.partition("=")
        field_value: Any = obj
        for part in path.split("."):
            field_value = field_value.get(part, "") if isinstance(field_value, dict) else ""
        text = str(field_value).lower() if isinstance(field_value, bool) else str(field_value)
        if (text == value) == bool(unequal):
            return False
    return True


def json_patch(target: dict[str, Any], operations: list[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902 ``test``, ``replace`` and ``add`` on object paths, all or nothing; 422 if
    one fails (``add`` sets a member of an existing object, present or not)."""
    patched = copy.deepcopy(target)
    for op in operations:
        *parents, last = [part for part in op["path"].split("/") if part]
        node: Any = patched
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if op["op"] == "add" and isinstance(node, dict):
            node[last] = copy.deepcopy(op["value"])
            continue
        if not isinstance(node, dict) or last not in node:
            raise api_error(422, "Invalid", f"{op['op']} {op['path']}: no such field")
        if op["op"] == "test" and node[last] != op["value"]:
            raise api_error(422, "Invalid", f"test {op['path']}: the value differs")
        if op["op"] == "replace":
            node[last] = copy.deepcopy(op["value"])
        elif op["op"] != "test":
            raise api_error(422, "Invalid", f"unsupported operation {op['op']}")
    return patched


@dataclass(eq=False)
class FakeWatch:
    """One open watch: the events queued for it, until closed or its time is up."""

    server: FakeApiServer
    key: Key
    selector: Selector
    ends_at: float
    events: deque[dict[str, Any]] = field(default_factory=deque)
    closed: bool = False
    #: Events carry the object's metadata only (``Accept: ...as=PartialObjectMetadata``).
    metadata_only: bool = False

    def shown(self, obj: dict[str, Any] | None) -> dict[str, Any] | None:
        """``obj`` as this watch's events carry it."""
        if not self.metadata_only or obj is None:
            return copy.deepcopy(obj)
        return {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                "metadata": copy.deepcopy(obj.get("metadata") or {})}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        cond = self.server.cond
        while True:
            with cond:
                while not self.events and not self.closed:
                    remaining = self.ends_at - time.monotonic()
                    if remaining <= 0:
                        self.closed = True
                        break
                    cond.wait(remaining)
                if not self.events:
                    self.server.watches.discard(self)
                    return
                event = self.events.popleft()
            yield event

    def close(self) -> None:
        with self.server.cond:
            self.closed = True
            self.events.clear()
            self.server.watches.discard(self)
            self.server.cond.notify_all()

    def offer(self, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        """Queue what a change of the object means to this watch's selector, if anything."""
        was, now = old is not None and self.selector(old), new is not None and self.selector(new)
        if now:
            self.events.append({"type": "MODIFIED" if was else "ADDED",
                                "object": self.shown(new)})
        elif was:
            self.events.append({"type": "DELETED", "object": self.shown(new or old)})


class FakeApiServer:
    """The runs and Leases of one namespace, as the API server would keep them."""

    def __init__(self, namespace: str = "ns") -> None:
        self.namespace = namespace
        self.cond = threading.Condition()
        self.objects: dict[Key, dict[str, Any]] = {}
        #: Every change since the last compaction: (resourceVersion, key, old, new).
        self.history: list[tuple[int, Key, dict[str, Any] | None, dict[str, Any] | None]] = []
        self.compacted_at = 0
        self.watches: set[FakeWatch] = set()
        self._revision = itertools.count(1)
        self._uids = itertools.count(1)
        self._generated = itertools.count(1)

    # ------------------------------------------------------------------ storage

    def get(self, key: Key) -> dict[str, Any]:
        with self.cond:
            stored = self.objects.get(key)
            if stored is None:
                raise api_error(404, "NotFound", f"{key[0]} {key[1]!r} not found")
            return copy.deepcopy(stored)

    def list(self, kind: str) -> list[dict[str, Any]]:
        with self.cond:
            return [copy.deepcopy(obj) for (k, _), obj in self.objects.items() if k == kind]

    def create(self, key: Key, obj: Mapping[str, Any]) -> dict[str, Any]:
        with self.cond:
            if key in self.objects:
                raise api_error(409, "AlreadyExists", f"{key[0]} {key[1]!r} already exists")
            stored = copy.deepcopy(dict(obj))
            meta = stored.setdefault("metadata", {})
            meta["uid"] = f"uid-{next(self._uids)}"
            meta.setdefault("namespace", self.namespace)
            return self._store(key, None, stored)

    def update(self, key: Key, change: Callable[[dict[str, Any]], dict[str, Any]],
               resource_version: str | None = None) -> dict[str, Any]:
        """``change`` applied to the stored object, fenced by ``resource_version`` if given."""
        with self.cond:
            old = self.objects.get(key)
            if old is None:
                raise api_error(404, "NotFound", f"{key[0]} {key[1]!r} not found")
            if resource_version is not None \
                    and resource_version != old["metadata"]["resourceVersion"]:
                raise api_error(409, "Conflict", f"the object {key[1]!r} has been modified; "
                                "please apply your changes to the latest version")
            new = change(copy.deepcopy(old))
            new["metadata"] = {**new.get("metadata", {}), "uid": old["metadata"]["uid"],
                               "name": key[1]}
            return self._store(key, old, new)

    def merge(self, key: Key, patch: Mapping[str, Any]) -> dict[str, Any]:
        """A merge patch (RFC 7386), unfenced; one naming another ``metadata.uid`` is a 422
        (a uid is immutable), which is how a patch lands on the object with that uid only."""
        uid = (patch.get("metadata") or {}).get("uid")

        def change(stored: dict[str, Any]) -> dict[str, Any]:
            if uid is not None and uid != stored["metadata"]["uid"]:
                raise api_error(422, "Invalid", f"{key[0]} {key[1]!r} is invalid: metadata.uid: "
                                f"Invalid value: {uid!r}: field is immutable")
            merged: dict[str, Any] = merge_patch(stored, patch)
            return merged

        return self.update(key, change)

    def apply(self, key: Key, manifest: Mapping[str, Any], manager: str) -> dict[str, Any]:
        """Server-side apply, forced: the object becomes ``manifest`` (created if missing;
        its uid kept if not), with ``manager`` as the one field manager."""
        body = copy.deepcopy(dict(manifest))
        body.setdefault("metadata", {})["managedFields"] = [
            {"manager": manager, "operation": "Apply"}]
        with self.cond:
            if key not in self.objects:
                return self.create(key, body)
            return self.update(key, lambda _: body)

    def post(self, collection: str, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Create ``obj`` in ``collection`` (a path), named by its ``generateName`` plus a
        suffix when it has no name, as an Event is."""
        body = copy.deepcopy(dict(obj))
        meta = body.setdefault("metadata", {})
        if not meta.get("name"):
            meta["name"] = f"{meta.get('generateName', '')}{next(self._generated):05d}"
        return self.create((collection, meta["name"]), body)

    def delete(self, key: Key, uid: str | None = None) -> dict[str, Any]:
        """Remove the object (with ``uid`` only, when given: another one is a 409, as the
        API server answers a DELETE's ``preconditions.uid``); what was stored."""
        with self.cond:
            old = self.objects.get(key)
            if old is None:
                raise api_error(404, "NotFound", f"{key[0]} {key[1]!r} not found")
            if uid is not None and uid != old["metadata"]["uid"]:
                raise api_error(409, "Conflict", f"Precondition failed: UID in precondition: "
                                f"{uid}, UID in object meta: {old['metadata']['uid']}")
            del self.objects[key]
            revision = next(self._revision)
            self.history.append((revision, key, old, None))
            self._notify(key, old, None)
            return copy.deepcopy(old)

    def _store(self, key: Key, old: dict[str, Any] | None,
               new: dict[str, Any]) -> dict[str, Any]:
        revision = next(self._revision)
        new["metadata"]["resourceVersion"] = str(revision)
        self.objects[key] = new
        self.history.append((revision, key, old, new))
        self._notify(key, old, new)
        return copy.deepcopy(new)

    def _notify(self, key: Key, old: dict[str, Any] | None,
                new: dict[str, Any] | None) -> None:
        for watch in self.watches:
            if watch.key == key:
                watch.offer(old, new)
        self.cond.notify_all()

    def end_watches(self) -> None:
        """The server ends every open watch (a restart, say): each stream stops after the
        events already queued, as if its time were up."""
        with self.cond:
            for watch in self.watches:
                watch.closed = True
            self.watches.clear()
            self.cond.notify_all()

    def compact(self) -> None:
        """Forget the history: a watch from an older resourceVersion gets a 410."""
        with self.cond:
            self.history.clear()
            self.compacted_at = next(self._revision)

    # ------------------------------------------------------------------ watches

    def watch(self, key: Key, selector: Selector, resource_version: str | None,
              timeout_seconds: float, metadata_only: bool = False) -> FakeWatch:
        with self.cond:
            watch = FakeWatch(self, key, selector, time.monotonic() + timeout_seconds,
                              metadata_only=metadata_only)
            if resource_version is None:
                current = self.objects.get(key)
                if current is not None and selector(current):
                    watch.events.append({"type": "ADDED", "object": watch.shown(current)})
            elif int(resource_version) < self.compacted_at:
                watch.events.append({"type": "ERROR", "object": {
                    "kind": "Status", "code": 410, "reason": "Expired",
                    "message": f"too old resource version: {resource_version}"}})
                watch.closed = True
                return watch
            else:
                for revision, changed, old, new in self.history:
                    if changed == key and revision > int(resource_version):
                        watch.offer(old, new)
            self.watches.add(watch)
            return watch

    # ------------------------------------------------------------------ test helpers

    def key_of(self, path: str) -> Key:
        """The object a request path names: a run, a Lease, else (collection, name)."""
        collection, _, name = path.rpartition("/")
        name = unquote(name)
        if collection == runs_path(self.namespace):
            return (RUN, name)
        if collection == leases_path(self.namespace):
            return (LEASE, name)
        return (collection, name)

    def events(self) -> builtins.list[dict[str, Any]]:
        """The Events posted in the namespace, in the order they were."""
        return self.list(events_path(self.namespace))

    def seed_run(self, name: str, spec: RunSpec, status: RunStatus | None = None
                 ) -> dict[str, Any]:
        """A run as the operator leaves it: created, then its first status written."""
        self.create((RUN, name), new_run_manifest(name, self.namespace, spec))
        first = (status or RunStatus()).to_dict()
        return self.update((RUN, name), lambda run: {**run, "status": first})

    def run(self, name: str) -> dict[str, Any]:
        return self.get((RUN, name))

    def lease_of(self, run: str, node: str) -> dict[str, Any] | None:
        with self.cond:
            stored = self.objects.get((LEASE, lease_name(run, node)))
            return copy.deepcopy(stored) if stored is not None else None


class Faults:
    """One client's fault injection and request counts, by method name (the gateway's)."""

    host = "https://fake-apiserver"

    def __init__(self) -> None:
        #: Calls made, by method name (faulted ones included), and those that got past the
        #: faults to the server.
        self.calls: Counter[str] = Counter()
        self.reached: Counter[str] = Counter()
        self._faults: dict[str, deque[Fault]] = {}
        self._hooks: dict[str, deque[Callable[[], None]]] = {}
        self._lock = threading.Lock()  # the operator's requests come from many threads

    def fail_next(self, method: str, times: int = 1, error: Fault = "connection") -> None:
        """The next ``times`` calls of ``method`` (``"*"``: of any method) fail with ``error``:
        an unreachable server, or a 409 (which a method answers as the real gateway does)."""
        with self._lock:
            self._faults.setdefault(method, deque()).extend([error] * times)

    def heal(self) -> None:
        """Drop every fault not yet used."""
        with self._lock:
            self._faults.clear()

    def on_next(self, method: str, action: Callable[[], None]) -> None:
        """Run ``action`` just before the next call of ``method`` reaches the server
        (another writer's request landing in between, say)."""
        with self._lock:
            self._hooks.setdefault(method, deque()).append(action)

    def _request(self, method: str) -> None:
        with self._lock:
            self.calls[method] += 1
            hooks = self._hooks.get(method)
            hook = hooks.popleft() if hooks else None
        if hook is not None:
            hook()
        with self._lock:
            fault = None
            for queue in (self._faults.get(method), self._faults.get("*")):
                if queue:
                    fault = queue.popleft()
                    break
            if fault is None:
                self.reached[method] += 1
        if fault == "conflict":
            raise api_error(409, "Conflict", f"{method}: injected conflict")
        if fault == "connection":
            raise ApiConnectionError(f"{method} {self.host}: injected connection error")

    def _answer(self, method: str, action: Callable[[], _T],
                answered: frozenset[int] = frozenset()) -> _T | None:
        """``action`` as a request of ``method``; None for an error status the real gateway
        answers itself (``answered``), every other failure raised."""
        try:
            self._request(method)
            return action()
        except ApiError as exc:
            if exc.status in answered:
                return None
            raise


class FakeGateway(Faults):
    """One client's :class:`~elasticrun.api.gateway.RunAccess` to run ``name`` on ``server``,
    and the operator's :class:`~elasticrun.api.gateway.RunControl` of it."""

    def __init__(self, server: FakeApiServer, name: str) -> None:
        super().__init__()
        self.server = server
        self.namespace = server.namespace
        self.name = name
        #: The ``not_older_than`` of each read, in order.
        self.read_versions: list[str | None] = []

    # ------------------------------------------------------------------ the run

    def read(self, not_older_than: str | None = None) -> dict[str, Any] | None:
        """The run as it is now, which is never older than any version it had."""
        self.read_versions.append(not_older_than)
        return self._answer("read", lambda: self.server.get(self._run), NOT_FOUND)

    def create(self, spec: RunSpec) -> dict[str, Any] | None:
        manifest = new_run_manifest(self.name, self.namespace, spec)
        return self._answer("create", lambda: self.server.create(self._run, manifest), CONFLICT)

    def close(self) -> None:
        self._answer("close", lambda: self.server.merge(self._run, {"spec": {"closed": True}}))

    def remove_annotations(self, names: Iterable[str]) -> None:
        patch = annotations_removal(names)
        self._answer("remove_annotations", lambda: self.server.merge(self._run, patch))

    def replace_status(self, resource_version: str | None, status: Mapping[str, Any],
                       manager: str) -> dict[str, Any] | None:
        body = status_body(self.namespace, self.name, resource_version, status)

        def write() -> dict[str, Any]:
            if resource_version is None:  # a custom resource is never updated unconditionally
                raise api_error(422, "Invalid", "metadata.resourceVersion: must be specified")
            return self.server.update(self._run, lambda run: {**run, "status": body["status"]},
                                      resource_version)

        return self._answer("replace_status", write, CONFLICT)

    def announce(self, status: RunStatus) -> dict[str, Any] | None:
        patch = announce_patch(status)
        return self._answer("announce", lambda: self.server.update(
            self._run, lambda run: json_patch(run, patch)), TEST_FAILED)

    def watch_run(self, signal: int, resource_version: str | None,
                  timeout_seconds: int) -> FakeWatch:
        """As the real one: the whole run, from ``resource_version``, while it matches
        :func:`~elasticrun.api.gateway.signal_selector`, read as the API server reads it."""
        self._request("watch_run")
        selector = signal_selector(self.name, signal)
        return self.server.watch(self._run, lambda run: field_selected(run, selector),
                                 resource_version, timeout_seconds)

    def watch_round(self, round_number: int, timeout_seconds: int, whole: bool = False
                    ) -> FakeWatch:
        """As the real one: metadata only (``whole``: the whole run), from now, while the run
        matches :func:`~elasticrun.api.gateway.round_selector`, read as the API server reads it."""
        self._request("watch_round")
        selector = round_selector(self.name, round_number)
        return self.server.watch(self._run, lambda run: field_selected(run, selector), None,
                                 timeout_seconds, metadata_only=not whole)

    def watch_settled(self, timeout_seconds: int) -> FakeWatch:
        """As the real one: the whole run, from now, while it matches
        :func:`~elasticrun.api.gateway.settled_selector`, read as the API server reads it."""
        self._request("watch_settled")
        selector = settled_selector(self.name)
        return self.server.watch(self._run, lambda run: field_selected(run, selector), None,
                                 timeout_seconds)

    def watch_end(self, timeout_seconds: int) -> FakeWatch:
        """As the real one: metadata only, from now, while the run matches
        :func:`~elasticrun.api.gateway.end_selector`, read as the API server reads it."""
        self._request("watch_end")
        selector = end_selector(self.name)
        return self.server.watch(self._run, lambda run: field_selected(run, selector), None,
                                 timeout_seconds, metadata_only=True)

    # ------------------------------------------------------------------ its Leases

    @property
    def path(self) -> str:
        return run_path(self.namespace, self.name)

    @property
    def _run(self) -> Key:
        return (RUN, self.name)

    def _lease(self, node: str) -> Key:
        return (LEASE, lease_name(self.name, node))

    def leases(self) -> list[dict[str, Any]]:
        self._request("leases")
        label = label_value(self.name)
        items = [lease for lease in self.server.list(LEASE)
                 if lease.get("metadata", {}).get("labels", {}).get(crd.RUN_LABEL) == label]
        return leases_of({"items": items}, self.name)

    def lease(self, node: str) -> dict[str, Any] | None:
        return self._answer("lease", lambda: self.server.get(self._lease(node)), NOT_FOUND)

    def listed_lease(self, node: str) -> dict[str, Any] | None:
        self._request("listed_lease")
        wanted = lease_name(self.name, node)
        found = [lease for lease in self.server.list(LEASE)
                 if lease["metadata"]["name"] == wanted]
        return found[0] if len(found) == 1 else None

    def create_lease(self, manifest: Mapping[str, Any]) -> dict[str, Any] | None:
        key = (LEASE, str(manifest["metadata"]["name"]))
        return self._answer("create_lease", lambda: self.server.create(key, manifest), CONFLICT)

    def replace_lease(self, node: str, manifest: Mapping[str, Any]) -> dict[str, Any]:
        body = copy.deepcopy(dict(manifest))
        replaced = self._answer("replace_lease", lambda: self.server.update(
            self._lease(node), lambda _: body, body.get("metadata", {}).get("resourceVersion")))
        assert replaced is not None
        return replaced

    def patch_lease(self, node: str, patch: Mapping[str, Any],
                    timeout: float | None = None) -> dict[str, Any] | None:
        return self._answer("patch_lease", lambda: self.server.merge(self._lease(node), patch),
                            NOT_FOUND)

    def delete_lease(self, node: str, timeout: float | None = None) -> bool:
        return self._answer("delete_lease", lambda: self.server.delete(self._lease(node)),
                            NOT_FOUND) is not None

    def watch_slice(self, name: str, resource_version: str | None,
                    timeout_seconds: int) -> FakeWatch:
        self._request("watch_slice")
        return self.server.watch((slices_path(self.namespace), name), lambda _: True,
                                 resource_version, timeout_seconds)

    def lease_path(self, lease: str) -> str:
        return lease_path(self.namespace, lease)


class FakeOperatorGateway(Faults):
    """The operator's :class:`~elasticrun.api.gateway.OperatorAccess` on ``server``: one
    :class:`FakeGateway` per run, the same each time (its faults and counts are the run's
    requests), and the run's own objects and Events, named by path as the API server's."""

    def __init__(self, server: FakeApiServer) -> None:
        super().__init__()
        self.server = server
        self.runs: dict[tuple[str, str], FakeGateway] = {}

    def run(self, namespace: str, name: str) -> FakeGateway:
        assert namespace == self.server.namespace, "the fake holds one namespace"
        with self._lock:
            return self.runs.setdefault((namespace, name), FakeGateway(self.server, name))

    def apply(self, path: str, manifest: Mapping[str, Any], manager: str) -> None:
        self._answer("apply", lambda: self.server.apply(self.server.key_of(path), manifest,
                                                        manager))

    def delete(self, path: str, uid: str | None = None) -> None:
        self._answer("delete", lambda: self.server.delete(self.server.key_of(path), uid))

    def post_event(self, namespace: str, event: Mapping[str, Any]) -> None:
        self._answer("post_event", lambda: self.server.post(events_path(namespace), event))


def _implements(gateway: FakeGateway, operator: FakeOperatorGateway
                ) -> tuple[RunAccess, RunControl, OperatorAccess]:
    """mypy checks here that the fakes have every method of the interfaces, typed alike."""
    return gateway, gateway, operator
