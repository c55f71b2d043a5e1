"""In-place mode's follower: the node joins the next round itself while its workers run.

Started by the first ``next_rendezvous()`` in in-place mode (``docs/in-place.md``),
the follower thread looks at the run whenever the watch brings a change: when
the node's round lost a member, or its own workers reported that their group
failed (the *lost file* beside the round file), :func:`.step.in_place_move`
says ``follow`` and the follower rendezvouses again through the handler (which
writes the new round into the round file), so torchrun's monitor never restarts
the workers.  A newcomer instead sets :attr:`Follower.restart_wanted`, which
``num_nodes_waiting()`` reports to torchrun as without in-place mode.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousError

from elasticrun.api import rounds
from elasticrun.api.model import ElasticRun, now
from elasticrun.api.policy import retry_delay
from elasticrun.api.roundfile import RoundFileError, decode_lost, lost_file
from elasticrun.handler import step
from elasticrun.handler.calls import who
from elasticrun.handler.session import RunSession
from elasticrun.handler.settings import RendezvousSettings

log = logging.getLogger(__name__)

#: How often the follower reads its workers' lost file while they could report on
#: its round.  The report is the one news no watch brings, and the re-formed round
#: waits for it: up to this much on top of the workers' own detection (about 80 ms,
#: docs/in-place.md) in a recovery of 0.3-0.5 s.  A look is one open() of a file
#: that is normally missing, so the follower pays five of them a second for that.
LOST_FILE_INTERVAL = 0.2
#: The longest the follower waits on the watch when nothing but the watch can bring
#: news (no round yet, no round file, a restart already asked for): a bound, no poll.
IDLE_WAIT = 5.0


class Follower:
    """The follower thread of one handler (in-place mode).

    ``rejoin`` is the handler's rendezvous (under its lock, as torchrun's own call);
    ``round_of`` the round the node last completed; ``closing`` whether the
    handler's ``shutdown()`` has begun, which ends the thread.
    """

    def __init__(self, settings: RendezvousSettings, rejoin: Callable[[], object],
                 round_of: Callable[[], int], closing: Callable[[], bool]) -> None:
        self.settings = settings
        self._rejoin = rejoin
        self._round_of = round_of
        self._closing = closing
        self._thread: threading.Thread | None = None
        #: The follower saw a newcomer: num_nodes_waiting() asks torchrun for a restart,
        #: until torchrun's next rendezvous (:meth:`follow`) answers it.
        self.restart_wanted = False

    def _who(self) -> str:
        return who(self.settings)

    def follow(self, session: RunSession) -> None:
        """After torchrun's rendezvous: any restart asked for is answered; follow the run
        (the thread starts once and is woken to look at the new round)."""
        self.restart_wanted = False
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._following, args=(session,),
                                            daemon=True,
                                            name=f"elasticrun-follow-{self.settings.node_name}")
            self._thread.start()
        else:
            session.watcher.poke()

    def _following(self, session: RunSession) -> None:
        """While the agent runs: whenever this node's round must be re-formed
        (:func:`step.in_place_move` says ``follow``), rendezvous again; the workers
        keep running meanwhile."""
        watcher = session.watcher
        failures = 0
        while not self._closing() and not watcher.stopped:
            seen = watcher.version
            run = watcher.latest
            if run is not None and not self.restart_wanted \
                    and self._in_place_move(session, run) == "follow":
                log.info("%s: round %d must be re-formed; joining the next one in place",
                         self._who(), self._round_of())
                try:
                    self._rejoin()
                    failures = 0
                except RendezvousClosedError as exc:
                    log.info("%s: no longer following the run: %s", self._who(), exc)
                    return
                except RendezvousError as exc:
                    failures += 1
                    log.warning("%s: following the run: %s", self._who(), exc)
                    time.sleep(retry_delay(failures))
                continue
            watcher.wait(seen, self._wait_bound(run))

    def _wait_bound(self, run: ElasticRun | None) -> float:
        """How long to wait on the watch: until the next news no watch event brings.

        That is the workers' lost report, looked at every :data:`LOST_FILE_INTERVAL`
        while it could concern the node's round, and the moment newcomers held for
        the owner's target become due (:func:`~elasticrun.api.rounds.announce_due`),
        when ``num_nodes_waiting()`` changes with no change of the run; at most
        :data:`IDLE_WAIT`.
        """
        bound = IDLE_WAIT
        if self.restart_wanted:
            return bound  # nothing to look at until torchrun's rendezvous (follow() wakes us)
        if self.settings.round_file is not None and self._round_of() > 0:
            bound = LOST_FILE_INTERVAL
        due = rounds.announce_due(run, now()) if run is not None else None
        if due is not None:
            # Never 0: a due time already past changes nothing more by itself.
            bound = min(bound, max(LOST_FILE_INTERVAL, (due - now()).total_seconds()))
        return bound

    def _in_place_move(self, session: RunSession, run: ElasticRun) -> step.InPlaceMove:
        """:func:`step.in_place_move`, with one LIST of the join requests once the round
        must change; a ``restart`` is kept for ``num_nodes_waiting()`` until torchrun's
        next rendezvous."""
        lost, my_round, node = self._lost_round(), self._round_of(), self.settings.node_name
        move = step.in_place_move(run, my_round, now(), lost, node=node)
        if move == "stay":
            return move
        try:
            pending = session.pending(run)
        except RendezvousError as exc:
            log.warning("%s: listing the join requests: %s", self._who(), exc)
            return "stay"
        move = step.in_place_move(run, my_round, now(), lost, step.has_newcomers(run, pending),
                                  node)
        if move == "restart":
            log.info("%s: a newcomer is waiting; torchrun restarts the workers", self._who())
            self.restart_wanted = True
        return move

    def _lost_round(self) -> int:
        """The round whose group the node's workers reported failed (0: none, or unreadable)."""
        path = self.settings.round_file
        if path is None:
            return 0
        try:
            return decode_lost(lost_file(Path(path)).read_bytes())
        except FileNotFoundError:
            return 0
        except (OSError, RoundFileError) as exc:
            log.debug("%s: ignoring the lost file: %s", self._who(), exc)
            return 0
