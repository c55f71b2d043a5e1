"""In-place recovery: keep training through a lost or added node without a worker restart.

Opt-in: a script wraps its steps with :class:`Group` (see ``docs/in-place.md``)::

    from elasticrun import inplace

    with inplace.Group.from_env() as group:
        step = group.sync(model, optimizer)
        ddp = group.wrap(model)
        while group.step < total:
            group.run(lambda: train_step(ddp, optimizer, group.step))

The torch side (:class:`Group` and what it uses) is imported on first use, so
the rules (:mod:`.decide`) and the file source (:mod:`.source`) load without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from elasticrun.api.roundfile import (
    ROUND_FILE_VARIABLE,
    Round,
    RoundFileError,
    decode_round,
    encode_round,
    write_round,
)
from elasticrun.inplace.decide import Placement, Verdict, classify
from elasticrun.inplace.source import (
    FileRoundSource,
    RoundSource,
    RoundTimeoutError,
)

if TYPE_CHECKING:
    from elasticrun.inplace.group import Change, Group, RegroupError, Rewrapped

_NEED_TORCH = {"Change", "Group", "RegroupError", "Rewrapped"}

__all__ = ["ROUND_FILE_VARIABLE", "Change", "FileRoundSource", "Group", "Placement",
           "RegroupError", "Rewrapped", "Round", "RoundFileError", "RoundSource",
           "RoundTimeoutError", "Verdict", "classify", "decode_round", "encode_round",
           "write_round"]


def __getattr__(name: str) -> Any:
    if name in _NEED_TORCH:
        return getattr(importlib.import_module("elasticrun.inplace.group"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
