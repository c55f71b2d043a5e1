"""Where a worker learns about the next round: the narrow ``RoundSource`` interface and
its file implementation.

The agent side (the rendezvous handler, or a test) owns the rounds; workers only
need "the round after N". A file per node is the simplest channel that
survives either side restarting: the agent renames a complete file into place,
workers poll it. Reading is cheap (a ``stat`` per poll, a read only when it
changed), so the training loop can look once per step.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Protocol

from elasticrun.api.roundfile import (
    ROUND_FILE_VARIABLE,
    Round,
    RoundFileError,
    decode_round,
    encode_lost,
    lost_file,
    write_atomically,
)

log = logging.getLogger(__name__)


class RoundTimeoutError(TimeoutError):
    """No newer round came within the bound; the worker gives up (torchrun restarts it)."""


class RoundSource(Protocol):
    """The agent's side of in-place recovery, as the workers see it."""

    def latest(self) -> Round | None:
        """The newest round known now, without waiting (None: none yet, or unreadable)."""
        ...

    def wait_newer(self, after: int, timeout: float) -> Round:
        """Block until a round numbered above ``after`` exists; raise RoundTimeoutError
        after ``timeout`` seconds."""
        ...

    def report_lost(self, round_number: int) -> None:
        """Tell the agent that this worker's group failed in ``round_number``: the agent
        then re-forms the round, as torchrun's restart of failed workers would."""
        ...


class FileRoundSource:
    """Rounds from one JSON file (:mod:`elasticrun.api.roundfile`), polled."""

    def __init__(self, path: Path, poll_interval: float = 0.02) -> None:
        self.path = path
        self.poll_interval = poll_interval
        self._seen: tuple[int, int, int] | None = None
        self._round: Round | None = None
        self.error: RoundFileError | None = None

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> FileRoundSource | None:
        """The source ``ELASTICRUN_ROUND_FILE`` names, or None when it is not set."""
        value = (environ if environ is not None else dict(os.environ)).get(ROUND_FILE_VARIABLE)
        return cls(Path(value)) if value else None

    def latest(self) -> Round | None:
        try:
            info = self.path.stat()
        except FileNotFoundError:
            return self._round
        key = (info.st_ino, info.st_mtime_ns, info.st_size)
        if key == self._seen:
            return self._round
        try:
            round_ = decode_round(self.path.read_bytes())
        except FileNotFoundError:
            return self._round
        except RoundFileError as exc:
            if str(exc) != str(self.error):
                log.warning("%s: %s", self.path, exc)
            self.error = exc
            self._seen = key
            return self._round
        self._seen, self._round, self.error = key, round_, None
        return round_

    def report_lost(self, round_number: int) -> None:
        try:
            write_atomically(lost_file(self.path), encode_lost(round_number))
        except OSError as exc:
            log.warning("cannot report the lost round %d next to %s: %s", round_number,
                        self.path, exc)

    def wait_newer(self, after: int, timeout: float) -> Round:
        deadline = time.monotonic() + timeout
        while True:
            round_ = self.latest()
            if round_ is not None and round_.number > after:
                return round_
            if time.monotonic() >= deadline:
                why = f"; the file is unusable: {self.error}" if self.error else ""
                raise RoundTimeoutError(f"no round after {after} in {self.path} within "
                                        f"{timeout:g}s{why}")
            time.sleep(self.poll_interval)
