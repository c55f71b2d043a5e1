"""``Group``: a process group that survives a lost or added node without a restart.

The training script wraps each step in :meth:`Group.run`. When a step fails
because a peer died or froze (:func:`.decide.classify`), the group is torn
down, the worker waits for the next round from its :class:`.source.RoundSource`,
forms a new group on that round's store, brings every rank to the same state
(:mod:`.sync`), re-makes the DDP wrapper, and retries the step. When a round
is added with no failure (a newcomer), the ranks notice it together at a step
boundary (:func:`.decide.must_regroup`) and move on the same way.

Why a new group rather than ``torch.distributed._reconfigure``: on 3 Gloo
processes on one CPU, destroy + ``init_process_group`` on a fresh store prefix
took 5-10 ms to the first all-reduce of the two survivors, ``_reconfigure``
14-21 ms; a new group uses only public API, works for every backend, and
rendezvouses through the *new* round's store, while Gloo's reconfigure handle
names the store the group was first made with (``docs/in-place.md``).
"""

from __future__ import annotations

import datetime as dt
import gc
import logging
import os
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elasticrun.api.roundfile import Round
from elasticrun.inplace import decide
from elasticrun.inplace.source import FileRoundSource, RoundSource
from elasticrun.inplace.sync import sync_state

log = logging.getLogger(__name__)
T = TypeVar("T")


class RegroupError(RuntimeError):
    """The group could not be re-formed within the configured number of attempts."""


class RoundSupersededError(RuntimeError):
    """A newer round came while the workers of the one being formed gathered."""


class Rewrapped:
    """A DDP wrapper that the group re-makes on every new process group.

    DDP binds its process group (and the world size it divides gradients by)
    when it is built, so after a change the old wrapper is useless; call this
    object as you would the DDP, and it forwards to the current one.
    """

    def __init__(self, module: torch.nn.Module, options: Mapping[str, Any]) -> None:
        self.module = module
        self._options = dict(options)
        self.current: DistributedDataParallel | None = None
        self.rebuild()

    def rebuild(self) -> None:
        # The old wrapper's reducer holds autograd hooks on the parameters; it
        # must be gone before the next backward, or they would fire on a dead group.
        # Dropping the reference frees it; a full collection (0.2-0.8 s with torch
        # loaded on a busy CPU) only when something still holds it in a cycle.
        previous = weakref.ref(self.current) if self.current is not None else None
        self.current = None
        if previous is not None and previous() is not None:
            gc.collect()
        self.current = DistributedDataParallel(self.module, **self._options)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        assert self.current is not None
        return self.current(*args, **kwargs)


@dataclass
class Change:
    """When each part of one change happened (wall clock, so other processes can compare)."""

    #: "lost" (a step failed) or "round" (a newer round seen at a step boundary).
    cause: str
    started: float
    round: int = 0
    round_seen: float = 0.0
    formed: float = 0.0
    #: Model, optimizer and step re-synced.
    state: float = 0.0
    #: And every DDP re-made.
    synced: float = 0.0


class Group:
    """The worker's process group across in-place changes of its run's membership."""

    def __init__(self, source: RoundSource | None, first: Round | None, *, local_rank: int = 0,
                 local_world_size: int = 1, backend: str = "gloo", timeout: float = 30.0,
                 round_timeout: float = 300.0, max_regroups: int = 10,
                 run: str = "run") -> None:
        self.source = source
        self.local_rank = local_rank
        self.local_world_size = local_world_size
        self.backend = backend
        #: Bound on every collective and on forming a group: a frozen peer fails within it.
        self.timeout = timeout
        #: Bound on waiting for the next round after a failure, and for every worker
        #: of a round to arrive before its group is formed.
        self.round_timeout = round_timeout
        self.max_regroups = max_regroups
        self.run_name = run
        #: Steps completed (carried over from the sync source after each change).
        self.step = 0
        self.round: Round | None = None
        self.placement: decide.Placement | None = None
        #: How long each change took, failure to group re-formed and state re-synced (s).
        self.recoveries: list[float] = []
        #: The parts of each change (:class:`Change`).
        self.changes: list[Change] = []
        self._model: torch.nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._wrapped: list[Rewrapped] = []
        self._store: dist.Store | None = None
        self._forming: int | None = None
        self._form(first)

    @classmethod
    def from_env(cls, source: RoundSource | None = None,
                 environ: Mapping[str, str] | None = None, **options: Any) -> Group:
        """A group from torchrun's environment and the node's round file.

        Without a round source (``ELASTICRUN_ROUND_FILE`` unset) this is a
        plain ``init_process_group`` and failures propagate as they always did.
        """
        env = os.environ if environ is None else environ
        if source is None:
            source = FileRoundSource.from_env(dict(env))
        round_timeout = float(options.get("round_timeout", 300.0))
        first = source.wait_newer(0, round_timeout) if source is not None else None
        return cls(source, first, local_rank=int(env.get("LOCAL_RANK", "0")),
                   local_world_size=int(env.get("LOCAL_WORLD_SIZE", "1")),
                   run=env.get("TORCHELASTIC_RUN_ID", "run"), **options)

    # ------------------------------------------------------------------ the API

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    def sync(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
             step: int = 0) -> int:
        """Register the state to carry across changes and make it equal on every rank now.

        ``step`` is where this worker stands (a checkpoint's step, else 0); the
        step everybody goes on from is returned and kept in :attr:`step`.
        """
        self._model, self._optimizer, self.step = model, optimizer, step
        self.step = sync_state(model, optimizer, step)
        return self.step

    def wrap(self, model: torch.nn.Module, **ddp_options: Any) -> Rewrapped:
        """A DDP of ``model`` on the current group, re-made after every change."""
        wrapped = Rewrapped(model, ddp_options)
        self._wrapped.append(wrapped)
        return wrapped

    def run(self, step_fn: Callable[[], T]) -> T:
        """Run one training step; on a lost peer re-form the group and retry it.

        ``step_fn`` must be safe to run again from the start (zero the
        gradients first): a retry follows a re-sync, so it starts from the
        source rank's state. After a completed step the ranks check together
        whether a newer round exists, and move to it at this boundary.
        """
        attempts = 0
        while True:
            try:
                result = step_fn()
            except Exception as exc:
                attempts = self._recover(exc, attempts)
                continue
            self.step += 1
            try:
                self._follow_rounds()
            except Exception as exc:
                self._recover(exc, 0)
            return result

    def close(self) -> None:
        self._teardown()
        self._store = None

    def __enter__(self) -> Group:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # ------------------------------------------------------------------ changes

    def _follow_rounds(self) -> None:
        """At a step boundary: all ranks move on if any of them sees a newer round."""
        if self.source is None or self.round is None:
            return
        seen = self.source.latest()
        mine = seen.number if decide.applies(seen, self.round.number) and seen else 0
        highest = torch.tensor([max(mine, self.round.number)], dtype=torch.int64,
                               device=self._device())
        dist.all_reduce(highest, op=dist.ReduceOp.MAX)
        if decide.must_regroup(self.round.number, int(highest.item())):
            log.info("rank %d: round %d is next; re-forming the group", self.rank,
                     int(highest.item()))
            self._regroup(time.monotonic(), Change("round", time.time()))

    def _recover(self, exc: Exception, attempts: int) -> int:
        """Re-form the group after ``exc`` or re-raise it; the attempts so far."""
        if self.source is None or decide.classify(exc) is decide.Verdict.RAISE:
            raise exc
        if not decide.regroups_left(attempts, self.max_regroups):
            raise RegroupError(f"gave up after {attempts} re-formed groups") from exc
        log.warning("rank %d, round %s: a peer was lost (%s); waiting for the next round",
                    self.rank if dist.is_initialized() else -1,
                    self.round.number if self.round else "?", str(exc)[:200])
        if self.round is not None:
            self.source.report_lost(self.round.number)
        self._regroup(time.monotonic(), Change("lost", time.time()))
        return attempts + 1

    def _regroup(self, started: float, change: Change) -> None:
        """Tear down, wait for a newer round, form, re-sync, re-wrap; retried while the
        new group itself loses a peer."""
        assert self.source is not None
        # A round that failed while forming is never tried again: wait for a newer one.
        tried = self.round.number if self.round is not None else 0
        for attempt in range(self.max_regroups):
            self._teardown()
            self.source.wait_newer(tried, self.round_timeout)
            newest = self.source.latest()  # a round may have been skipped meanwhile
            tried = newest.number if newest is not None else tried + 1
            change.round_seen = time.time()
            try:
                self._form(newest)
                change.formed = time.time()
                if self._model is not None:
                    self.step = sync_state(self._model, self._optimizer, self.step)
                change.state = time.time()
                for wrapped in self._wrapped:
                    wrapped.rebuild()
                change.synced = time.time()
            except Exception as exc:
                if decide.classify(exc) is decide.Verdict.RAISE \
                        and not isinstance(exc, RoundSupersededError):
                    raise
                log.warning("round %s failed while forming (%s); attempt %d",
                            newest.number if newest else "?", str(exc)[:200], attempt + 1)
                continue
            self.recoveries.append(time.monotonic() - started)
            change.round = newest.number if newest else 0
            self.changes.append(change)
            log.info("rank %d of %d in round %d, step %d, %.3fs after the change", self.rank,
                     self.world_size, self.round.number if self.round else 0, self.step,
                     self.recoveries[-1])
            return
        raise RegroupError(f"no group formed in {self.max_regroups} rounds")

    # ------------------------------------------------------------------ torch

    def _device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _form(self, round_: Round | None) -> None:
        """``init_process_group`` for ``round_`` on its store (a fresh prefix per round);
        from torchrun's environment when there is no round."""
        timeout = dt.timedelta(seconds=self.timeout)
        if round_ is None:
            dist.init_process_group(self.backend, timeout=timeout)
            return
        placement = decide.place(round_, self.local_rank, self.local_world_size)
        self._forming = round_.number
        os.environ.update(placement.environ(round_))
        self._store = dist.TCPStore(round_.store_host, round_.store_port, is_master=False,
                                    timeout=timeout, use_libuv=True)
        prefixed = dist.PrefixStore(decide.store_prefix(self.run_name, round_.number),
                                    self._store)
        self._gather(prefixed, placement.world_size)
        dist.init_process_group(self.backend, store=prefixed, rank=placement.rank,
                                world_size=placement.world_size, timeout=timeout)
        self.round, self.placement = round_, placement

    def _gather(self, store: dist.Store, world_size: int) -> None:
        """Wait (up to ``round_timeout``) until every worker of the round has arrived.

        ``init_process_group`` waits only the collective ``timeout`` for its peers,
        and workers of one round start seconds apart (a newcomer imports torch, a
        busy node is slow), so the long wait happens here, on the round's store.
        """
        if store.add("arrived", 1) == world_size:
            store.set("all-arrived", "1")
        deadline = time.monotonic() + self.round_timeout
        while True:
            try:
                store.wait(["all-arrived"], dt.timedelta(seconds=1))
                return
            except Exception as exc:
                if decide.classify(exc) is decide.Verdict.RAISE \
                        or time.monotonic() >= deadline:
                    raise
            # A member that never arrives is lost again: its round is superseded.
            newer = self.source.latest() if self.source is not None else None
            if newer is not None and self._forming is not None \
                    and decide.applies(newer, self._forming):
                raise RoundSupersededError(f"round {newer.number} replaced round "
                                           f"{self._forming} while its workers gathered")

    def _teardown(self) -> None:
        """Drop the group without waiting on peers (NCCL: abort, whose destroy may hang)."""
        if not dist.is_initialized():
            return
        try:
            if self.backend == "nccl":
                dist.distributed_c10d._abort_process_group()
            else:
                dist.destroy_process_group()
        except Exception:
            log.debug("tearing the group down", exc_info=True)
