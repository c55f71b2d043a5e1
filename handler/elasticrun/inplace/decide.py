"""What a worker does on a failure or a new round, as pure functions.

The torch side (:mod:`.group`, :mod:`.sync`) only carries these decisions out,
so every rule here is tested without processes: which exception means a peer
was lost, where a worker sits in a round, which rank's state everybody takes.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from elasticrun.api.roundfile import Round


class Verdict(enum.Enum):
    #: A peer was lost or froze: abort the group, wait for the next round, retry the step.
    REGROUP = "regroup"
    #: Anything else (a bug in the step, out of memory, Ctrl-C): the script's to handle.
    RAISE = "raise"


#: torch's own types for a failed collective, store or connection (``torch.distributed.DistError``
#: subclasses); matched by name so this module needs no torch.
_DIST_ERRORS = frozenset({"DistBackendError", "DistNetworkError", "DistStoreError"})
#: What Gloo's RuntimeErrors say when a peer died (read error, closed connection) or froze
#: (the group's ``timeout`` ran out), and what an aborted NCCL communicator says.
_PEER_LOST = ("connection closed by peer", "connection reset by peer", "timed out waiting",
              "broken pipe", "gloo/transport", "read error", "communicator was aborted",
              "ncclremoteerror", "socket timeout")
#: Only the start of a message is read: enough for every marker above.
_MESSAGE_LIMIT = 2000


def classify(exc: BaseException) -> Verdict:
    """Whether ``exc``, raised by a training step, means the group lost a peer."""
    if not isinstance(exc, Exception):
        return Verdict.RAISE  # KeyboardInterrupt, SystemExit
    if any(cls.__name__ in _DIST_ERRORS for cls in type(exc).__mro__):
        return Verdict.REGROUP
    if isinstance(exc, RuntimeError):
        message = str(exc)[:_MESSAGE_LIMIT].lower()
        if any(marker in message for marker in _PEER_LOST):
            return Verdict.REGROUP
    return Verdict.RAISE


@dataclass(frozen=True)
class Placement:
    """A worker's ranks in one round: what ``RANK``/``WORLD_SIZE`` and torch say."""

    round: int
    rank: int
    world_size: int
    node_rank: int
    local_rank: int
    local_world_size: int

    def environ(self, round_: Round) -> dict[str, str]:
        """torchrun's variables for this placement, so code reading them stays right."""
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size),
                "GROUP_RANK": str(self.node_rank), "LOCAL_RANK": str(self.local_rank),
                "LOCAL_WORLD_SIZE": str(self.local_world_size),
                "GROUP_WORLD_SIZE": str(round_.num_nodes),
                "MASTER_ADDR": round_.store_host, "MASTER_PORT": str(round_.store_port),
                "ELASTICRUN_ROUND": str(round_.number)}


def place(round_: Round, local_rank: int, local_world_size: int) -> Placement:
    """Global rank = node rank x local world size + local rank (torchrun's layout)."""
    if local_world_size < 1:
        raise ValueError(f"LOCAL_WORLD_SIZE={local_world_size}: must be at least 1")
    if not 0 <= local_rank < local_world_size:
        raise ValueError(f"LOCAL_RANK={local_rank}: must be in 0..{local_world_size - 1}")
    return Placement(round=round_.number,
                     rank=round_.node_rank * local_world_size + local_rank,
                     world_size=round_.num_nodes * local_world_size,
                     node_rank=round_.node_rank, local_rank=local_rank,
                     local_world_size=local_world_size)


def applies(candidate: Round | None, current: int) -> bool:
    """Whether ``candidate`` is a round this worker has not yet formed a group for."""
    return candidate is not None and candidate.number > current


def must_regroup(current: int, highest_seen: int) -> bool:
    """After the ranks agreed on the highest round any of them sees: move on together.

    Each rank reads its node's file at its own moment; the group all-reduces
    (max) the round numbers they saw at the end of a step, so all ranks leave
    at the same step boundary instead of one leaving mid-collective.
    """
    return highest_seen > current


def sync_source(steps: Sequence[int]) -> int:
    """The rank whose state everybody takes: the lowest among those furthest along.

    Survivors of a loss are at the same step; a newcomer arrives at step 0 (or
    the step of an older checkpoint), so it never wins against a survivor.
    """
    if not steps:
        raise ValueError("no ranks to choose a state from")
    furthest = max(steps)
    return steps.index(furthest)


def store_prefix(run: str, round_number: int) -> str:
    """Keys of one round's group in its store: a fresh namespace per round, so a new
    group never reads the addresses of a dead one."""
    return f"elasticrun.inplace.{run}.{round_number}"


def regroups_left(attempts: int, limit: int) -> bool:
    """Whether a step that failed ``attempts`` times may be retried once more."""
    return attempts < limit
