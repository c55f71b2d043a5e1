"""The one gateway to an ElasticRun on the API server, for the handler and the operator.

Every read, write and watch of a run, and of its Leases and slices, goes through
:class:`RunGateway`; the handler depends only on :class:`RunAccess`, the
interface it implements, and the operator's executor only on
:class:`OperatorAccess` (per run :class:`RunControl`, plus the run's own
objects and Events, :class:`OperatorGateway`), so both executors run in unit
tests against an in-memory fake that keeps the API server's contract
(``tests/fakegateway.py``).  The gateways build the request bodies (the
status compare-and-set, the announce patch, an annotation removal) and
:class:`RunGateway` answers the outcomes that are part of the protocol:
``None`` means "someone else wrote first" (409), "a test of the patch failed"
(422) or "no such run" (404), depending on the call.  Every other failure is
raised as :class:`~elasticrun.api.kube.ApiError` or
:class:`~elasticrun.api.kube.ApiConnectionError`, for the caller's policy
(:mod:`elasticrun.api.policy`) to retry or report.

Synchronous, like :class:`~elasticrun.api.kube.KubeClient`; the operator calls
it from a worker thread.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol

from elasticrun.api import crd, rounds
from elasticrun.api.kube import (
    APPLY_PATCH,
    JSON,
    JSON_PATCH,
    MERGE_PATCH,
    METADATA_ONLY,
    ApiError,
    KubeClient,
    Watch,
    delete_preconditions,
    events_path,
    lease_path,
    leases_path,
    run_path,
    runs_path,
)
from elasticrun.api.leases import leases_of, run_leases_query
from elasticrun.api.model import (
    FINISHED_PHASES,
    PHASES,
    RunSpec,
    RunStatus,
    new_run_manifest,
)
from elasticrun.api.naming import lease_name
from elasticrun.api.slices import slices_path


def status_body(namespace: str, name: str, resource_version: str | None,
                status: Mapping[str, Any]) -> dict[str, Any]:
    """The body of a status compare-and-set: the whole status, fenced by ``resource_version``."""
    return {"apiVersion": crd.API_VERSION, "kind": crd.KIND,
            "metadata": {"name": name, "namespace": namespace,
                         "resourceVersion": resource_version},
            "status": dict(status)}


def signal_selector(run: str, signal: int) -> str:
    """The field selector of the full watch (:meth:`RunGateway.watch_run`): run ``run``
    once its ``status.signal`` has moved off ``signal``, the one a node has seen (a run
    without the field matches too)."""
    return f"metadata.name={run},status.signal!={signal}"


def round_selector(run: str, round_number: int) -> str:
    """The field selector of a member's quiet watch (:meth:`RunGateway.watch_round`): run
    ``run`` once its round ``round_number`` is disturbed (``status.stableRound`` moved off
    it; an old writer's status without the field matches too)."""
    return f"metadata.name={run},status.stableRound!={round_number}"


def settled_selector(run: str) -> str:
    """The field selector of a member rejoining a run told by broadcast
    (:meth:`RunGateway.watch_settled`): run ``run`` once no round of it is disturbed,
    ``status.stableRound`` off 0: a newer round sealed, or the run ended (an ended run
    keeps its round's number)."""
    return f"metadata.name={run},status.stableRound!=0"


def end_selector(run: str) -> str:
    """The field selector of a rejoining member's watch (:meth:`RunGateway.watch_end`): run
    ``run`` once it has ended, its phase one of ``FINISHED_PHASES`` (a selector's terms
    all hold, so it names every other phase as one it is not)."""
    others = ",".join(f"status.phase!={phase}" for phase in PHASES
                      if phase not in FINISHED_PHASES)
    return f"metadata.name={run},{others}"


def announce_patch(status: RunStatus) -> list[dict[str, Any]]:
    """Bump ``signal`` once for this round's ``joinNotice``; conflicts only with another notice.

    The ``test`` operations make the patch fail (422) when the counters moved
    since ``status`` was read: the members then hear about the waiting node
    with that other change.
    """
    told = rounds.announced(status)
    return [
        {"op": "test", "path": "/status/joinNotice", "value": status.join_notice},
        {"op": "test", "path": "/status/signal", "value": status.signal},
        {"op": "replace", "path": "/status/joinNotice", "value": told.join_notice},
        {"op": "replace", "path": "/status/signal", "value": told.signal},
        # A round announced to is disturbed (RunStatus.stable_round): "add" sets the
        # field whether or not the writer before us wrote it.
        {"op": "add", "path": "/status/stableRound", "value": told.stable_round},
    ]


def annotations_removal(names: Iterable[str]) -> dict[str, Any]:
    """The merge patch that removes the run's annotations ``names``."""
    return {"metadata": {"annotations": dict.fromkeys(names)}}


class EventStream(Protocol):
    """One watch: its events (``{"type": ..., "object": ...}``) in order until the server
    ends it; :meth:`close` may be called from another thread to end it early."""

    def __iter__(self) -> Iterator[dict[str, Any]]: ...

    def close(self) -> None: ...


class RunAccess(Protocol):
    """What a node may do to its run, its run's Leases and slices: every request of the
    handler.

    ``None`` and ``False`` answers are the protocol outcomes named per method;
    every other failure raises :class:`~elasticrun.api.kube.ApiError` or
    :class:`~elasticrun.api.kube.ApiConnectionError`.  The node's own Lease is
    named by its node (:func:`~elasticrun.api.naming.lease_name`).
    """

    @property
    def namespace(self) -> str: ...

    @property
    def name(self) -> str: ...

    @property
    def host(self) -> str: ...

    def read(self, not_older_than: str | None = None) -> dict[str, Any] | None: ...

    def create(self, spec: RunSpec) -> dict[str, Any] | None: ...

    def close(self) -> None: ...

    def replace_status(self, resource_version: str | None, status: Mapping[str, Any],
                       manager: str) -> dict[str, Any] | None: ...

    def announce(self, status: RunStatus) -> dict[str, Any] | None: ...

    def watch_run(self, signal: int, resource_version: str | None,
                  timeout_seconds: int) -> EventStream: ...

    def watch_round(self, round_number: int, timeout_seconds: int, whole: bool = False
                    ) -> EventStream: ...

    def watch_end(self, timeout_seconds: int) -> EventStream: ...

    def watch_settled(self, timeout_seconds: int) -> EventStream: ...

    def leases(self) -> list[dict[str, Any]]: ...

    def lease(self, node: str) -> dict[str, Any] | None: ...

    def listed_lease(self, node: str) -> dict[str, Any] | None: ...

    def create_lease(self, manifest: Mapping[str, Any]) -> dict[str, Any] | None: ...

    def replace_lease(self, node: str, manifest: Mapping[str, Any]) -> dict[str, Any]: ...

    def patch_lease(self, node: str, patch: Mapping[str, Any],
                    timeout: float | None = None) -> dict[str, Any] | None: ...

    def delete_lease(self, node: str, timeout: float | None = None) -> bool: ...

    def watch_slice(self, name: str, resource_version: str | None,
                    timeout_seconds: int) -> EventStream: ...


def readable_lease(access: RunAccess, node: str) -> dict[str, Any] | None:
    """``node``'s Lease in the run, by a GET, or where the node may not ``get`` it, by a
    LIST selecting its name; None when there is none.

    A GET is read from etcd at once.  A LIST without a resourceVersion is
    served by the watch cache once that holds etcd's newest revision, and when
    the newest write was not a Lease's (the seal, just before a member checks
    its rank 0's store, is a status write) the Lease cache learns it only from
    etcd's next progress notification, which the API server asks for every
    100 ms: such a LIST waited 90 ms in a formation of 8 nodes that took 0.17 s.
    A per-run Role grants ``get`` on a Lease by name once the operator has seen
    it, ``list`` at once; so a node that may not ``get`` it yet lists it.
    """
    try:
        return access.lease(node)
    except ApiError as exc:
        if not exc.forbidden:
            raise
    return access.listed_lease(node)


class RunControl(Protocol):
    """What the operator does to one run and its Leases: every per-run request of its
    executor (:class:`RunGateway`; in unit tests the in-memory fake).

    Outcomes as :class:`RunAccess`'s; a Lease is named by its object name
    (``lease_path``), as the operator observed it, never by a node's.
    """

    @property
    def path(self) -> str: ...

    def read(self) -> dict[str, Any] | None: ...

    def replace_status(self, resource_version: str | None, status: Mapping[str, Any],
                       manager: str) -> dict[str, Any] | None: ...

    def remove_annotations(self, names: Iterable[str]) -> None: ...

    def leases(self) -> list[dict[str, Any]]: ...

    def lease_path(self, lease: str) -> str: ...


class OperatorAccess(Protocol):
    """Every request of the operator's executor: per run (:meth:`run`), and the run's own
    objects beside it and its Events, named by path.  Failures are raised
    (:class:`~elasticrun.api.kube.ApiError`,
    :class:`~elasticrun.api.kube.ApiConnectionError`) for the caller to judge."""

    def run(self, namespace: str, name: str) -> RunControl: ...

    def apply(self, path: str, manifest: Mapping[str, Any], manager: str) -> None: ...

    def delete(self, path: str, uid: str | None = None) -> None: ...

    def post_event(self, namespace: str, event: Mapping[str, Any]) -> None: ...


class OperatorGateway:
    """:class:`OperatorAccess` over one client (the operator's, fenced under leader
    election): a :class:`RunGateway` per run, server-side apply, DELETE, Event POST."""

    def __init__(self, client: KubeClient) -> None:
        self.client = client

    def run(self, namespace: str, name: str) -> RunGateway:
        return RunGateway(self.client, namespace, name)

    def apply(self, path: str, manifest: Mapping[str, Any], manager: str) -> None:
        """Server-side apply of ``manifest`` as field manager ``manager``, taking over
        fields another manager set (``force``)."""
        self.client.request("PATCH", path, body=manifest,
                            query={"fieldManager": manager, "force": "true"},
                            content_type=APPLY_PATCH)

    def delete(self, path: str, uid: str | None = None) -> None:
        """DELETE the object at ``path``; with ``uid``, that object only (another object
        of the same name is left, and the server answers 409)."""
        self.client.request("DELETE", path, body=delete_preconditions(uid) if uid else None)

    def post_event(self, namespace: str, event: Mapping[str, Any]) -> None:
        self.client.request("POST", events_path(namespace), body=event)


class RunGateway:
    """One ElasticRun (``namespace``/``name``), its Leases and its slices, over one client:
    :class:`RunAccess` over HTTP, plus the operator's removal of annotations."""

    def __init__(self, client: KubeClient, namespace: str, name: str) -> None:
        self.client = client
        self.namespace = namespace
        self.name = name

    @property
    def path(self) -> str:
        return run_path(self.namespace, self.name)

    @property
    def host(self) -> str:
        return self.client.credentials.host

    # ------------------------------------------------------------------ the run

    def read(self, not_older_than: str | None = None) -> dict[str, Any] | None:
        """The run as stored; None when there is none.

        ``not_older_than``: a resourceVersion the answer must be at least as new
        as, which lets the API server answer from its watch cache instead of
        reading etcd (a member's read after its quiet watch's event, sent by
        hundreds of members at once).
        """
        query = {"resourceVersion": not_older_than} if not_older_than else None
        try:
            return self.client.request("GET", run_path(self.namespace, self.name), query=query)
        except ApiError as exc:
            if exc.not_found:
                return None
            raise

    def create(self, spec: RunSpec) -> dict[str, Any] | None:
        """Create the run with ``spec``; None when it exists already."""
        manifest = new_run_manifest(self.name, self.namespace, spec)
        try:
            return self.client.request("POST", runs_path(self.namespace), body=manifest)
        except ApiError as exc:
            if exc.conflict:
                return None
            raise

    def close(self) -> None:
        """Set ``spec.closed``: the operator, and every node, treat the run as finished."""
        self.client.request("PATCH", run_path(self.namespace, self.name),
                            body={"spec": {"closed": True}}, content_type=MERGE_PATCH)

    def remove_annotations(self, names: Iterable[str]) -> None:
        self.client.request("PATCH", run_path(self.namespace, self.name),
                            body=annotations_removal(names), content_type=MERGE_PATCH)

    def replace_status(self, resource_version: str | None, status: Mapping[str, Any],
                       manager: str) -> dict[str, Any] | None:
        """Compare-and-set of the whole status; None when someone wrote first (409)."""
        body = status_body(self.namespace, self.name, resource_version, status)
        try:
            return self.client.request("PUT", run_path(self.namespace, self.name, "status"),
                                       body=body, query={"fieldManager": manager})
        except ApiError as exc:
            if exc.conflict:
                return None
            raise

    def announce(self, status: RunStatus) -> dict[str, Any] | None:
        """Apply :func:`announce_patch`; None when a test failed (the counters moved).

        The API server reports a failed test only as a 422 "the server rejected
        our request due to an error in our request", with no details; the patch
        is built here and is valid, so a 422 means a test failed.
        """
        try:
            return self.client.request(
                "PATCH", run_path(self.namespace, self.name, "status"),
                body=announce_patch(status), content_type=JSON_PATCH)
        except ApiError as exc:
            if exc.status == 422:
                return None
            raise

    def watch_run(self, signal: int, resource_version: str | None,
                  timeout_seconds: int) -> Watch:
        """The narrow watch: the run's events once its ``status.signal`` is not ``signal``
        (:func:`signal_selector`).

        While the signal stays, the run does not match the selector and the
        server sends nothing; it ends the watch after ``timeout_seconds``.
        """
        return self.client.watch(runs_path(self.namespace),
                                 {"fieldSelector": signal_selector(self.name, signal),
                                  "resourceVersion": resource_version}, timeout_seconds)

    def watch_round(self, round_number: int, timeout_seconds: int, whole: bool = False
                    ) -> Watch:
        """The quiet watch of a member of round ``round_number``: the run's metadata once
        its ``status.stableRound`` is not that round (:attr:`RunStatus.stable_round`).

        Metadata only, so an event costs the same at any size of the roster;
        ``whole``: the whole run instead, where the member's place may be kept
        (:func:`~elasticrun.api.rounds.members_keep_places`) and it needs the run
        to find it, encoded once for every member watching, where a read after
        the event would be encoded once per member.  From
        no resourceVersion, so the server first sends the run as it is now if it
        matches already (the round was disturbed before the watch opened), and
        nothing while the round stays undisturbed.
        """
        return self.client.watch(runs_path(self.namespace),
                                 {"fieldSelector": round_selector(self.name, round_number)},
                                 timeout_seconds, accept=JSON if whole else METADATA_ONLY)

    def watch_end(self, timeout_seconds: int) -> Watch:
        """The watch of a member rejoining from a copy of the run older than its round's
        disturbance: the run's metadata once it has ended (closed or finished,
        :func:`end_selector`), from now.

        A signal watch from that copy's signal would match every later status
        write and send each the whole run; this one sends nothing until the run
        ends, and then one event of metadata, after which the member reads the
        run once.
        """
        return self.client.watch(runs_path(self.namespace),
                                 {"fieldSelector": end_selector(self.name)},
                                 timeout_seconds, accept=METADATA_ONLY)

    def watch_settled(self, timeout_seconds: int) -> Watch:
        """The watch of a member rejoining a run whose seal moves the signal, from a copy
        older than its round's disturbance: the whole run once a newer round is
        sealed or the run has ended (:func:`settled_selector`), from now.

        A watch from that copy's signal would first send every rejoining member the
        disturbance itself, one more copy of the whole run each; this one sends
        nothing while the run re-forms, then the run that settled, once.
        """
        return self.client.watch(runs_path(self.namespace),
                                 {"fieldSelector": settled_selector(self.name)},
                                 timeout_seconds)

    # ------------------------------------------------------------------ its Leases

    def leases(self) -> list[dict[str, Any]]:
        """The run's Leases, from one consistent LIST (served by the watch cache)."""
        listed = self.client.request("GET", leases_path(self.namespace),
                                     query=run_leases_query(self.name))
        return leases_of(listed, self.name)

    def lease(self, node: str) -> dict[str, Any] | None:
        """``node``'s Lease in this run; None when there is none."""
        try:
            return self.client.request("GET", self.lease_path(lease_name(self.name, node)))
        except ApiError as exc:
            if exc.not_found:
                return None
            raise

    def listed_lease(self, node: str) -> dict[str, Any] | None:
        """``node``'s Lease in this run, read by a LIST selecting its name; None if none.

        A per-run Role grants ``get`` on a Lease by name once the operator has
        seen it, and ``list`` at once: a member checking its rank 0's store
        right after the seal may not have ``get`` on that Lease yet.
        """
        listed = self.client.request("GET", leases_path(self.namespace), query={
            "fieldSelector": f"metadata.name={lease_name(self.name, node)}"})
        items = listed.get("items")
        found = items[0] if isinstance(items, list) and len(items) == 1 else None
        return found if isinstance(found, dict) else None

    def lease_path(self, lease: str) -> str:
        return lease_path(self.namespace, lease)

    # ------------------------------------------------------------------ a node's own Lease

    def create_lease(self, manifest: Mapping[str, Any]) -> dict[str, Any] | None:
        """Create a Lease; None when its name is taken (409)."""
        try:
            return self.client.request("POST", leases_path(self.namespace), body=manifest)
        except ApiError as exc:
            if exc.conflict:
                return None
            raise

    def replace_lease(self, node: str, manifest: Mapping[str, Any]) -> dict[str, Any]:
        """Replace ``node``'s Lease, fenced by the manifest's resourceVersion."""
        return self.client.request("PUT", self.lease_path(lease_name(self.name, node)),
                                   body=manifest)

    def patch_lease(self, node: str, patch: Mapping[str, Any],
                    timeout: float | None = None) -> dict[str, Any] | None:
        """Merge ``patch`` into ``node``'s Lease; None when there is no such Lease (404)."""
        try:
            return self.client.request("PATCH", self.lease_path(lease_name(self.name, node)),
                                       body=patch, content_type=MERGE_PATCH, timeout=timeout)
        except ApiError as exc:
            if exc.not_found:
                return None
            raise

    def delete_lease(self, node: str, timeout: float | None = None) -> bool:
        """Delete ``node``'s Lease; False when there was none (404)."""
        try:
            self.client.request("DELETE", self.lease_path(lease_name(self.name, node)),
                                timeout=timeout)
        except ApiError as exc:
            if exc.not_found:
                return False
            raise
        return True

    # ------------------------------------------------------------------ its slices

    def watch_slice(self, name: str, resource_version: str | None,
                    timeout_seconds: int) -> Watch:
        """The run's slice ``name``'s events (selected by name, which the API server's
        watch cache dispatches by name) after ``resource_version``; from None, the
        server starts with the slice as it is (:mod:`elasticrun.api.slices`)."""
        return self.client.watch(slices_path(self.namespace),
                                 {"fieldSelector": f"metadata.name={name}",
                                  "resourceVersion": resource_version}, timeout_seconds)
