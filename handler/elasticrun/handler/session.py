"""A node's link to its run: gateway calls under the handler's policy, and the watch cache.

Every copy of the run the node reads or writes passes through :meth:`RunSession.accept`,
so the watcher's cache always holds the newest one and a round that went back
is refused wherever it shows up.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousStateError,
)

from elasticrun.api import rounds
from elasticrun.api.gateway import RunAccess
from elasticrun.api.leases import LeaseState, RenewalClock, lease_state, pending_joins
from elasticrun.api.model import ElasticRun, InvalidRunError, RunSpec, RunStatus, WaitingNode, now
from elasticrun.api.ordering import newer
from elasticrun.handler.calls import ApiCalls, who
from elasticrun.handler.settings import RendezvousSettings
from elasticrun.handler.watcher import RunDeletedError, RunWatcher

log = logging.getLogger(__name__)

#: Field manager of the status writes nodes make (seal, leave, close).
SEAL_MANAGER = "elasticrun-seal"


class RunSession:
    def __init__(self, settings: RendezvousSettings, gateway: RunAccess) -> None:
        self.settings = settings
        self.gateway = gateway
        self.call = ApiCalls(settings, gateway.host)
        self.watcher = RunWatcher(gateway, settings.watch_timeout)
        self._mismatch_logged = False
        #: When this node saw each of the run's Leases renewed, by its own clock, across
        #: every LIST and GET of the session: other nodes' clocks are not ours.
        self.renewals = RenewalClock()
        #: The run's Leases as this node's last LIST of them showed them, by node.
        self.listed: dict[str, dict[str, Any]] = {}

    @property
    def who(self) -> str:
        return who(self.settings)

    # ------------------------------------------------------------------ reading

    def accept(self, raw: dict[str, Any]) -> ElasticRun:
        """Parse what the API server returned, and keep it if it is the newest we know."""
        try:
            return self.watcher.offer(raw)
        except InvalidRunError as exc:
            raise RendezvousStateError(f"{self.who}: cannot read the ElasticRun: {exc}. The "
                                       "status was probably edited by hand") from exc

    def read(self, bound: float | None = None, not_older_than: str | None = None
             ) -> ElasticRun | None:
        raw = self.call("read the run", lambda: self.gateway.read(not_older_than), bound)
        return None if raw is None else self.accept(raw)

    def read_or_raise(self, not_older_than: str | None = None) -> ElasticRun:
        run = self.read(not_older_than=not_older_than)
        if run is None:
            raise RendezvousClosedError(f"{self.who}: the ElasticRun was deleted while this "
                                        "node was waiting; re-create it to start a new run")
        return run

    def newest(self, run: ElasticRun, round_number: int) -> ElasticRun:
        """The newest copy of the run the node holds (``run`` if none is newer), read
        afresh, no older than the quiet watch's event, once that watch said round
        ``round_number`` is disturbed since that copy: a node reaching the store of
        a round it was told in its slice otherwise holds a copy from before it."""
        watcher = self.watcher
        latest = watcher.latest or run
        woken = watcher.disturbed_version if watcher.disturbed(round_number) else None
        if woken is not None and newer(woken, latest.resource_version):
            return self.read_or_raise(woken)
        return latest

    def cached_or_read(self) -> ElasticRun | None:
        return self.watcher.latest or self.read()

    def current(self) -> tuple[ElasticRun, str | None]:
        """The run a call starts from, and the resourceVersion of a disturbance of its
        round that this copy does not show yet (None: the copy is current).

        A member told by its quiet watch that its round is disturbed rejoins
        from the copy it holds, without reading the run; the executor watches it
        as a stale copy is watched (:meth:`follow`) once it asks again.  (Where
        places are kept the quiet watch's event is the whole run, so the copy is
        current; one left older reads the run first, ``step.Read``.)  Otherwise
        the cached run if the watch trusts it, else the run read (or created)
        afresh, watched fully.
        """
        watcher = self.watcher
        woken, held = watcher.disturbed_version, watcher.latest
        if held is not None and woken is not None and newer(woken, held.resource_version):
            self.check_watch()
            return held, woken
        watcher.watch_fully()
        if held is not None:
            try:
                watcher.check()
                return held, None
            except (RunDeletedError, InvalidRunError):
                pass  # read it afresh below
        return self.accept(self.ensure_run()), None

    def follow(self, spec: RunSpec, *, stale: bool, holding: int = 0) -> None:
        """Watch the run the way that fits what this node holds: the one rule for it.

        * Quietly (:meth:`RunWatcher.watch_quietly`), for round ``holding`` of a
          large run (:func:`~elasticrun.api.rounds.members_watch_quietly`): one
          event, of metadata only, when the round is disturbed, instead of the
          roster on every change (:mod:`elasticrun.handler.watcher`).  Not in
          in-place mode, whose follower acts on the run it watches.
        * While the node's copy is older than the disturbance that woke it
          (:attr:`.step.Knowledge.stale`), for the run to settle
          (:meth:`RunWatcher.watch_for_settled`): the next round's seal, or the
          run's end, sent once.  Where the operator tells members their places
          in slices (:func:`~elasticrun.api.rounds.members_told_in_slices`),
          for the run's end only (:meth:`RunWatcher.watch_for_end`): there the
          seal leaves the signal alone so that no member is sent the roster.
        * Else fully, from the cached copy (:meth:`RunWatcher.watch_fully`).
        """
        watcher = self.watcher
        if holding and rounds.members_watch_quietly(spec) and not self.settings.in_place:
            watcher.watch_quietly(holding, whole=rounds.members_keep_places(spec))
        elif stale and rounds.members_told_in_slices(spec):
            watcher.watch_for_end()
        elif stale:
            watcher.watch_for_settled()
        else:
            watcher.watch_fully()

    def ensure_run(self) -> dict[str, Any]:
        """The run as stored, created from the command line's spec if there is none."""
        s = self.settings
        raw = self.call("read the run", self.gateway.read)
        if raw is None:
            if not s.create_run:
                raise RendezvousStateError(
                    f"{self.who}: ElasticRun {s.namespace}/{s.run_name} does not exist and "
                    "creating it is disabled (create_run=false); create it first: kubectl apply "
                    "-f an ElasticRun manifest")
            raw = self.call("create the run", lambda: self.gateway.create(s.requested_spec))
            if raw is None:
                raw = self.call("read the run", self.gateway.read)
            else:
                log.info("%s: created ElasticRun from the command line (%s)", self.who,
                         s.requested_spec)
            if raw is None:
                raise RendezvousClosedError(f"{self.who}: the ElasticRun was deleted as "
                                            "this node created it")
        self._log_spec_mismatch(self.accept(raw))
        return raw

    def _log_spec_mismatch(self, run: ElasticRun) -> None:
        if self._mismatch_logged:
            return
        asked = self.settings.requested_spec
        if (asked.min_nodes, asked.max_nodes) != (run.spec.min_nodes, run.spec.max_nodes):
            log.warning("%s: --nnodes=%d:%d differs from the ElasticRun's spec (%d:%d); the spec "
                        "wins", self.who, asked.min_nodes, asked.max_nodes,
                        run.spec.min_nodes, run.spec.max_nodes)
            self._mismatch_logged = True

    def pending(self, run: ElasticRun) -> tuple[WaitingNode, ...]:
        """The join requests no round has answered yet, from one consistent LIST of Leases.

        The node whose request completed the set sees every earlier one.  A Lease
        counts as live by when this node saw it renewed (:meth:`observe`).
        """
        items = self.call("list the run's Leases", self.gateway.leases)
        states = [self.observe(lease_state(item)) for item in items]
        self.listed = {s.node: item for s, item in zip(states, items, strict=True) if s.node}
        names = {s.node for s in states}
        self.renewals.retain(lambda node: node in names)
        return pending_joins(states, run.status, now(), run.uid, run.spec.heartbeat_timeout)

    def observe(self, state: LeaseState) -> LeaseState:
        """``state`` timed by this node's clock: when it first saw its current renewal."""
        return self.renewals.observe(state.node, state, now()) if state.node else state

    # ------------------------------------------------------------------ writing

    def replace_status(self, run: ElasticRun, status: RunStatus,
                       bound: float | None = None) -> ElasticRun | None:
        """Compare-and-set of the whole status; None when someone wrote first."""
        raw = self.call("update the run status", lambda: self.gateway.replace_status(
            run.resource_version, status.to_dict(), SEAL_MANAGER), bound)
        return None if raw is None else self.accept(raw)

    def announce(self, run: ElasticRun) -> ElasticRun:
        """Bump the signal for this round's join notice; the run returned is as stored."""
        raw = self.call("announce a waiting node", lambda: self.gateway.announce(run.status))
        if raw is None:
            # A test failed: the signal moved after our request was written, so the
            # members hear about us with that change.
            return self.read_or_raise()
        return self.accept(raw)

    # ------------------------------------------------------------------ waiting

    def wait_for_change(self, run: ElasticRun, wake_at: float,
                        closing: Callable[[], bool], seen: int | None = None) -> ElasticRun:
        """A newer copy of the run, or ``run`` itself if none came before ``wake_at``.

        Returns early on any change after the cache's version ``seen`` (by
        default, now), including news from :meth:`RunWatcher.poke`.
        """
        watcher = self.watcher
        seen = watcher.version if seen is None else seen
        self.check_watch()  # what the watch learned before ``seen`` wakes nobody
        latest = watcher.latest
        if latest is not None and newer(latest.resource_version, run.resource_version):
            return latest
        watcher.wait(seen, wake_at - time.monotonic())
        if closing():
            raise RendezvousClosedError(f"{self.who}: the agent is shutting down")
        self.check_watch()
        if time.monotonic() >= wake_at - 1e-3:
            # A timer (last call, join deadline) fired: look at the newest state once.
            return self.read_or_raise()
        latest = watcher.latest
        if latest is not None and newer(latest.resource_version, run.resource_version):
            return latest
        return run

    def check_watch(self) -> None:
        """Raise, as torch's error, what the watch learned that makes waiting pointless."""
        try:
            self.watcher.check()
        except RunDeletedError as exc:
            raise RendezvousClosedError(f"{self.who}: {exc} while this node was waiting; "
                                        "re-create it to start a new run") from exc
        except InvalidRunError as exc:
            raise RendezvousStateError(f"{self.who}: cannot read the ElasticRun: {exc}. "
                                       "The status was probably edited by hand") from exc
        if self.watcher.disconnected_for > self.settings.api_timeout:
            raise RendezvousConnectionError(
                f"{self.who}: lost the watch on the API server for more than "
                f"{self.settings.api_timeout:.0f}s (api_timeout)")
