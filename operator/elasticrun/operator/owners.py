"""The desired size of a run, read from the workload that owns its pods: pure rules.

A run's pods are made by a workload (a Job, a StatefulSet, a JobSet, a
TrainJob) whose own spec says how many pods it wants.  The operator follows
each pod's controller ``ownerReference`` to that workload, and on up through
the workload's own controller (a Job of a JobSet of a TrainJob) to the
outermost one it can read, which gives ``status.desired``.  Everything here is
read from objects elasticrun does not own, so it goes through the tolerant
reader (:mod:`elasticrun.api.untrusted`) and never raises: a value that is not
a bounded count means "this workload says nothing".

The I/O (GETs by name, the cache) is :mod:`elasticrun.operator.ownerreader`;
what the status then says is :func:`elasticrun.operator.reconcile.reconcile`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from elasticrun.api import crd, untrusted
from elasticrun.api.naming import label_value

#: The workload kinds whose size the operator reads, by (API group, kind): the
#: REST version and plural of each.  Any other owner (a ReplicaSet, a custom
#: controller) says nothing.
WORKLOADS: dict[tuple[str, str], tuple[str, str]] = {
    ("batch", "Job"): ("v1", "jobs"),
    ("apps", "StatefulSet"): ("v1", "statefulsets"),
    ("jobset.x-k8s.io", "JobSet"): ("v1alpha2", "jobsets"),
    ("trainer.kubeflow.org", "TrainJob"): ("v1alpha1", "trainjobs"),
}
#: How many owners up from a pod's workload are followed (Job -> JobSet -> TrainJob
#: is two); a chain of owners longer than this stops at the last one read.
MAX_OWNER_DEPTH = 3
#: Distinct workloads read for one run at most; pods of further ones are ignored.
MAX_WORKLOADS_PER_RUN = 8
#: Most replicatedJobs of a JobSet counted (its CRD allows far fewer in practice).
MAX_REPLICATED_JOBS = 64


@dataclass(frozen=True)
class OwnerRef:
    """A controller ownerReference, as written on an object (untrusted)."""

    group: str
    kind: str
    name: str
    uid: str

    @property
    def source(self) -> str:
        return f"{self.kind}/{self.name}"


@dataclass(frozen=True)
class PodView:
    """What the operator keeps of one pod of a run: enough to count it as coming."""

    name: str
    uid: str | None
    owner: OwnerRef | None
    #: ``status.phase`` (Pending when absent: a pod the scheduler has not seen).
    phase: str
    #: ``spec.schedulingGates`` non-empty (Kueue holds an elastic Job's new pods so).
    gated: bool
    #: ``metadata.deletionTimestamp`` is set.
    deleting: bool

    @property
    def live(self) -> bool:
        """Not being deleted and not finished: a pod that is, or will be, a node."""
        return not self.deleting and self.phase in ("Pending", "Running")


@dataclass(frozen=True)
class Workload:
    """One workload as read: its identity, what it asks for, and its own controller."""

    ref: OwnerRef
    #: How many pods it asks for now; None when it says nothing (suspended, unreadable).
    size: int | None
    #: Its own controller (a JobSet's TrainJob), to be followed up.
    parent: OwnerRef | None
    #: The run label of the pods it makes (``spec.template``'s, for the kinds that
    #: make pods: Job, StatefulSet): "" when empty, None when absent.
    template_run: str | None = None
    #: Why it says nothing, when it does not (for the log).
    note: str | None = None


@dataclass(frozen=True)
class Ownership:
    """What the owners of a run's pods say: the operator's input to ``status.desired``."""

    #: The desired size; None when no owner says (no owned pod, nothing readable,
    #: a suspended workload, or pods of several workloads).
    size: int | None = None
    #: The workload it was read from, ``Kind/name``.
    source: str | None = None
    #: Its pods in the run (all of them, joined or not); :func:`coming` counts them.
    pods: tuple[PodView, ...] = ()
    #: Several workloads own the run's pods: their sources, sorted (no size then).
    conflict: tuple[str, ...] = ()


NO_OWNER = Ownership()


# --------------------------------------------------------------------------- reading objects


def _count(value: Any, default: int | None = None) -> int | None:
    """A count of pods from an untrusted field: an int in 0..the counters' maximum."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value if 0 <= value <= crd.counter_maximum() else None


def controller_ref(obj: Mapping[str, Any]) -> OwnerRef | None:
    """The object's controller ownerReference (``controller: true``), if readable.

    Only one may be the controller (the API server enforces it); a list that
    holds several is read as having none.
    """
    refs = untrusted.mapping(obj.get("metadata")).get("ownerReferences")
    if not isinstance(refs, list):
        return None
    found = [untrusted.mapping(r) for r in refs[:32] if untrusted.mapping(r).get("controller")
             is True]
    if len(found) != 1:
        return None
    ref = found[0]
    api_version, kind = untrusted.text(ref.get("apiVersion")), untrusted.text(ref.get("kind"))
    name, uid = untrusted.text(ref.get("name")), untrusted.text(ref.get("uid"), 128)
    if api_version is None or kind is None or name is None or uid is None:
        return None
    group = api_version.rpartition("/")[0]
    return OwnerRef(group=group, kind=kind, name=name, uid=uid)


def pod_view(pod: Mapping[str, Any]) -> PodView | None:
    """The pod as the operator counts it; None when it has no name."""
    meta = untrusted.mapping(pod.get("metadata"))
    name = untrusted.text(meta.get("name"))
    if name is None:
        return None
    spec, status = untrusted.mapping(pod.get("spec")), untrusted.mapping(pod.get("status"))
    gates = spec.get("schedulingGates")
    phase = untrusted.text(status.get("phase"), 32) or "Pending"
    return PodView(name=name, uid=untrusted.text(meta.get("uid"), 128),
                   owner=controller_ref(pod), phase=phase,
                   gated=isinstance(gates, list) and bool(gates),
                   deleting=meta.get("deletionTimestamp") is not None)


def job_size(spec: Mapping[str, Any]) -> tuple[int | None, str | None]:
    """A Job's pods: ``parallelism`` (1 when absent), at most ``completions``.

    A suspended Job (Kueue suspends a Job until its workload is admitted, and
    again when it is preempted) says nothing: it runs no pods, the ones left
    are being deleted, and the count it resumes with is whatever is admitted
    then (partial admission may lower ``parallelism``).
    """
    if spec.get("suspend") is True:
        return None, "suspended"
    parallelism = _count(spec.get("parallelism"), 1)
    completions = _count(spec.get("completions"))
    if parallelism is None:
        return None, "spec.parallelism is not a count"
    if completions is not None:
        return min(parallelism, completions), None
    return parallelism, None


def statefulset_size(spec: Mapping[str, Any]) -> tuple[int | None, str | None]:
    """A StatefulSet's ``replicas`` (1 when absent)."""
    replicas = _count(spec.get("replicas"), 1)
    return (replicas, None) if replicas is not None else (None, "spec.replicas is not a count")


def jobset_size(spec: Mapping[str, Any]) -> tuple[int | None, str | None]:
    """The sum over ``replicatedJobs`` of ``replicas`` x the Job template's ``parallelism``.

    A suspended JobSet says nothing (as a suspended Job); a sum past the
    counters' maximum is not a size.
    """
    if spec.get("suspend") is True:
        return None, "suspended"
    jobs = spec.get("replicatedJobs")
    if not isinstance(jobs, list) or not jobs or len(jobs) > MAX_REPLICATED_JOBS:
        return None, "spec.replicatedJobs is not a list of jobs"
    total = 0
    for item in jobs:
        job = untrusted.mapping(item)
        replicas = _count(job.get("replicas"), 1)
        template = untrusted.mapping(untrusted.mapping(job.get("template")).get("spec"))
        per_job, note = job_size(template)
        if replicas is None or per_job is None:
            return None, f"replicatedJob {untrusted.text(job.get('name')) or '?'}: " \
                         f"{note or 'replicas is not a count'}"
        total += replicas * per_job
        if total > crd.counter_maximum():
            return None, "replicas x parallelism exceeds the counters' maximum"
    return total, None


def trainjob_size(spec: Mapping[str, Any]) -> tuple[int | None, str | None]:
    """A TrainJob's ``spec.trainer.numNodes``.

    Without it, the number comes from the TrainJob's runtime, which Trainer
    copies into the JobSet it makes: the TrainJob says nothing, so the size is
    the JobSet's (the next workload down the chain).
    """
    if spec.get("suspend") is True:
        return None, "suspended"
    nodes = untrusted.mapping(spec.get("trainer")).get("numNodes")
    if nodes is None:
        return None, "no spec.trainer.numNodes (the runtime's default: its JobSet says)"
    size = _count(nodes)
    return (size, None) if size is not None else (None, "spec.trainer.numNodes is not a count")


_SIZES: dict[str, Callable[[Mapping[str, Any]], tuple[int | None, str | None]]] = {
    "Job": job_size, "StatefulSet": statefulset_size, "JobSet": jobset_size,
    "TrainJob": trainjob_size,
}


def workload(ref: OwnerRef, obj: Mapping[str, Any]) -> Workload | None:
    """The workload ``ref`` names, from the object read under its name; None when that
    object is not it (another uid: deleted and re-created, or a forged reference)."""
    meta = untrusted.mapping(obj.get("metadata"))
    if untrusted.text(meta.get("uid"), 128) != ref.uid or untrusted.text(
            meta.get("name")) != ref.name:
        return None
    spec = untrusted.mapping(obj.get("spec"))
    rule = _SIZES.get(ref.kind)
    size, note = rule(spec) if rule else (None, "unknown kind")
    labels = untrusted.mapping(untrusted.mapping(untrusted.mapping(spec.get("template")).get(
        "metadata")).get("labels"))
    template_run = labels.get(crd.RUN_LABEL)
    return Workload(ref=ref, size=size, note=note, parent=controller_ref(obj),
                    template_run=template_run if isinstance(template_run, str) else None)


def supported(ref: OwnerRef) -> bool:
    return (ref.group, ref.kind) in WORKLOADS


def makes_pods_of(chain: Sequence[Workload], run: str) -> bool:
    """Whether the pods' own workload (``chain[0]``) makes pods of ``run``.

    Its pod template must carry the run label: ``run`` itself (or its label
    value), or empty with ``run`` the name of a workload of the chain (the
    webhook names such a pod's run after its outermost workload).  A pod's
    ownerReference is whatever its creator wrote, so a pod of run R naming
    some other workload of the namespace, one not made for R, gives R no size.
    """
    if not chain:
        return False
    label = chain[0].template_run
    if label is None:
        return False
    if label:
        return label in (run, label_value(run))
    return run in {w.ref.name for w in chain}


def outermost(chain: Iterable[Workload]) -> Workload | None:
    """The outermost workload of a chain (pod's owner first) that says a size.

    A TrainJob without ``numNodes`` leaves the size to its JobSet; a chain in
    which nothing says a size says nothing.
    """
    found = None
    for item in chain:
        if item.size is not None:
            found = item
    return found


# --------------------------------------------------------------------------- deciding


def ownership(pods: Iterable[PodView],
              resolved: Mapping[OwnerRef, Workload | None]) -> Ownership:
    """What the owners of the run's live pods say.

    ``resolved`` maps each pod owner reference to the outermost workload read
    for it that says a size (None: nothing readable says one).  Pods whose
    owner says nothing are not counted for anyone; when the rest belong to
    more than one workload, there is no desired size, only the conflict.
    """
    by_source: dict[str, tuple[Workload, list[PodView]]] = {}
    for pod in pods:
        if pod.owner is None or not pod.live:
            continue
        found = resolved.get(pod.owner)
        if found is None or found.size is None:
            continue
        by_source.setdefault(found.ref.source, (found, []))[1].append(pod)
    if not by_source:
        return NO_OWNER
    if len(by_source) > 1:
        return Ownership(conflict=tuple(sorted(by_source)))
    ((source, (found, owned)),) = by_source.items()
    return Ownership(size=found.size, source=source,
                     pods=tuple(sorted(owned, key=lambda p: p.name)))


def coming(owned: Iterable[PodView], joined_pods: set[str], joined_uids: set[str]) -> int:
    """Pods of the owner that exist, are not being deleted, and have not asked to join.

    A pod has asked when a member, a waiting entry or a join request names it
    (by uid where the node recorded one, else by pod name).  Gated, Pending and
    Running-but-not-joined pods all count.
    """
    count = 0
    for pod in owned:
        if not pod.live:
            continue
        if (pod.uid is not None and pod.uid in joined_uids) or pod.name in joined_pods:
            continue
        count += 1
    return count
