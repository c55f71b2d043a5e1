"""Whether a round passed torch's exit barrier: the proof that its training finished.

torchrun's agent calls ``shutdown()`` on the handler whenever it ends without
a signal: after its workers succeeded, and also after they failed for good.
Only the first says that the run's work is done, and the handler cannot ask
the agent which it was.  The round's store can tell: an agent whose workers
succeeded enters the exit barrier (``SimpleElasticAgent._exit_barrier``), a
count of the round's agents in the store torch was handed, and the last agent
to arrive sets a key that every agent then waits for.  That key exists only
once every member of the round has succeeded, so a node that sees it on its
way out may mark the whole run ``Succeeded``
(:func:`elasticrun.api.rounds.leave`), and a spare still waiting exits 0
without ever running a round.

An agent whose barrier timed out, whose workers failed, or whose round's rank 0
(the store's host) is already gone finds no key, and leaves as before: the run
is finished by the operator once every member has left.
"""

from __future__ import annotations

import logging
import threading

from torch.distributed import Store

log = logging.getLogger(__name__)

#: The barrier's key prefix (``torch.distributed.elastic.agent.server.api``) and the
#: key its last arrival sets (``torch.distributed.elastic.utils.store``); a unit test
#: runs torch's own barrier and checks that this key is what it leaves behind.
BARRIER_PREFIX = "torchelastic/agent/terminal_state"
LAST_MEMBER_KEY = BARRIER_PREFIX + "/last_member"
#: How long a node on its way out looks for the key: rank 0's store is up or it is not.
CHECK_SECONDS = 2.0


def passed(store: Store, timeout: float = CHECK_SECONDS) -> bool:
    """Whether the exit barrier in ``store`` (the round's store handed to torch) is complete.

    Never raises and never waits longer than ``timeout``: a store that does not
    answer (its host left first, or froze) is no proof.
    """
    answer: list[bool] = []

    def check() -> None:
        try:
            answer.append(bool(store.check([LAST_MEMBER_KEY])))
        except Exception as exc:
            log.debug("the round's store did not answer the exit-barrier check: %s", exc)

    worker = threading.Thread(target=check, name="exit-barrier-check", daemon=True)
    worker.start()
    worker.join(timeout)
    return bool(answer) and answer[0]
