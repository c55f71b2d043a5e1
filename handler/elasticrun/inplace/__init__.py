"""In-place recovery: keep training through a lost or added node without a worker restart.

Opt-in: a script wraps its steps with :class:`Group` (see ``docs/in-place.md``)::

    from elasticrun import inplace

    with inplace.Group.from_env() as group:
        step = group.sync(model, optimizer)
        ddp = group.wrap(model)
        while group.step < total:
            group.run(lambda: train_step(ddp, optimizer, group.step))

Importing this package needs torch; :mod:`.roundfile` and :mod:`.decide` alone do not.
"""

from __future__ import annotations

from elasticrun.inplace.decide import Placement, Verdict, classify
from elasticrun.inplace.group import Change, Group, RegroupError, Rewrapped
from elasticrun.inplace.roundfile import Round, RoundFileError, decode_round, encode_round
from elasticrun.inplace.source import (
    ROUND_FILE_VARIABLE,
    FileRoundSource,
    RoundSource,
    RoundTimeoutError,
    write_round,
)

__all__ = ["ROUND_FILE_VARIABLE", "Change", "FileRoundSource", "Group", "Placement", "RegroupError",
           "Rewrapped", "Round", "RoundFileError", "RoundSource", "RoundTimeoutError",
           "Verdict", "classify", "decode_round", "encode_round", "write_round"]
