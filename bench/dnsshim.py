"""A ``getnameinfo()`` that never asks DNS, for measuring rendezvous without the resolver.

torch's TCPStore formats every peer's address with ``getnameinfo()`` when it
connects (c10d ``socket.cpp``), which is a reverse DNS query; this machine's
resolver drops bursts of them, so any backend that connects many stores at once
pays glibc's 5 s retry.  Loaded with ``LD_PRELOAD``, this shim adds
``NI_NUMERICHOST | NI_NUMERICSERV`` to every call: the address comes back as
digits, no query leaves the process, and everything else is glibc's own code.

The library is compiled with the system's C compiler on first use and cached
in ``~/.cache/elasticrun/``; nothing binary is kept in the repository.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

SOURCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <netdb.h>
#include <stddef.h>
#include <sys/socket.h>

typedef int (*getnameinfo_fn)(const struct sockaddr *, socklen_t, char *, socklen_t,
                              char *, socklen_t, int);

int getnameinfo(const struct sockaddr *addr, socklen_t addrlen, char *host,
                socklen_t hostlen, char *serv, socklen_t servlen, int flags) {
    static getnameinfo_fn next;
    if (next == NULL) {
        next = (getnameinfo_fn) dlsym(RTLD_NEXT, "getnameinfo");
    }
    return next(addr, addrlen, host, hostlen, serv, servlen,
                flags | NI_NUMERICHOST | NI_NUMERICSERV);
}
"""

CACHE = Path.home() / ".cache" / "elasticrun"


class ShimError(RuntimeError):
    """The shim could not be built (no C compiler)."""


def library() -> Path:
    """The shim's shared object, built once per source text."""
    digest = hashlib.sha256(SOURCE.encode()).hexdigest()[:12]
    target = CACHE / f"numeric-getnameinfo-{digest}.so"
    if target.exists():
        return target
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise ShimError("no C compiler (gcc) to build the getnameinfo shim; "
                        "apt-get install gcc, or run without --dns-neutral")
    CACHE.mkdir(parents=True, exist_ok=True)
    source = CACHE / f"numeric-getnameinfo-{digest}.c"
    source.write_text(SOURCE)
    partial = target.with_suffix(".so.partial")
    subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(partial), str(source),
                    "-ldl"], check=True, capture_output=True, timeout=120)
    partial.replace(target)
    return target


def environment() -> dict[str, str]:
    """The environment that loads the shim into a process (from its start)."""
    return {"LD_PRELOAD": str(library())}
