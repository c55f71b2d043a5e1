"""The round file: what a node's agent tells its workers about the round they are in.

In in-place mode the agent (the rendezvous handler in torchrun's process) does
not restart its workers when the membership changes; it writes the node's new
place into a small JSON file instead, one per node, and the workers re-form
their process group from it::

    {"round": 7, "node_rank": 1, "num_nodes": 3, "store": "10.0.0.12:29400"}

``store`` is the round's TCPStore (served by the agent of the round's rank 0).
Keys this version does not know are ignored, so a newer agent may add some.
The file is written whole and renamed into place (:func:`write_round`, the one
function here that does I/O), so a reader never sees half a file; the rest is
pure so a malformed file is a clear error, not a crash deep in torch. It lives
in ``elasticrun.api`` because both sides use it: the handler writes the file,
``elasticrun.inplace`` reads it.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elasticrun.api import untrusted

#: The environment variable naming a node's round file: set by the handler for the
#: workers torchrun starts, read by ``elasticrun.inplace``.
ROUND_FILE_VARIABLE = "ELASTICRUN_ROUND_FILE"
#: A round file is a few dozen bytes; anything much larger is not one.
MAX_BYTES = 4096
#: Bounds of every count, so a corrupt value is refused rather than used.
MAX_ROUND = 2**31 - 1
MAX_NODES = 65536
_HOST = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9]([-A-Za-z0-9.]{0,251}[A-Za-z0-9])?)$")


class RoundFileError(ValueError):
    """A round file this version cannot use; the message names the field."""


@dataclass(frozen=True)
class Round:
    """One node's place in one round of its run."""

    number: int
    node_rank: int
    num_nodes: int
    store_host: str
    store_port: int

    @property
    def store(self) -> str:
        return f"{self.store_host}:{self.store_port}"


def _count(doc: dict[str, Any], key: str, low: int, high: int) -> int:
    value = doc.get(key)
    # bool is an int in Python; true is not a round number.
    if isinstance(value, bool) or not isinstance(value, int):
        raise RoundFileError(f"round file: {key!r} must be a whole number, got {value!r:.40}")
    if not low <= value <= high:
        raise RoundFileError(f"round file: {key!r}={value} is outside {low}..{high}")
    return value


def parse_store(text: object) -> tuple[str, int]:
    """``host:port`` (host a name, an IPv4 or a bracketed IPv6) as (host, port)."""
    if not isinstance(text, str) or len(text) > 300:
        raise RoundFileError(f"round file: 'store' must be a 'host:port' string, got {text!r:.60}")
    host, sep, port = text.rpartition(":")
    if not sep or not _HOST.match(host) or not port.isdigit() or len(port) > 5 \
            or not 0 < int(port) < 65536:
        raise RoundFileError(f"round file: 'store'={text!r:.60} is not host:port with a port "
                             "from 1 to 65535")
    return host.strip("[]"), int(port)


def decode_round(raw: bytes | str) -> Round:
    """The round a file holds; :class:`RoundFileError` says what is wrong with it."""
    doc = _document(raw, "round file")
    num_nodes = _count(doc, "num_nodes", 1, MAX_NODES)
    host, port = parse_store(doc.get("store"))
    return Round(number=_count(doc, "round", 1, MAX_ROUND),
                 node_rank=_count(doc, "node_rank", 0, num_nodes - 1),
                 num_nodes=num_nodes, store_host=host, store_port=port)


def encode_round(round_: Round) -> str:
    """The file's text for ``round_`` (decodes back to it)."""
    host = f"[{round_.store_host}]" if ":" in round_.store_host else round_.store_host
    text = json.dumps({"round": round_.number, "node_rank": round_.node_rank,
                       "num_nodes": round_.num_nodes, "store": f"{host}:{round_.store_port}"},
                      sort_keys=True)
    decode_round(text)  # never write what no reader accepts
    return text


def write_round(path: Path, round_: Round) -> None:
    """Write ``round_`` to ``path`` atomically (:func:`write_atomically`)."""
    write_atomically(path, encode_round(round_))


def lost_file(round_file: Path) -> Path:
    """Where a node's workers report that their group failed: next to the round file."""
    return round_file.with_name(round_file.name + ".lost")


def encode_lost(round_number: int) -> str:
    """The lost file's text: the round whose group failed (so the agent re-forms it)."""
    return json.dumps({"round": round_number})


def decode_lost(raw: bytes | str) -> int:
    """The round a lost file names; :class:`RoundFileError` for anything else."""
    return _count(_document(raw, "lost file"), "round", 1, MAX_ROUND)


def _document(raw: bytes | str, what: str) -> dict[str, Any]:
    """The file's JSON object, through the one bounded reader of untrusted text
    (:func:`elasticrun.api.untrusted.json_object`); ``what`` names the file in errors."""
    if len(raw) > MAX_BYTES:
        raise RoundFileError(f"{what}: {len(raw)} bytes, more than {MAX_BYTES}")
    try:
        text = raw.decode() if isinstance(raw, bytes) else raw
        return untrusted.json_object(text, limit=MAX_BYTES)
    except UnicodeDecodeError as exc:
        raise RoundFileError(f"{what}: not JSON ({exc})") from None
    except untrusted.UnreadableError as exc:
        raise RoundFileError(f"{what}: {exc}") from None


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path``: a temporary file in the same folder, flushed, then
    renamed over the old one, so a reader sees the old text or the new, never half."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
