"""Which Lease is whose: names that cannot collide, and only genuine Leases acted on.

docs/security.md rows 40-49: ``naming.lease_name`` is one-to-one over (run,
node) pairs, readers take a Lease only under its computed name, the operator
deletes, writes and grants only Leases owned by the run (observed uid), and
a Lease it cannot delete makes no loop.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import re
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from elasticrun.api import crd
from elasticrun.api.gateway import OperatorGateway
from elasticrun.api.kube import ApiError
from elasticrun.api.leases import (
    JOIN_ANNOTATION,
    UNREACHABLE_ANNOTATION,
    LeaseState,
    Unreachable,
    holder_alive,
    holder_identity,
    join_annotations,
    join_value,
    lease_run,
    lease_state,
    node_lease,
    owned_by,
    unreachable_value,
)
from elasticrun.api.model import (
    ElasticRun,
    LostMember,
    Participant,
    RunSpec,
    RunStatus,
    StoreAddress,
    WaitingNode,
)
from elasticrun.api.naming import label_value, lease_name
from elasticrun.operator import runrbac
from elasticrun.operator.executor import PlanExecutor
from elasticrun.operator.reconcile import EXPIRED_LEASE_RECHECK, Members, Plan, reconcile

from builders import T0

#: A Kubernetes object name (DNS subdomain), as the API server validates it.
SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")

_label = st.from_regex(r"[a-z0-9]([-a-z0-9]{0,8}[a-z0-9])?", fullmatch=True)
#: Run names: DNS subdomains, often with dots, sometimes long.
run_names = st.lists(_label, min_size=1, max_size=4).map(".".join) | st.builds(
    lambda a, n: (a * n)[:253].strip("-.") or "r", _label, st.integers(1, 60))
#: Node names: anything of 1-253 characters (settings accept that), mostly pod-like.
node_names = st.lists(_label, min_size=1, max_size=3).map(".".join) | st.text(
    min_size=1, max_size=80) | st.builds(lambda a, n: (a * n)[:253] or "n", _label,
                                         st.integers(1, 40))


# --------------------------------------------------------------------------- names


def test_dotted_names_that_used_to_meet_get_different_leases() -> None:
    # Issue 20, case 3: both were "team.b.b-0".
    assert lease_name("team", "b.b-0") != lease_name("team.b", "b-0")
    assert lease_name("team-b", "b-0") == "team-b.b-0"  # the common case keeps its name
    assert lease_name("run-a", "run-a-0") == "run-a.run-a-0"
    # One dot for the plain form, two for the hashed one: the shapes never meet.
    assert lease_name("team", "b.b-0").count(".") == 2
    assert lease_name("team.b", "b-0").startswith("team-1b.b-00.")


def test_a_long_run_cannot_take_another_runs_hashed_name() -> None:
    # Issue 20, case 3: a run named like another's hashed-name prefix took that name.
    long_run = "r" * 251
    hashed = lease_name(long_run, "n0")
    prefix, node_part, digest = hashed.split(".")
    assert re.fullmatch(r"[0-9a-f]{32}", digest) and node_part == "n0"
    assert lease_name(prefix, f"{node_part}.{digest}") != hashed
    assert lease_name(f"{prefix}.{node_part}", digest) != hashed


@settings(max_examples=400, deadline=None)
@given(run_names, node_names, run_names, node_names)
def test_lease_names_are_valid_and_one_to_one(run: str, node: str, run2: str,
                                              node2: str) -> None:
    name = lease_name(run, node)
    assert len(name) <= 253 and SUBDOMAIN.fullmatch(name), name
    if (run, node) != (run2, node2):
        assert lease_name(run2, node2) != name


def test_label_values_stay_those_of_before() -> None:
    assert label_value("run-a") == "run-a"
    assert re.fullmatch(r"r{50}-[0-9a-f]{10}", label_value("r" * 64))


# --------------------------------------------------------------------------- readers


def _lease(run: str, node: str, *, name: str | None = None, label: str | None = None,
           owner: str | None = "uid-r", uid: str = "lease-uid") -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name or lease_name(run, node), "uid": uid,
        "labels": {crd.RUN_LABEL: label or label_value(run)},
        "annotations": {crd.RUN_LABEL: run, crd.NODE_ANNOTATION: node}}
    if owner:
        meta["ownerReferences"] = [{"kind": crd.KIND, "uid": owner, "name": run}]
    return {"metadata": meta, "spec": {"holderIdentity": node, "renewTime": "2026-01-01T00:00:00Z"}}


def test_a_lease_counts_for_its_run_only_under_its_own_name() -> None:
    assert lease_run(_lease("team", "b-0")) == "team"
    # Run team.b's Lease of b-0, named as the old encoding named it for team's b.b-0.
    assert lease_run(_lease("team.b", "b-0", name="team.b.b-0")) is None
    assert lease_run(_lease("team", "b.b-0", name="team.b.b-0")) is None
    assert lease_run(_lease("team", "b-0", label="other")) is None
    no_node = _lease("team", "b-0")
    del no_node["metadata"]["annotations"][crd.NODE_ANNOTATION]
    assert lease_run(no_node) is None


def test_only_a_lease_owned_by_the_run_under_its_name_is_genuine() -> None:
    assert owned_by(lease_state(_lease("r", "n0")), "r", "uid-r")
    assert not owned_by(lease_state(_lease("r", "n0", owner="uid-earlier")), "r", "uid-r")
    assert not owned_by(lease_state(_lease("r", "n0", owner=None)), "r", "uid-r")
    assert not owned_by(lease_state(_lease("r", "n0", name="r.n1")), "r", "uid-r")
    assert not owned_by(lease_state(_lease("r", "n0")), "r", None)


@settings(max_examples=200)
@given(run=run_names, node=node_names)
def test_the_lease_a_node_creates_is_its_runs_genuine_lease(run: str, node: str) -> None:
    """What an agent (and the scale benchmark's simulated node) POSTs: named, labelled and
    owned so that every reader takes it for this run's Lease of this node, join included."""
    join = WaitingNode(name=node, address="10.0.0.7", store_port=29400, since=T0)
    body = node_lease(run, node, "agent@1", 15, "uid-r", T0, join)
    assert body["metadata"]["name"] == lease_name(run, node)
    assert lease_run(body) == run
    stored = {**body, "metadata": {**body["metadata"], "uid": "lease-uid",  # the server's
                                   "resourceVersion": "4711"}}
    state = lease_state(stored, seen=T0)
    assert owned_by(state, run, "uid-r") and state.node == node and state.holder == "agent@1"
    assert state.join == join and state.duration == 15 and state.renewed == T0
    assert state.join is not None and state.join.written == 4711 == state.version
    plain = node_lease(run, node, "agent@1", 15, None, T0)
    plain["metadata"]["uid"] = "lease-uid"
    assert lease_run(plain) == run and lease_state(plain).join is None
    assert not owned_by(lease_state(plain), run, "uid-r")


def _merge_annotations(lease: dict[str, Any], annotations: dict[str, str | None]
                       ) -> dict[str, Any]:
    """``lease`` after a merge patch of its annotations, as the API server applies one
    (None removes an annotation)."""
    meta = lease["metadata"]
    merged = {k: v for k, v in {**meta["annotations"], **annotations}.items() if v is not None}
    return {**lease, "metadata": {**meta, "annotations": merged}}


def test_a_join_write_asks_for_the_next_round_and_withdraws_an_unreachable_report() -> None:
    """The one write of a node's join request (a handler's ``set_join``, the scale
    benchmark's simulated node): the request, or none, and never a report of an
    unreachable rank 0 left over from the round the node is leaving."""
    join = WaitingNode(name="n0", address="10.0.0.7", store_port=29400, since=T0)
    assert join_annotations(join) == {JOIN_ANNOTATION: join_value(join),
                                      UNREACHABLE_ANNOTATION: None}
    reported = node_lease("r", "n0", "agent@1", 15, "uid-r", T0)
    reported["metadata"]["uid"] = "lease-uid"
    reported["metadata"]["annotations"][UNREACHABLE_ANNOTATION] = unreachable_value("n1", 3)
    assert lease_state(reported).unreachable == Unreachable("n1", 3)
    asked = _merge_annotations(reported, join_annotations(join))
    assert lease_state(asked).join == join and lease_state(asked).unreachable is None
    withdrawn = _merge_annotations(asked, join_annotations(None))
    assert lease_state(withdrawn).join is None
    assert {JOIN_ANNOTATION, UNREACHABLE_ANNOTATION}.isdisjoint(
        withdrawn["metadata"]["annotations"])



@settings(max_examples=100)
@given(node=node_names)
def test_a_live_agent_is_read_back_as_the_holder_whatever_the_nodes_name(node: str) -> None:
    """A second agent under a node's name is refused because the first one's holder reads
    back: also for a name of the full 253 characters, whose holder the reader would
    otherwise drop as too long."""
    holder = holder_identity(node, "0123abcd")
    assert holder.endswith("@0123abcd") and holder != holder_identity(node, "4567ef01")
    body = node_lease("r", node, holder, 15, "uid-r", T0)
    body["metadata"]["uid"] = "lease-uid"
    assert lease_state(body).holder == holder
    assert holder_alive(body, "r", "uid-r", 15, T0 + dt.timedelta(seconds=1)) == holder
    assert holder_alive(body, "r", "uid-r", 15, T0 + dt.timedelta(seconds=16)) is None


def test_the_longest_node_name_keeps_its_holder_readable() -> None:
    holder = holder_identity("n" * 253, "0123abcd")
    assert len(holder) == 253 and holder.startswith("n" * 244)

# --------------------------------------------------------------------------- per-run RBAC


def _run(**status: Any) -> ElasticRun:
    members = tuple(Participant(name=n, rank=i, address="10.0.0.1", store_port=1 + i)
                    for i, n in enumerate(("a", "b")))
    base = RunStatus(phase="Running", round=2, signal=2, participants=members,
                     store=StoreAddress("10.0.0.1", 1), sealed_at=T0)
    return ElasticRun("r", "ns", RunSpec(min_nodes=1, max_nodes=3, heartbeat_timeout=5),
                      base.replace(**status), "7", uid="uid-r")


def test_the_role_keeps_a_removed_members_lease_and_never_a_foreign_one() -> None:
    lost = LostMember(name="c", round=2, reason="LeaseExpired", time=T0)
    run = _run(lost_members=(lost,))
    leases = {"a": lease_state(_lease("r", "a")),
              # labelled for r, but owned by an earlier run of that name: not r's
              "b": lease_state(_lease("r", "b", owner="uid-earlier")),
              "x": lease_state(_lease("r", "x"))}
    names = runrbac.lease_names(run, leases)
    # a: genuine; c: lost, its Lease deleted, its node must be able to find that out (404);
    # x: a genuine Lease of a node not (yet) in the status; b: another object under b's name.
    assert names == sorted([lease_name("r", "a"), lease_name("r", "c"), lease_name("r", "x")])


# --------------------------------------------------------------------------- no loop


def _state(node: str, renewed: dt.datetime, **kw: Any) -> LeaseState:
    """A Lease of run ``r`` that the reader saw renewed at ``renewed``."""
    kw.setdefault("seen", renewed)
    return LeaseState(node=node, holder=node, renewed=renewed, duration=5, owner_uid="uid-r",
                      name=lease_name("r", node), uid=f"uid-{node}", **kw)


def test_an_expired_lease_that_stays_is_looked_at_later_never_at_once() -> None:
    run = _run(participants=(), phase="Pending", round=0, store=None)
    stale = {"ghost": _state("ghost", T0 - dt.timedelta(seconds=60))}
    plan = reconcile(run, Members(leases=stale), T0)
    assert plan.delete_leases == ["ghost"]
    assert plan.wake_at is not None and plan.wake_at >= T0 + EXPIRED_LEASE_RECHECK


class _Client:
    """Records requests; DELETE answers with ``delete_status``."""

    def __init__(self, delete_status: int) -> None:
        self.delete_status = delete_status
        self.calls: list[tuple[str, str, Any]] = []

    def request(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
        self.calls.append((method, path, kw.get("body")))
        if method == "DELETE" and self.delete_status >= 400:
            raise ApiError(self.delete_status, "Forbidden", "nope", {})
        return {}


class _Observer:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    async def post_event(self, run: ElasticRun, type_: str, reason: str, message: str) -> None:
        self.events.append((reason, message))


def _executor(client: _Client, observer: _Observer) -> PlanExecutor:
    return PlanExecutor(OperatorGateway(client), observer,  # type: ignore[arg-type]
                        lambda k, r: None, lambda k: None)


def test_the_operator_deletes_the_observed_lease_by_uid_and_backs_off() -> None:
    client, observer = _Client(403), _Observer()
    executor = _executor(client, observer)
    run = _run()
    ghost = _state("ghost", T0)
    plan = Plan(delete_leases=["ghost", "never-seen"])

    async def passes() -> None:
        for _ in range(20):
            await executor.carry_out(run, plan, {"ghost": ghost})

    asyncio.run(passes())
    deletes = [c for c in client.calls if c[0] == "DELETE"]
    # One attempt (then the back-off), of the observed object only, by its uid; no
    # DELETE for a node whose Lease was not observed; one Event.
    assert len(deletes) == 1
    assert deletes[0][1].endswith(f"/leases/{lease_name('r', 'ghost')}")
    assert deletes[0][2]["preconditions"] == {"uid": "uid-ghost"}
    assert [reason for reason, _ in observer.events] == ["LeaseNotDeleted"]


def test_a_squatter_is_described_by_what_it_says_about_itself_and_never_raises() -> None:
    from elasticrun.api.leases import describe_object

    squat = {"metadata": {"name": "sq.sq-0", "creationTimestamp": "2026-01-01T00:00:00Z",
                          "managedFields": [{"manager": "squatter-tool"}]},
             "spec": {"holderIdentity": "squatter"}}
    assert describe_object(squat) == ("holder: squatter; created: 2026-01-01T00:00:00Z; "
                                      "written by: squatter-tool")
    for junk in ({}, {"metadata": []}, {"metadata": {"managedFields": [1, None, {}]}},
                 {"metadata": {"ownerReferences": "x", "labels": {crd.RUN_LABEL: 5}}}):
        assert isinstance(describe_object(junk), str)
    assert len(describe_object({"spec": {"holderIdentity": "h" * 10_000}})) < 200
