"""``K8sRendezvousHandler``: torch's elastic rendezvous over an ElasticRun's status.

One round, as a node sees it:

1. **Join** — the node writes its request (address, store port, time) into an
   annotation of its own Lease: one write to an object nobody else writes, so
   joins never contend (see :mod:`elasticrun.api.leases` for the measurement
   that chose this over entries in the ElasticRun).  One consistent LIST of
   the run's Leases then tells it who else is waiting.
2. **Seal** — when the rules in :mod:`elasticrun.api.rounds` say so (max
   reached, all survivors back, last call passed), one compare-and-set replaces
   the ElasticRun's status: waiting nodes become participants with ranks,
   ``round`` and ``signal`` move.  Whoever's request made the rule true tries;
   losers watch.  The operator does the same from its Lease index as a
   backstop, so a round completes with or without it.
3. **Wait** — on the narrow watch of :mod:`.watcher`, never by polling.

A node that joins beside a running round bumps ``signal`` once per round (a
JSON-patch ``test`` on the counters, so it conflicts only with another such
notice), which is how the members' ``num_nodes_waiting()`` becomes positive.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from torch.distributed import PrefixStore, Store
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from elasticrun.api import crd, rounds
from elasticrun.api.kube import (
    JSON_PATCH,
    ApiConnectionError,
    ApiError,
    KubeClient,
    leases_path,
    load_credentials,
    run_path,
    runs_path,
)
from elasticrun.api.leases import lease_state, leases_of, pending_joins, run_leases_query
from elasticrun.api.model import (
    ElasticRun,
    InvalidRunError,
    RunStatus,
    WaitingNode,
    new_run_manifest,
    now,
    parse_run,
)
from elasticrun.handler import settings as settings_mod
from elasticrun.handler.lease import LeaseKeeper, NodeNameInUseError
from elasticrun.handler.settings import RendezvousSettings
from elasticrun.handler.store import StoreHost, connect
from elasticrun.handler.watcher import RunDeletedError, RunWatcher, newer

log = logging.getLogger(__name__)

BACKEND = "k8s"
SEAL_MANAGER = "elasticrun-seal"
#: Stagger between nodes that all hold a last-call timer, so that one seals and
#: the rest see its signal before their own timer fires.
LAST_CALL_STAGGER = 0.05
RETRY_DELAYS = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0)

_T = TypeVar("_T")


class ElasticRunForbiddenError(RendezvousError):
    """The node's ServiceAccount lacks a permission the rendezvous needs."""


class K8sRendezvousHandler(RendezvousHandler):
    """A torch ``RendezvousHandler`` whose shared state is an ElasticRun."""

    def __init__(self, settings: RendezvousSettings, client: KubeClient | None = None) -> None:
        self.settings = settings
        self._client = client
        self._watcher: RunWatcher | None = None
        self._lease: LeaseKeeper | None = None
        self._store_host: StoreHost | None = None
        self._retired_store: StoreHost | None = None
        self._store_clients: dict[tuple[str, int], Store] = {}
        self._round = 0
        self._mismatch_logged = False
        self._lock = threading.Lock()
        self._closing = False

    # ------------------------------------------------------------------ torch API

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True

    def get_run_id(self) -> str:
        return self.settings.run_name

    def next_rendezvous(self) -> RendezvousInfo:
        with self._lock:
            run = self._start()
            join_deadline = time.monotonic() + run.spec.join_timeout
            previous_round = self._round
            self._fresh_store()
            self._join(run)
            pending = self._pending(run)
            assert self._watcher is not None
            self._watcher.start()
            node = self.settings.node_name
            while True:
                self._raise_if_closed(run)
                me = run.status.participant(node)
                if me is not None and run.status.round > previous_round:
                    return self._complete(run, me.rank)
                if all(w.name != node for w in pending):
                    # Our request is gone (the Lease was removed or expired): ask again.
                    self._join(run)
                    pending = self._pending(run)
                    continue
                view = run.replace_status(run.status.replace(waiting=pending))
                decision = rounds.decide_seal(view, now())
                if decision.seal_now:
                    run = self._seal(view, decision.reason) or self._read_or_raise()
                    pending = self._pending(run)
                    continue
                run = self._announce_if_needed(view)
                wake_at = join_deadline
                if decision.deadline is not None:
                    stagger = LAST_CALL_STAGGER * self._arrival_index(view)
                    wait = (decision.deadline - now()).total_seconds() + stagger
                    wake_at = min(wake_at, time.monotonic() + max(0.0, wait))
                if time.monotonic() >= join_deadline:
                    self._leave_waiting()
                    raise RendezvousTimeoutError(
                        f"{self._who()}: no round formed within the join timeout "
                        f"({run.spec.join_timeout}s); {len(pending)} of at least "
                        f"{run.spec.min_nodes} nodes were waiting. Check that the other nodes "
                        f"are starting (kubectl get er {self.settings.run_name} -n "
                        f"{self.settings.namespace})")
                changed = self._wait_for_change(run, wake_at)
                if changed is not run:
                    run = changed
                    mine = run.status.participant(node)
                    if mine is None or run.status.round <= previous_round:
                        pending = self._pending(run)

    def is_closed(self) -> bool:
        run = self._cached_or_read()
        return run is not None and run.closed

    def set_closed(self) -> None:
        """Close the run for everybody; waiting and late nodes get RendezvousClosedError."""
        client = self._api()
        path = run_path(self.settings.namespace, self.settings.run_name)
        self._call("close the run", lambda: client.request(
            "PATCH", path, body={"spec": {"closed": True}},
            content_type="application/merge-patch+json"), self.settings.close_timeout)
        # Bump the signal ourselves so that waiting nodes hear it even with no operator.
        for _ in range(len(RETRY_DELAYS)):
            run = self._read()
            if run is None or run.status.phase == "Closed":
                return
            status = run.status.replace(phase="Closed", signal=run.status.signal + 1,
                                        finished_at=run.status.finished_at or now())
            if self._replace_status(run, status) is not None:
                return

    def num_nodes_waiting(self) -> int:
        watcher = self._watcher
        run = watcher.latest if watcher else None
        if run is None or self._round == 0:
            return 0
        return rounds.nodes_waiting(run, self._round)

    def shutdown(self) -> bool:
        """Leave the membership; never close the run for the others.

        A ``next_rendezvous()`` still blocked in this handler (a spare, say) is
        woken and fails with RendezvousClosedError instead of holding us up.
        """
        self._closing = True
        if self._watcher is not None:
            self._watcher.stop()
        locked = self._lock.acquire(timeout=self.settings.close_timeout)
        try:
            # Our join request goes first, so no node can take it for a new one
            # once we have left; the Lease goes last, so the operator never sees
            # a member without one (it would record a loss, not a departure).
            # If the request cannot be withdrawn, the Lease goes first instead.
            lease = self._lease
            if lease is not None and not lease.withdraw_join(self.settings.close_timeout):
                lease.release(self.settings.close_timeout)
                lease = None
            try:
                self._leave_membership()
            except RendezvousError as exc:
                log.warning("%s: leaving the membership failed: %s", self._who(), exc)
            if lease is not None:
                lease.release(self.settings.close_timeout)
            for host in (self._retired_store, self._store_host):
                if host is not None:
                    host.close()
            self._retired_store = self._store_host = None
            self._round = 0
        finally:
            if locked:
                self._lock.release()
        return True

    # ------------------------------------------------------------------ set-up

    def _who(self) -> str:
        s = self.settings
        return f"rendezvous {s.namespace}/{s.run_name}, node {s.node_name!r}"

    def _api(self) -> KubeClient:
        if self._client is None:
            try:
                credentials = load_credentials(self.settings.kubeconfig, self.settings.context)
            except Exception as exc:
                raise RendezvousConnectionError(
                    f"{self._who()}: no Kubernetes credentials ({exc}); run inside a pod with a "
                    "ServiceAccount, or set KUBECONFIG or --rdzv-conf kubeconfig=PATH") from exc
            if self.settings.api_server:
                credentials = type(credentials)(**{**credentials.__dict__,
                                                   "host": self.settings.api_server})
            self._client = KubeClient(credentials, self.settings.request_timeout)
        return self._client

    def _start(self) -> ElasticRun:
        """Read (or create) the run, and start the watch, store and lease once."""
        watcher = self._watcher
        if watcher is not None and watcher.latest is not None:
            try:
                watcher.check()
                return watcher.latest
            except (RunDeletedError, InvalidRunError):
                pass  # read it afresh below
        raw = self._ensure_run()
        if watcher is None:
            watcher = self._watcher = RunWatcher(self._api(), self.settings.namespace,
                                                 self.settings.run_name,
                                                 self.settings.watch_timeout)
        run = self._accept(raw)
        if self._lease is None:
            self._lease = LeaseKeeper(self._api(), self.settings.namespace,
                                      self.settings.run_name, self.settings.node_name,
                                      run.spec.heartbeat_timeout, run.spec.lease_renew_interval,
                                      run.uid, on_deleted=watcher.recheck)
        return run

    def _fresh_store(self) -> None:
        """A new TCPStore server for every round this node may lead.

        torchrun's workers share the agent's store and key their process group
        by restart count only (``/worker/attempt_N``).  A node restarted because
        a peer was lost keeps its count while a node whose workers failed bumps
        it, so a store that outlives a round hands new workers the addresses of
        dead ones (pytorch/pytorch#135712).  A fresh server per round starts
        every worker group from an empty store; the previous one is kept until
        the next round so nothing still holding it breaks mid-call.
        """
        old, self._store_host = self._store_host, None
        if old is not None and self.settings.store_port:
            old.close()  # a pinned port can serve one store at a time
            old = None
        if self._retired_store is not None:
            self._retired_store.close()
        self._retired_store = old
        self._store_host = StoreHost(self.settings.address, self.settings.store_port)
        self._store_clients.clear()

    def _ensure_run(self) -> dict[str, Any]:
        s = self.settings
        client = self._api()
        path = run_path(s.namespace, s.run_name)
        raw: dict[str, Any] | None
        try:
            raw = self._call("read the run", lambda: client.request("GET", path))
        except _NotFoundError:
            raw = None
        if raw is None:
            if not s.create_run:
                raise RendezvousStateError(
                    f"{self._who()}: ElasticRun {s.namespace}/{s.run_name} does not exist and "
                    "creating it is disabled (create_run=false); create it first: kubectl apply "
                    "-f an ElasticRun manifest")
            manifest = new_run_manifest(s.run_name, s.namespace, s.requested_spec)
            try:
                raw = self._call("create the run", lambda: client.request(
                    "POST", runs_path(s.namespace), body=manifest))
                log.info("%s: created ElasticRun from the command line (%s)", self._who(),
                         s.requested_spec)
            except _ConflictError:
                raw = self._call("read the run", lambda: client.request("GET", path))
        self._log_spec_mismatch(self._accept(raw))
        return raw

    def _log_spec_mismatch(self, run: ElasticRun) -> None:
        if self._mismatch_logged:
            return
        asked = self.settings.requested_spec
        if (asked.min_nodes, asked.max_nodes) != (run.spec.min_nodes, run.spec.max_nodes):
            log.warning("%s: --nnodes=%d:%d differs from the ElasticRun's spec (%d:%d); the spec "
                        "wins", self._who(), asked.min_nodes, asked.max_nodes,
                        run.spec.min_nodes, run.spec.max_nodes)
            self._mismatch_logged = True

    # ------------------------------------------------------------------ operations

    def _my_entry(self) -> WaitingNode:
        return WaitingNode(name=self.settings.node_name, address=self.settings.address,
                           store_port=self._store_host.port if self._store_host else None,
                           since=now(), pod=self.settings.pod)

    def _join(self, run: ElasticRun) -> None:
        """Ask for the next round: one write to our own Lease, never contended."""
        self._raise_if_closed(run)
        lease = self._lease
        assert lease is not None
        entry = self._my_entry()
        try:
            if lease.acquired:
                self._call("join the run", lambda: lease.set_join(entry))
            else:
                self._call("take the node's Lease", lambda: lease.acquire(entry))
                lease.start()
        except NodeNameInUseError as exc:
            raise RendezvousError(f"{self._who()}: {exc}") from exc

    def _pending(self, run: ElasticRun) -> tuple[WaitingNode, ...]:
        """The join requests no round has answered yet, read from the run's Leases.

        One consistent LIST, served by the API server's watch cache: the node
        whose request completed the set sees every earlier one.
        """
        s = self.settings
        listed = self._call("list the run's Leases", lambda: self._api().request(
            "GET", leases_path(s.namespace), query=run_leases_query(s.run_name)))
        states = [lease_state(item) for item in leases_of(listed, s.run_name)]
        return pending_joins(states, run.status, now(), run.uid, run.spec.heartbeat_timeout)

    def _seal(self, view: ElasticRun, reason: str) -> ElasticRun | None:
        """One compare-and-set; None when someone else wrote first."""
        written = self._replace_status(view, rounds.seal_round(view, now()))
        if written is not None:
            log.info("%s: sealed round %d with %d nodes (%s)", self._who(), written.status.round,
                     len(written.status.participants), reason)
        return written

    def _announce_if_needed(self, run: ElasticRun) -> ElasticRun:
        """Tell the members of a running round, once per round, that a node is waiting.

        ``run`` is the view with the pending joins; the run returned is as stored.
        """
        status = run.status
        if status.round == 0 or status.degraded or status.join_notice >= status.round:
            return run
        if rounds.nodes_waiting(run, status.round) == 0:
            return run  # a spare beside a full round: members have nothing to do
        patch = [
            {"op": "test", "path": "/status/joinNotice", "value": status.join_notice},
            {"op": "test", "path": "/status/signal", "value": status.signal},
            {"op": "replace", "path": "/status/joinNotice", "value": status.round},
            {"op": "replace", "path": "/status/signal", "value": status.signal + 1},
        ]
        try:
            raw = self._call("announce a waiting node", lambda: self._api().request(
                "PATCH", run_path(self.settings.namespace, self.settings.run_name, "status"),
                body=patch, content_type=JSON_PATCH), test_patch=True)
        except _RejectedError:
            # A test failed: the signal moved after our entry was written, so the
            # members hear about us with that change.
            return self._read_or_raise()
        return self._accept(raw)

    def _leave_waiting(self) -> None:
        """Withdraw our join request (clear the annotation on our Lease)."""
        lease = self._lease
        if lease is None or not lease.acquired:
            return
        try:
            self._call("leave the waiting list", lambda: lease.set_join(None),
                       self.settings.close_timeout)
        except (_NotFoundError, RendezvousError) as exc:
            log.debug("leaving the waiting list: %s", exc)

    def _leave_membership(self) -> None:
        if self._client is None or self._watcher is None:
            return
        deadline = time.monotonic() + self.settings.close_timeout
        attempt = 0
        while time.monotonic() < deadline:
            run = self._read()
            if run is None:
                return
            status = rounds.remove_member(run.status, self.settings.node_name, "Left", now(),
                                          message="the agent shut down")
            if status is None:
                return
            if self._replace_status(run, status) is not None:
                return
            time.sleep(random.uniform(0, RETRY_DELAYS[min(attempt, len(RETRY_DELAYS) - 1)]))
            attempt += 1

    def _complete(self, run: ElasticRun, rank: int) -> RendezvousInfo:
        status = run.status
        self._round = status.round
        if status.store is None:
            raise RendezvousStateError(f"{self._who()}: round {status.round} was sealed without "
                                       "a store address (status.store); the rank-0 node did not "
                                       "publish its TCPStore port")
        host, port = status.store.host, status.store.port
        assert self._store_host is not None
        base: Store
        if rank == 0 and port == self._store_host.port:
            base = self._store_host.store
        else:
            base = self._store_clients.get((host, port)) or self._connect_store(host, port)
        store = PrefixStore(f"torch.rendezvous.{self.settings.run_name}.{status.round}", base)
        log.info("%s: round %d, rank %d of %d, store %s:%d", self._who(), status.round, rank,
                 len(status.participants), host, port)
        return RendezvousInfo(store, rank, len(status.participants),
                              RendezvousStoreInfo(master_addr=host, master_port=port))

    def _connect_store(self, host: str, port: int) -> Store:
        try:
            store = connect(host, port, timeout=max(60.0, self.settings.api_timeout))
        except (RuntimeError, OSError) as exc:
            raise RendezvousConnectionError(
                f"{self._who()}: cannot reach rank 0's TCPStore at {host}:{port}: {exc}. Check "
                "that pods can reach each other on that port (NetworkPolicy)") from exc
        self._store_clients = {(host, port): store}
        return store

    # ------------------------------------------------------------------ waiting and reading

    def _arrival_index(self, run: ElasticRun) -> int:
        ordered = rounds.order_for_ranks(run.status.participants, run.status.waiting)
        names = [w.name for w in ordered]
        name = self.settings.node_name
        return names.index(name) if name in names else len(names)

    def _wait_for_change(self, run: ElasticRun, wake_at: float) -> ElasticRun:
        watcher = self._watcher
        assert watcher is not None
        seen = watcher.version
        latest = watcher.latest
        if latest is not None and newer(latest.resource_version, run.resource_version):
            return latest
        watcher.wait(seen, wake_at - time.monotonic())
        if self._closing:
            raise RendezvousClosedError(f"{self._who()}: the agent is shutting down")
        self._check_watcher(watcher)
        if time.monotonic() >= wake_at - 1e-3:
            # A timer (last call, join deadline) fired: look at the newest state once.
            return self._read_or_raise()
        latest = watcher.latest
        if latest is not None and newer(latest.resource_version, run.resource_version):
            return latest
        return run

    def _check_watcher(self, watcher: RunWatcher) -> None:
        try:
            watcher.check()
        except RunDeletedError as exc:
            raise RendezvousClosedError(f"{self._who()}: {exc} while this node was waiting; "
                                        "re-create it to start a new run") from exc
        except InvalidRunError as exc:
            raise RendezvousStateError(f"{self._who()}: cannot read the ElasticRun: {exc}. "
                                       "The status was probably edited by hand") from exc
        if watcher.disconnected_for > self.settings.api_timeout:
            raise RendezvousConnectionError(
                f"{self._who()}: lost the watch on the API server for more than "
                f"{self.settings.api_timeout:.0f}s (api_timeout)")

    def _raise_if_closed(self, run: ElasticRun) -> None:
        if run.closed:
            self._leave_waiting()
            raise RendezvousClosedError(f"{self._who()}: the run is closed "
                                        f"(phase {run.status.phase}, spec.closed="
                                        f"{str(run.spec.closed).lower()})")

    def _cached_or_read(self) -> ElasticRun | None:
        watcher = self._watcher
        if watcher is not None and watcher.latest is not None:
            return watcher.latest
        return self._read()

    def _read(self) -> ElasticRun | None:
        try:
            raw = self._call("read the run", lambda: self._api().request(
                "GET", run_path(self.settings.namespace, self.settings.run_name)))
        except _NotFoundError:
            return None
        return self._accept(raw)

    def _read_or_raise(self) -> ElasticRun:
        run = self._read()
        if run is None:
            raise RendezvousClosedError(f"{self._who()}: the ElasticRun was deleted while this "
                                        "node was waiting; re-create it to start a new run")
        return run

    def _replace_status(self, run: ElasticRun, status: RunStatus) -> ElasticRun | None:
        """Compare-and-set of the whole status; None when someone wrote first."""
        s = self.settings
        body = {"apiVersion": crd.API_VERSION, "kind": crd.KIND,
                "metadata": {"name": s.run_name, "namespace": s.namespace,
                             "resourceVersion": run.resource_version},
                "status": status.to_dict()}
        try:
            raw = self._call("update the run status", lambda: self._api().request(
                "PUT", run_path(s.namespace, s.run_name, "status"), body=body,
                query={"fieldManager": SEAL_MANAGER}))
        except _ConflictError:
            return None
        return self._accept(raw)

    def _accept(self, raw: dict[str, Any]) -> ElasticRun:
        """Parse what the API server returned, and keep it if it is the newest we know."""
        try:
            if self._watcher is not None:
                return self._watcher.offer(raw)
            return parse_run(raw)
        except InvalidRunError as exc:
            raise RendezvousStateError(f"{self._who()}: cannot read the ElasticRun: {exc}. The "
                                       "status was probably edited by hand") from exc

    def _call(self, what: str, action: Callable[[], _T], bound: float | None = None,
              test_patch: bool = False) -> _T:
        """Run one API call, retrying outages for up to ``api_timeout`` seconds.

        The error raised says which run and node, what we were doing, and what to check.
        ``test_patch``: the call is a JSON patch with ``test`` operations, and any 422
        means a test failed.  The API server says so only as "the server rejected our
        request due to an error in our request", with no details, so the message
        alone cannot tell a failed test from a bad request.
        """
        bound = self.settings.api_timeout if bound is None else bound
        deadline = time.monotonic() + bound
        attempt = 0
        while True:
            try:
                return action()
            except ApiConnectionError as exc:
                error: Exception = exc
            except ApiError as exc:
                if exc.not_found:
                    raise _NotFoundError(str(exc)) from exc
                if exc.conflict:
                    raise _ConflictError(str(exc)) from exc
                if exc.status == 422 and (test_patch or "test" in exc.message.lower()):
                    raise _RejectedError(str(exc)) from exc
                if exc.forbidden:
                    raise ElasticRunForbiddenError(
                        f"{self._who()}: not allowed to {what}: {exc.message}. Bind the pod's "
                        "ServiceAccount to the elasticrun training Role (get/list/watch/create/"
                        "patch/update on elasticruns and elasticruns/status, and leases)") from exc
                if exc.status in (429, 500, 502, 503, 504):
                    error = exc
                else:
                    raise RendezvousStateError(f"{self._who()}: the API server refused to "
                                               f"{what}: {exc}") from exc
            if time.monotonic() + RETRY_DELAYS[min(attempt, len(RETRY_DELAYS) - 1)] > deadline:
                raise RendezvousConnectionError(
                    f"{self._who()}: cannot {what}: the Kubernetes API server "
                    f"({self._api().credentials.host}) did not answer within {bound:.0f}s: "
                    f"{error}. Check that it is reachable from the pod and that KUBECONFIG or "
                    "the in-cluster configuration is right") from error
            time.sleep(RETRY_DELAYS[min(attempt, len(RETRY_DELAYS) - 1)])
            attempt += 1


class _NotFoundError(Exception):
    pass


class _ConflictError(Exception):
    pass


class _RejectedError(Exception):
    pass


def create_handler(params: RendezvousParameters) -> K8sRendezvousHandler:
    """The creator torch registers for ``--rdzv-backend=k8s``."""
    try:
        settings = settings_mod.from_parameters(
            run_id=params.run_id, endpoint=params.endpoint, min_nodes=params.min_nodes,
            max_nodes=params.max_nodes, local_addr=params.local_addr, conf=dict(params.config))
    except settings_mod.SettingsError as exc:
        raise ValueError(f"k8s rendezvous: {exc}") from exc
    return K8sRendezvousHandler(settings)
