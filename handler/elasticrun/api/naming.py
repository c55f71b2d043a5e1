"""Names of the objects that belong to a run (Leases), and label-safe values."""

from __future__ import annotations

import hashlib
import json
import re

_LABEL_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_PLAIN_LEASE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?\.[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_ESCAPABLE = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")
#: Longest object name (a DNS subdomain).
MAX_NAME = 253
#: Hex digits of the digest in a hashed Lease name (128 bits).
DIGEST = 32
#: Longest run part of a hashed Lease name; the node part takes what is left.
RUN_PART = 150
NODE_PART = MAX_NAME - RUN_PART - DIGEST - 2


def is_dns_label(text: str) -> bool:
    """An RFC 1123 label, as namespaces and label-valued names must be (at most 63 characters)."""
    return len(text) <= 63 and _DNS_LABEL.fullmatch(text) is not None


def label_value(text: str) -> str:
    """A label value (<= 63 safe characters) that identifies ``text``.

    Run names may be DNS subdomains of up to 253 characters; label values may
    not, so long or unusual names are shortened with a hash.  The full name is
    always kept in an annotation as well.
    """
    if text and len(text) <= 63 and not _LABEL_UNSAFE.search(text) and text[0].isalnum() \
            and text[-1].isalnum():
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:10]
    safe = _LABEL_UNSAFE.sub("-", text)[:50].strip("-._") or "x"
    return f"{safe}-{digest}"


def lease_name(run: str, node: str) -> str:
    """The name of ``node``'s Lease in ``run``: one name per (run, node), and no two alike.

    Two shapes that cannot meet, because one has one dot and the other two:

    * ``<run>.<node>`` (the plain form) when neither name has a dot and the
      result is a valid object name: the split at the only dot is unique.
    * ``<run part>.<node part>.<digest>`` otherwise.  The parts are the names
      escaped into ``[a-z0-9-]`` (``-`` as ``-0``, ``.`` as ``-1``, a prefix
      code, so different names never escape alike), the run part cut at
      :data:`RUN_PART` and the node part at :data:`NODE_PART` characters.
      The digest (128 bits of SHA-256) covers both names, JSON-encoded as a
      pair, so no choice of separator characters makes two pairs hash alike.

    The admission policy (``deploy/admission/elasticrun-leases.yaml``) checks
    the plain form exactly and, in the hashed form, the run part exactly: a
    writer of one run cannot make a Lease under another run's name unless the
    two run names share their first :data:`RUN_PART` escaped characters (CEL
    cannot compute the digest).  Readers take a Lease for (run, node) only when
    its ``metadata.name`` is this name (:func:`elasticrun.api.leases.lease_run`).
    """
    plain = f"{run}.{node}"
    if len(plain) <= MAX_NAME and _PLAIN_LEASE.fullmatch(plain):
        return plain
    digest = hashlib.sha256(json.dumps([run, node]).encode()).hexdigest()[:DIGEST]
    return f"{_part(run, RUN_PART)}.{_part(node, NODE_PART)}.{digest}"


def _escape(text: str) -> str | None:
    """``text`` in ``[a-z0-9-]``, one-to-one (``-`` -> ``-0``, ``.`` -> ``-1``); None if it
    has other characters.  The admission policy computes the same with ``replace``."""
    if not _ESCAPABLE.fullmatch(text):
        return None
    return text.replace("-", "-0").replace(".", "-1")


def _part(text: str, limit: int) -> str:
    """A name's readable part of a hashed Lease name (the policy checks the run's)."""
    escaped = _escape(text)
    if escaped is None:  # a node name with other characters: readable only; the digest decides
        escaped = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "x"
    return escaped[:limit].rstrip("-") or "x"
