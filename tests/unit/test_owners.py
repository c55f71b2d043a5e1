"""The desired size from the workload owning a run's pods: size rules, coming, the status."""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
from typing import Any

import pytest

from elasticrun.api.crd import RUN_LABEL
from elasticrun.api.kube import ApiError
from elasticrun.api.leases import LeaseState
from elasticrun.api.model import (
    Desired,
    ElasticRun,
    Participant,
    RunSpec,
    RunStatus,
    StoreAddress,
    WaitingNode,
)
from elasticrun.api.naming import label_value
from elasticrun.operator import ownerreader
from elasticrun.operator.ownerreader import OwnerReader, workload_path
from elasticrun.operator.owners import (
    MAX_OWNER_DEPTH,
    NO_OWNER,
    OwnerRef,
    Ownership,
    PodView,
    Workload,
    coming,
    controller_ref,
    job_size,
    jobset_size,
    makes_pods_of,
    outermost,
    ownership,
    pod_view,
    statefulset_size,
    trainjob_size,
    workload,
)
from elasticrun.operator.reconcile import (
    DESIRED_ABOVE_MAX,
    DESIRED_BELOW_MIN,
    DESIRED_CONDITION,
    NO_DESIRED_SIZE,
    SEVERAL_OWNERS,
    Members,
    reconcile,
)

from builders import T0

MAX32 = 2**31 - 1
JOB = OwnerRef("batch", "Job", "train", "uid-job")
JOBSET = OwnerRef("jobset.x-k8s.io", "JobSet", "js", "uid-js")
TRAINJOB = OwnerRef("trainer.kubeflow.org", "TrainJob", "tj", "uid-tj")


def ref_dict(ref: OwnerRef, version: str = "v1", controller: Any = True) -> dict[str, Any]:
    api = f"{ref.group}/{version}" if ref.group else version
    return {"apiVersion": api, "kind": ref.kind, "name": ref.name, "uid": ref.uid,
            "controller": controller}


def obj(ref: OwnerRef, spec: dict[str, Any], owner: OwnerRef | None = None,
        uid: str | None = None, template_run: str | None = "r") -> dict[str, Any]:
    """A workload as read; a Job's or StatefulSet's pod template labelled for run ``r``."""
    meta: dict[str, Any] = {"name": ref.name, "uid": uid or ref.uid, "resourceVersion": "5"}
    if owner is not None:
        meta["ownerReferences"] = [ref_dict(owner)]
    if template_run is not None and ref.kind in ("Job", "StatefulSet"):
        spec = {**spec, "template": {"metadata": {"labels": {RUN_LABEL: template_run}}}}
    return {"metadata": meta, "spec": spec}


def view(name: str, owner: OwnerRef | None = JOB, phase: str = "Running", gated: bool = False,
         deleting: bool = False, uid: str | None = None) -> PodView:
    return PodView(name=name, uid=uid or f"u-{name}", owner=owner, phase=phase, gated=gated,
                   deleting=deleting)


# --------------------------------------------------------------------------- size rules


@pytest.mark.parametrize(("spec", "size"), [
    ({"parallelism": 4}, 4),
    ({}, 1),  # the API server's default
    ({"parallelism": 4, "completions": 3}, 3),
    ({"parallelism": 0}, 0),
    ({"parallelism": MAX32}, MAX32),
    ({"parallelism": 4, "suspend": True}, None),  # Kueue: not admitted (yet, or any more)
    ({"parallelism": 4, "suspend": False}, 4),
    ({"parallelism": "4"}, None),
    ({"parallelism": True}, None),
    ({"parallelism": -1}, None),
    ({"parallelism": 2**63}, None),
    ({"parallelism": 2.0}, None),
])
def test_a_jobs_size_is_its_parallelism_unless_suspended(spec: dict[str, Any],
                                                         size: int | None) -> None:
    assert job_size(spec)[0] == size


def test_a_statefulsets_size_is_its_replicas() -> None:
    assert statefulset_size({"replicas": 3})[0] == 3
    assert statefulset_size({})[0] == 1
    assert statefulset_size({"replicas": None})[0] == 1
    assert statefulset_size({"replicas": "3"})[0] is None


def _replicated(name: str, replicas: Any, parallelism: Any) -> dict[str, Any]:
    return {"name": name, "replicas": replicas,
            "template": {"spec": {"parallelism": parallelism, "completions": parallelism}}}


def test_a_jobsets_size_is_the_sum_of_replicas_times_parallelism() -> None:
    spec = {"replicatedJobs": [_replicated("node", 2, 4), _replicated("extra", 1, 1)]}
    assert jobset_size(spec)[0] == 9
    assert jobset_size({"replicatedJobs": [{"name": "n", "template": {"spec": {}}}]})[0] == 1
    assert jobset_size({**spec, "suspend": True})[0] is None
    assert jobset_size({"replicatedJobs": []})[0] is None
    assert jobset_size({"replicatedJobs": "many"})[0] is None
    bad, note = jobset_size({"replicatedJobs": [_replicated("node", 2, "x")]})
    assert bad is None and "node" in (note or "")
    # Each factor is a valid int32, the product is not a count.
    huge, note = jobset_size({"replicatedJobs": [_replicated("node", MAX32, MAX32)]})
    assert huge is None and "maximum" in (note or "")


def test_a_trainjobs_size_is_num_nodes_else_its_jobset_says() -> None:
    assert trainjob_size({"trainer": {"numNodes": 3}})[0] == 3
    assert trainjob_size({"trainer": {"numNodes": 3}, "suspend": True})[0] is None
    assert trainjob_size({"trainer": {}})[0] is None
    assert trainjob_size({"trainer": "x"})[0] is None
    assert trainjob_size({"trainer": {"numNodes": -2}})[0] is None
    # Job (parallelism 1) -> JobSet (2 x 1) -> TrainJob without numNodes: the JobSet says.
    chain = [workload(JOB, obj(JOB, {"parallelism": 1}, JOBSET)),
             workload(JOBSET, obj(JOBSET, {"replicatedJobs": [_replicated("n", 2, 1)]},
                                  TRAINJOB)),
             workload(TRAINJOB, obj(TRAINJOB, {"trainer": {}}))]
    assert all(c is not None for c in chain)
    found = outermost(c for c in chain if c is not None)
    assert found is not None and found.ref == JOBSET and found.size == 2
    # With numNodes, the TrainJob (outermost) is the one followed.
    chain[2] = workload(TRAINJOB, obj(TRAINJOB, {"trainer": {"numNodes": 4}}))
    found = outermost(c for c in chain if c is not None)
    assert found is not None and found.ref == TRAINJOB and found.size == 4


def test_a_workload_read_under_the_name_with_another_uid_is_not_the_owner() -> None:
    assert workload(JOB, obj(JOB, {"parallelism": 2}, uid="someone-else")) is None
    found = workload(JOB, obj(JOB, {"parallelism": 2}))
    assert found is not None and found.size == 2 and found.parent is None
    unknown = OwnerRef("apps", "ReplicaSet", "rs", "u")
    other = workload(unknown, obj(unknown, {"replicas": 3}))
    assert other is not None and other.size is None


def test_a_workload_gives_a_size_only_to_the_run_its_pod_template_is_labelled_for() -> None:
    job = workload(JOB, obj(JOB, {"parallelism": 2}, template_run="r"))
    assert job is not None and job.template_run == "r"
    assert makes_pods_of([job], "r")
    assert not makes_pods_of([job], "another-run")
    unlabelled = workload(JOB, obj(JOB, {"parallelism": 2}, template_run=None))
    assert unlabelled is not None and not makes_pods_of([unlabelled], "r")
    # An empty label: the webhook names the run after the outermost workload of the chain.
    empty = workload(JOB, obj(JOB, {"parallelism": 1}, JOBSET, template_run=""))
    jobset = workload(JOBSET, obj(JOBSET, {"replicatedJobs": [_replicated("n", 2, 1)]}))
    assert empty is not None and jobset is not None
    assert makes_pods_of([empty, jobset], "js") and makes_pods_of([empty, jobset], "train")
    assert not makes_pods_of([empty, jobset], "r")
    # A long run name is in the label as its label value.
    long_name = "x" * 100
    hashed = workload(JOB, obj(JOB, {}, template_run=label_value(long_name)))
    assert hashed is not None and makes_pods_of([hashed], long_name)
    assert not makes_pods_of([], "r")


def test_only_one_controller_reference_counts() -> None:
    assert controller_ref(obj(JOBSET, {}, JOB)) == JOB
    both = {"metadata": {"ownerReferences": [ref_dict(JOB), ref_dict(JOBSET)]}}
    assert controller_ref(both) is None
    assert controller_ref({"metadata": {"ownerReferences": [ref_dict(JOB, controller=None)]}}) \
        is None
    assert controller_ref({"metadata": {"ownerReferences": [{"kind": "Job"}]}}) is None
    assert controller_ref({"metadata": {"ownerReferences": "x"}}) is None
    assert controller_ref({"metadata": []}) is None


def test_a_pod_view_reads_gates_phase_and_deletion_tolerantly() -> None:
    pod = {"metadata": {"name": "p", "uid": "u", "ownerReferences": [ref_dict(JOB)]},
           "spec": {"schedulingGates": [{"name": "kueue.x-k8s.io/elastic-job"}]}}
    seen = pod_view(pod)
    assert seen == PodView("p", "u", JOB, "Pending", gated=True, deleting=False)
    assert seen.live
    gone = pod_view({"metadata": {"name": "p", "deletionTimestamp": "2026-01-01T00:00:00Z"},
                     "spec": {"schedulingGates": "x"}, "status": {"phase": "Running"}})
    assert gone is not None and not gone.live and not gone.gated
    done = pod_view({"metadata": {"name": "p"}, "status": {"phase": "Succeeded"}})
    assert done is not None and not done.live
    assert pod_view({"metadata": {"name": 5}}) is None
    assert pod_view({}) is None


# --------------------------------------------------------------------------- ownership, coming


def _resolved(*pairs: tuple[OwnerRef, int | None]) -> dict[OwnerRef, Workload | None]:
    return {ref: Workload(ref=ref, size=size, parent=None) for ref, size in pairs}


def test_the_pods_of_one_owner_give_its_size() -> None:
    pods = [view("p0"), view("p1"), view("gone", deleting=True), view("free", owner=None)]
    owned = ownership(pods, _resolved((JOB, 4)))
    assert (owned.size, owned.source, owned.conflict) == (4, "Job/train", ())
    assert [p.name for p in owned.pods] == ["p0", "p1"]


def test_pods_of_two_owners_give_no_size_but_the_conflict() -> None:
    other = OwnerRef("apps", "StatefulSet", "other", "uid-sts")
    owned = ownership([view("p0"), view("p1", owner=other)], _resolved((JOB, 2), (other, 3)))
    assert owned.size is None and owned.conflict == ("Job/train", "StatefulSet/other")


def test_a_pod_whose_owner_says_nothing_counts_for_no_one() -> None:
    unread = OwnerRef("batch", "Job", "forged", "uid-forged")
    owned = ownership([view("p0"), view("x", owner=unread)],
                      {**_resolved((JOB, 2)), unread: None})
    assert owned.size == 2 and owned.conflict == () and [p.name for p in owned.pods] == ["p0"]
    assert ownership([view("p0")], {JOB: None}) == NO_OWNER
    assert ownership([view("p0")], _resolved((JOB, None))) == NO_OWNER


def test_coming_counts_gated_pending_and_running_pods_that_have_not_asked() -> None:
    pods = [view("gated", phase="Pending", gated=True), view("pending", phase="Pending"),
            view("running"), view("member"), view("by-name", uid="u-x"),
            view("leaving", deleting=True), view("done", phase="Succeeded")]
    assert coming(pods, joined_pods={"by-name"}, joined_uids={"u-member"}) == 3


# --------------------------------------------------------------------------- the status


def _run(spec: RunSpec | None = None, **status: Any) -> ElasticRun:
    participants = tuple(Participant(name=n, rank=i, address="10.0.0.1", store_port=1 + i,
                                     pod=n, pod_uid=f"u-{n}") for i, n in enumerate(("a", "b")))
    base = RunStatus(phase="Running", round=1, signal=1, participants=participants,
                     store=StoreAddress("10.0.0.1", 1), sealed_at=T0)
    return ElasticRun("r", "ns", spec or RunSpec(min_nodes=2, max_nodes=4),
                      base.replace(**status), "7", generation=3, uid="run-uid")


def _job(size: int, *names: str, **pod: Any) -> Ownership:
    return ownership([view(n, **pod) for n in names], _resolved((JOB, size)))


def test_the_owners_size_is_written_with_its_source_and_the_pods_coming() -> None:
    run = _run()
    members = Members(ownership=_job(4, "a", "b", "c", "d"))
    plan = reconcile(run, members, T0)
    assert plan.status is not None and plan.status.desired == Desired(4, "Job/train", 2)
    assert plan.events == [] and plan.status.condition(DESIRED_CONDITION) is None
    # Written: nothing more to write, nothing more to say.
    again = reconcile(run.replace_status(plan.status), members, T0)
    assert again.status is None and again.events == []


def test_a_new_size_is_written_at_once_while_nodes_are_joining() -> None:
    joining = WaitingNode(name="c", since=T0, address="10.0.0.3", pod="c", pod_uid="u-c")
    run = _run(waiting=(joining,), desired=Desired(2, "Job/train", 0))
    lease = LeaseState(node="c", holder="c", renewed=T0, duration=15, join=joining,
                       owner_uid=run.uid, seen=T0)
    members = Members(leases={"c": lease}, ownership=_job(4, "a", "b", "c", "d"))
    plan = reconcile(run, members, T0 + dt.timedelta(seconds=0.1))
    assert plan.status is not None and plan.status.desired == Desired(4, "Job/train", 1)
    # The same size with only `coming` changed waits for the joins to be quiet.
    steady = run.replace_status(run.status.replace(desired=Desired(4, "Job/train", 2)))
    assert reconcile(steady, members, T0 + dt.timedelta(seconds=0.1)).status is None
    later = reconcile(steady, members, T0 + dt.timedelta(seconds=2))
    assert later.status is not None and later.status.desired == Desired(4, "Job/train", 1)


def test_no_owner_clears_the_desired_size() -> None:
    run = _run(desired=Desired(4, "Job/train", 2))
    plan = reconcile(run, Members(), T0)
    assert plan.status is not None and plan.status.desired is None
    assert plan.status.to_dict().get("desired") is None


def _event_reasons(plan: Any) -> list[str]:
    return [reason for type_, reason, _ in plan.events if type_ == "Warning"]


def test_a_size_above_max_nodes_is_one_event_and_a_condition_until_it_fits() -> None:
    run = _run()
    above = Members(ownership=_job(6, "a", "b", "c", "d", "e", "f"))
    plan = reconcile(run, above, T0)
    assert plan.status is not None
    condition = plan.status.condition(DESIRED_CONDITION)
    assert condition is not None and condition.status == "True"
    assert condition.reason == DESIRED_ABOVE_MAX
    assert "Job/train asks for 6 nodes" in (condition.message or "")
    assert "2 pod(s) will wait as spares" in (condition.message or "")
    assert _event_reasons(plan) == [DESIRED_ABOVE_MAX]
    assert plan.events[0][2] == condition.message
    # Reconciled again from what was written: no second Event.
    written = run.replace_status(plan.status)
    again = reconcile(written, above, T0 + dt.timedelta(seconds=5))
    assert again.events == []
    # Another size above max is a change: one more Event.
    more = reconcile(written, Members(ownership=_job(8, "a", "b")), T0)
    assert _event_reasons(more) == [DESIRED_ABOVE_MAX]
    assert more.status is not None and "4 pod(s)" in (
        more.status.condition(DESIRED_CONDITION).message or "")  # type: ignore[union-attr]
    # It fits again: the condition clears, without a Warning.
    fits = reconcile(written, Members(ownership=_job(4, "a", "b")), T0)
    assert fits.status is not None and fits.events == []
    cleared = fits.status.condition(DESIRED_CONDITION)
    assert cleared is not None and cleared.status == "False"


def test_a_size_below_min_nodes_says_the_run_cannot_form() -> None:
    plan = reconcile(_run(RunSpec(min_nodes=3, max_nodes=4)), Members(ownership=_job(2, "a")),
                     T0)
    assert plan.status is not None
    condition = plan.status.condition(DESIRED_CONDITION)
    assert condition is not None and condition.reason == DESIRED_BELOW_MIN
    assert "cannot form" in (condition.message or "")
    assert _event_reasons(plan) == [DESIRED_BELOW_MIN]


def test_pods_of_two_owners_are_a_condition_and_no_desired_size() -> None:
    other = OwnerRef("apps", "StatefulSet", "other", "uid-sts")
    owned = ownership([view("a"), view("b", owner=other)], _resolved((JOB, 2), (other, 2)))
    plan = reconcile(_run(desired=Desired(2, "Job/train", 0)), Members(ownership=owned), T0)
    assert plan.status is not None and plan.status.desired is None
    condition = plan.status.condition(DESIRED_CONDITION)
    assert condition is not None and condition.reason == SEVERAL_OWNERS
    assert "Job/train, StatefulSet/other" in (condition.message or "")
    assert _event_reasons(plan) == [SEVERAL_OWNERS]
    # The pods of both go away: the condition clears, saying no workload gives a size.
    gone = reconcile(_run().replace_status(plan.status), Members(), T0)
    assert gone.status is not None and gone.events == []
    cleared = gone.status.condition(DESIRED_CONDITION)
    assert cleared is not None and (cleared.status, cleared.reason) == ("False", NO_DESIRED_SIZE)


def test_a_postponed_write_posts_no_event() -> None:
    joining = WaitingNode(name="c", since=T0, address="10.0.0.3", pod="c")
    run = _run(waiting=(joining,), desired=Desired(6, "Job/train", 0))
    lease = LeaseState(node="c", holder="c", renewed=T0, duration=15, join=joining,
                       owner_uid=run.uid, seen=T0)
    members = Members(leases={"c": lease}, ownership=_job(6, "a", "b", "c"))
    plan = reconcile(run, members, T0 + dt.timedelta(seconds=0.1))
    assert plan.status is None and plan.events == []


# --------------------------------------------------------------------------- reading owners


class FakeClient:
    """GETs answered from a dict of path -> object (or an ApiError to raise)."""

    def __init__(self, objects: dict[str, Any]) -> None:
        self.objects = objects
        self.gets: list[str] = []

    def request(self, method: str, path: str, **_: Any) -> Any:
        assert method == "GET"
        self.gets.append(path)
        found = self.objects.get(path)
        if isinstance(found, Exception):
            raise found
        if found is None:
            raise ApiError(404, "NotFound", "not found", {})
        return found


KEY = ("ns", "r")


def _reader(objects: dict[OwnerRef, Any]) -> tuple[OwnerReader, FakeClient]:
    client = FakeClient({workload_path("ns", ref): o for ref, o in objects.items()})
    return OwnerReader(client, refresh=3.0), client  # type: ignore[arg-type]


def test_the_reader_follows_owners_up_to_the_outermost_it_can_read() -> None:
    reader, client = _reader({
        JOB: obj(JOB, {"parallelism": 1}, JOBSET),
        JOBSET: obj(JOBSET, {"replicatedJobs": [_replicated("n", 3, 1)]}, TRAINJOB),
        TRAINJOB: obj(TRAINJOB, {"trainer": {"numNodes": 3}})})
    found = reader.resolve(KEY, {JOB})[JOB]
    assert found is not None and found.ref == TRAINJOB and found.size == 3
    assert client.gets == [workload_path("ns", r) for r in (JOB, JOBSET, TRAINJOB)]
    assert client.gets[0] == "/apis/batch/v1/namespaces/ns/jobs/train"
    # Cached until the refresh is due, or the pod set changes.
    reader.resolve(KEY, {JOB})
    assert len(client.gets) == 3
    due = reader.due_in(KEY)
    assert due is not None and 0 < due <= 3.0
    reader.invalidate(KEY)
    reader.resolve(KEY, {JOB})
    assert len(client.gets) == 6


def test_a_missing_parent_leaves_the_inner_owner() -> None:
    reader, _ = _reader({JOB: obj(JOB, {"parallelism": 2}, JOBSET)})
    found = reader.resolve(KEY, {JOB})[JOB]
    assert found is not None and found.ref == JOB and found.size == 2


def test_a_forged_reference_to_a_workload_with_another_uid_says_nothing() -> None:
    forged = dataclasses.replace(JOB, uid="not-its-uid")
    reader, _ = _reader({forged: obj(JOB, {"parallelism": 2})})
    assert reader.resolve(KEY, {forged}) == {forged: None}


def test_a_pod_naming_a_workload_not_made_for_its_run_gets_no_size() -> None:
    # A real Job of the namespace (right name, right uid), but its pods are another run's.
    reader, _ = _reader({JOB: obj(JOB, {"parallelism": 7}, template_run="other-run")})
    assert reader.resolve(KEY, {JOB}) == {JOB: None}
    reader, _ = _reader({JOB: obj(JOB, {"parallelism": 7}, template_run=None)})
    assert reader.resolve(KEY, {JOB}) == {JOB: None}


def test_a_chain_of_owners_is_followed_a_bounded_depth() -> None:
    # A Job owned by a Job owned by ... (each hop a GET): at most MAX_OWNER_DEPTH reads.
    refs = [OwnerRef("batch", "Job", f"j{i}", f"u{i}") for i in range(10)]
    reader, client = _reader({ref: obj(ref, {"parallelism": i + 1}, refs[i + 1] if i < 9
                                       else refs[0]) for i, ref in enumerate(refs)})
    found = reader.resolve(KEY, {refs[0]})[refs[0]]
    assert len(client.gets) == MAX_OWNER_DEPTH
    assert found is not None and found.size == MAX_OWNER_DEPTH


def test_a_forbidden_owner_says_nothing_is_logged_once_and_not_asked_in_a_loop(
        caplog: pytest.LogCaptureFixture) -> None:
    denied = ApiError(403, "Forbidden", 'jobs.batch "train" is forbidden', {})
    reader, client = _reader({JOB: denied})
    caplog.set_level(logging.WARNING, logger=ownerreader.__name__)
    for _ in range(5):
        assert reader.resolve(KEY, {JOB}) == {JOB: None}
        reader.invalidate(KEY)  # even a changing pod set does not make it ask again
    assert len(client.gets) == 1
    warnings = [r for r in caplog.records if "403" in r.getMessage()]
    assert len(warnings) == 1 and "grant get on jobs" in warnings[0].getMessage()
    due = reader.due_in(KEY)
    assert due is None  # invalidated: nothing cached


def test_no_reading_failure_escapes() -> None:
    class Broken(FakeClient):
        def request(self, method: str, path: str, **_: Any) -> Any:
            raise RuntimeError("a body that is not JSON")

    reader = OwnerReader(Broken({}))  # type: ignore[arg-type]
    assert reader.resolve(KEY, {JOB}) == {JOB: None}
    unsupported = OwnerRef("apps", "ReplicaSet", "rs", "u")
    assert reader.resolve(KEY, {unsupported}) == {}


def test_the_operators_seal_carries_the_owners_size_read_in_the_same_pass() -> None:
    names = ["n0", "n1"]
    joined = {n: WaitingNode(name=n, address="10.0.0.1", store_port=29400, since=T0, pod=n)
              for n in names}
    leases = {n: LeaseState(node=n, holder=n, renewed=T0, duration=10, join=joined[n],
                            owner_uid="uid", seen=T0) for n in names}
    run = ElasticRun("r", "ns", RunSpec(min_nodes=2, max_nodes=2), RunStatus(), "7", uid="uid")
    members = Members(leases=leases, ownership=_job(2, "n0", "n1"))
    plan = reconcile(run, members, T0 + dt.timedelta(seconds=5))
    assert plan.sealed and plan.status is not None and plan.status.round == 1
    # Both pods are members of the round it sealed: none is coming.
    assert plan.status.desired == Desired(2, "Job/train", 0)
