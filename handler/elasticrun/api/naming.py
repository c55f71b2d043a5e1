"""Names of the objects that belong to a run (Leases), and label-safe values."""

from __future__ import annotations

import hashlib
import re

_LABEL_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_OBJECT_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


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
    """``<run>.<node>``, hashed down when that would not be a valid object name."""
    name = f"{run}.{node}".lower()
    if len(name) <= 253 and _OBJECT_NAME.fullmatch(name) and ".." not in name \
            and name == f"{run}.{node}":
        return name
    digest = hashlib.sha256(f"{run}\0{node}".encode()).hexdigest()[:16]
    return f"{run[:200]}.{digest}"
