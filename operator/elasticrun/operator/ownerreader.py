"""Reading the workloads that own a run's pods: GETs by name, cached per run.

The operator never lists or watches Jobs, StatefulSets, JobSets or TrainJobs:
it reads each one by name, in the pod's namespace, when a pod of the run names
it as its controller (:mod:`.owners` decides what the objects say).  A run's
owners are read again when its pod set changes (the controller calls
:meth:`OwnerReader.invalidate`: a new pod of a scale-up must find the new size
before its node's join is sealed) and otherwise at most every
``OWNER_REFRESH`` seconds.  A workload the operator may not read (403) is "no
owner says", logged once per namespace and kind, and asked again only after
``FORBIDDEN_RETRY`` seconds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from elasticrun.api import crd, untrusted
from elasticrun.api.kube import ApiError, KubeClient
from elasticrun.operator.owners import (
    MAX_OWNER_DEPTH,
    MAX_WORKLOADS_PER_RUN,
    WORKLOADS,
    OwnerRef,
    Workload,
    makes_pods_of,
    outermost,
    supported,
    workload,
)

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (namespace, run)

#: A run's owners are read again after this long even when no pod changed (a
#: parallelism patch that creates no pod yet, a scale-down before the deletion).
OWNER_REFRESH = 3.0
#: An owner the operator may not read is asked again only after this long.
FORBIDDEN_RETRY = 60.0
#: At most this many (run, owner) pairs are remembered as logged (forged references
#: are anyone's to write: the log says it once each, up to this many).
MAX_NOTED = 1024


def workload_path(namespace: str, ref: OwnerRef) -> str:
    version, plural = WORKLOADS[(ref.group, ref.kind)]
    prefix = f"/apis/{ref.group}/{version}" if ref.group else f"/api/{version}"
    return f"{prefix}/namespaces/{namespace}/{plural}/{ref.name}"


class OwnerReader:
    """The outermost readable workload of each pod owner, per run, read through ``client``.

    Synchronous (the controller calls it from a worker thread); it never
    raises: anything that goes wrong is "this owner says nothing".
    """

    def __init__(self, client: KubeClient, refresh: float = OWNER_REFRESH) -> None:
        self.client = client
        self.refresh = refresh
        #: Per run, per pod owner: the outermost workload saying a size (or None)
        #: and the monotonic time to read it again.
        self._cache: dict[Key, dict[OwnerRef, tuple[Workload | None, float]]] = {}
        #: (namespace, kind) pairs whose 403 was logged already.
        self._forbidden_logged: set[tuple[str, str]] = set()
        #: (run, owner) pairs logged as not making the run's pods.
        self._not_the_runs: set[tuple[Key, OwnerRef]] = set()
        #: Monotonic time before which a (namespace, group, kind) forbidden is not asked.
        self._forbidden_until: dict[tuple[str, str, str], float] = {}

    def invalidate(self, key: Key) -> None:
        """The run's pod set changed: read its owners again at the next reconcile."""
        self._cache.pop(key, None)

    def forget(self, key: Key) -> None:
        self._cache.pop(key, None)
        self._not_the_runs = {k for k in self._not_the_runs if k[0] != key}

    def due_in(self, key: Key) -> float | None:
        """Seconds until the run's owners are due to be read again (None: none cached)."""
        cached = self._cache.get(key)
        if not cached:
            return None
        return max(0.0, min(until for _, until in cached.values()) - time.monotonic())

    def resolve(self, key: Key, refs: Iterable[OwnerRef]) -> dict[OwnerRef, Workload | None]:
        """For each pod owner reference: the outermost workload that says a size."""
        cached = self._cache.setdefault(key, {})
        wanted = sorted({r for r in refs if supported(r)}, key=lambda r: (r.kind, r.name))
        wanted = wanted[:MAX_WORKLOADS_PER_RUN]
        for gone in [r for r in cached if r not in wanted]:
            del cached[gone]
        clock = time.monotonic()
        result: dict[OwnerRef, Workload | None] = {}
        for ref in wanted:
            hit = cached.get(ref)
            if hit is None or clock >= hit[1]:
                found, retry = self._read_chain(key, ref)
                hit = (found, clock + retry)
                cached[ref] = hit
            result[ref] = hit[0]
        return result

    def _read_chain(self, key: Key, ref: OwnerRef) -> tuple[Workload | None, float]:
        """Follow controllers up from ``ref``; the outermost that says a size (if the
        chain makes the run's pods, :func:`makes_pods_of`), and how soon to read again."""
        namespace, run = key
        chain: list[Workload] = []
        retry = self.refresh
        current: OwnerRef | None = ref
        seen: set[str] = set()
        while current is not None and len(chain) < MAX_OWNER_DEPTH and supported(current) \
                and current.uid not in seen:
            seen.add(current.uid)
            read, forbidden = self._read(namespace, current)
            if forbidden:
                retry = max(retry, FORBIDDEN_RETRY) if not chain else retry
            if read is None:
                break
            chain.append(read)
            current = read.parent
        if chain and not makes_pods_of(chain, run):
            if (key, ref) not in self._not_the_runs and len(self._not_the_runs) < MAX_NOTED:
                self._not_the_runs.add((key, ref))
                log.info("%s/%s: a pod names %s as its controller, whose pod template is not "
                         "labelled %s=%s: it gives the run no size", namespace, run,
                         ref.source, crd.RUN_LABEL, run)
            return None, retry
        return outermost(chain), retry

    def _read(self, namespace: str, ref: OwnerRef) -> tuple[Workload | None, bool]:
        """One GET by name; (the workload, whether the read was forbidden)."""
        blocked = (namespace, ref.group, ref.kind)
        if time.monotonic() < self._forbidden_until.get(blocked, 0.0):
            return None, True
        try:
            obj = self.client.request("GET", workload_path(namespace, ref))
        except ApiError as exc:
            if exc.forbidden:
                self._forbidden_until[blocked] = time.monotonic() + FORBIDDEN_RETRY
                if (namespace, ref.kind) not in self._forbidden_logged:
                    self._forbidden_logged.add((namespace, ref.kind))
                    log.warning("%s: may not read %s %s (403), so it gives no desired size "
                                "(grant get on %s to the operator): %s", namespace, ref.kind,
                                ref.name, WORKLOADS[(ref.group, ref.kind)][1], exc.message)
                return None, True
            if not exc.not_found:
                log.info("%s: reading %s failed: %s", namespace, ref.source, exc)
            return None, False
        except Exception as exc:  # an owner is untrusted input: nothing escapes
            log.info("%s: reading %s failed: %s", namespace, ref.source, exc)
            return None, False
        self._forbidden_until.pop(blocked, None)
        found = workload(ref, untrusted.mapping(obj))
        if found is not None and found.note:
            log.debug("%s: %s gives no size: %s", namespace, ref.source, found.note)
        return found, False
