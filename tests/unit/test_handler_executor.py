"""The handler's executor over the in-memory gateway: rounds formed without an API server.

``next_rendezvous`` carries out :func:`elasticrun.handler.step.next_action`
through :class:`~elasticrun.api.gateway.RunAccess`; here every node's requests
go to one :class:`fakegateway.FakeApiServer`, which fences writes by
resourceVersion and delivers watch events as the API server does, so the
executor's rules (seal, lost compare-and-set, the store check, close, the join
timeout, an unreachable server) are checked in threads of one process, with
real TCPStores on 127.0.0.1 and timeouts of tenths of a second (the join
timeout's test waits 1 s, the least a run's spec allows), through public calls only.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from fakegateway import FakeApiServer, FakeGateway
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousInfo,
    RendezvousStateError,
    RendezvousTimeoutError,
)

from elasticrun.api import rounds, slices
from elasticrun.api.leases import JOIN_ANNOTATION, lease_state
from elasticrun.api.model import RunSpec, RunStatus, StoreAddress, WaitingNode, now, parse_run
from elasticrun.api.roundfile import ROUND_FILE_VARIABLE, decode_round
from elasticrun.handler import executor as executor_mod
from elasticrun.handler import step
from elasticrun.handler.handler import K8sRendezvousHandler, RunSucceededError
from elasticrun.handler.lease import LeaseKeeper
from elasticrun.handler.session import RunSession
from elasticrun.handler.settings import RendezvousSettings, from_parameters
from elasticrun.inplace.source import FileRoundSource

from builders import large_spec, quiet_spec, sealed
from conftest import wait_for

RUN_NAME = "r"
#: How long a test waits for a node's call before it counts as hung.
BOUND = 10.0


def settings(node: str, api_timeout: float = 0.5) -> RendezvousSettings:
    given = from_parameters(run_id=RUN_NAME, endpoint="", min_nodes=1, max_nodes=4,
                            local_addr="127.0.0.1", conf={"namespace": "ns", "node_name": node})
    return dataclasses.replace(given, api_timeout=api_timeout, close_timeout=0.5,
                               request_timeout=0.5)


def spec(size: int) -> RunSpec:
    return RunSpec(min_nodes=size, max_nodes=size, join_timeout=60, last_call_timeout=1,
                   heartbeat_timeout=30, lease_renew_interval=10)


@pytest.fixture
def server() -> FakeApiServer:
    return FakeApiServer("ns")


class Nodes:
    """Makes nodes on one server, each with its own gateway (:meth:`gateway`)."""

    def __init__(self, server: FakeApiServer) -> None:
        self.server = server
        self.made: list[K8sRendezvousHandler] = []
        self.gateways: dict[str, FakeGateway] = {}

    def __call__(self, name: str, api_timeout: float = 0.5,
                 round_file: Path | None = None) -> K8sRendezvousHandler:
        """Node ``name``; in in-place mode with its ``round_file`` if one is given."""
        self.gateways[name] = FakeGateway(self.server, RUN_NAME)
        given = settings(name, api_timeout)
        if round_file is not None:
            given = dataclasses.replace(given, in_place=True, round_file=str(round_file))
        node = K8sRendezvousHandler(given, gateway=self.gateways[name])
        self.made.append(node)
        return node

    def gateway(self, node: K8sRendezvousHandler) -> FakeGateway:
        return self.gateways[node.settings.node_name]

    def listed(self, node: K8sRendezvousHandler) -> None:
        """Until ``node`` has listed the join requests: its last request before it waits."""
        wait_for(lambda: self.gateway(node).reached["leases"], BOUND,
                 f"{node.settings.node_name} to list", interval=0.01)


@pytest.fixture
def nodes(server: FakeApiServer) -> Iterator[Nodes]:
    """The test's nodes, all shut down after it."""
    made = Nodes(server)
    yield made
    for node in reversed(made.made):  # rank 0, the store's host, last
        node.shutdown()


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(4) as threads:
        yield threads


def join_of(server: FakeApiServer, node: str) -> str | None:
    lease = server.lease_of(RUN_NAME, node)
    return None if lease is None else lease["metadata"].get("annotations", {}).get(JOIN_ANNOTATION)


def observer_pending(server: FakeApiServer) -> tuple[WaitingNode, ...]:
    """The pending join requests as another node (or the operator) lists them."""
    session = RunSession(settings("observer"), FakeGateway(server, RUN_NAME))
    return session.pending(parse_run(server.run(RUN_NAME)))


def write_status(server: FakeApiServer, status: RunStatus) -> None:
    """Another writer's compare-and-set of the whole status."""
    current = server.run(RUN_NAME)
    written = FakeGateway(server, RUN_NAME).replace_status(
        current["metadata"]["resourceVersion"], status.to_dict(), "other")
    assert written is not None


def infos(futures: list[Future[RendezvousInfo]]) -> list[RendezvousInfo]:
    return [future.result(BOUND) for future in futures]


def test_two_nodes_form_one_round_with_ranks_0_and_1(
        server: FakeApiServer, nodes: Nodes,
        pool: ThreadPoolExecutor) -> None:
    server.seed_run(RUN_NAME, spec(2))
    a, b = nodes("a"), nodes("b")
    first = pool.submit(a.next_rendezvous)
    nodes.listed(a)
    second = pool.submit(b.next_rendezvous)
    got = infos([first, second])
    assert [(info.rank, info.world_size) for info in got] == [(0, 2), (1, 2)]
    status = server.run(RUN_NAME)["status"]
    assert (status["round"], [p["name"] for p in status["participants"]]) == (1, ["a", "b"])
    assert got[0].bootstrap_store_info.master_port == got[1].bootstrap_store_info.master_port
    got[0].store.set("from-rank-0", "hello")  # one store: rank 1 reads what rank 0 wrote
    assert got[1].store.get("from-rank-0") == b"hello"
    # b listed a's request before it sealed: it checks a's store on that copy, reading none.
    assert (nodes.gateway(b).calls["lease"], nodes.gateway(b).calls["listed_lease"]) == (0, 0)


def test_the_listing_that_may_complete_a_round_goes_before_the_run_watch_starts(
        server: FakeApiServer, nodes: Nodes) -> None:
    """The run's watch takes a connection (a TLS handshake) and a thread of its own, so
    it starts after the node's listing: the node whose join completes the round
    lists and seals without waiting behind it. Here the listing gives a watch
    started before it half a second to open, far longer than a thread takes."""
    server.seed_run(RUN_NAME, spec(1))
    a = nodes("a")
    gateway = nodes.gateway(a)
    watches_at_listing: list[int] = []

    def listing() -> None:
        deadline = time.monotonic() + 0.5
        while gateway.calls["watch_run"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        watches_at_listing.append(gateway.calls["watch_run"])

    gateway.on_next("leases", listing)
    assert a.next_rendezvous().rank == 0
    assert watches_at_listing == [0]
    wait_for(lambda: gateway.calls["watch_run"], BOUND, "the run's watch, after the listing")


def test_the_first_round_is_served_by_the_store_started_with_the_handler(
        server: FakeApiServer, nodes: Nodes) -> None:
    """The store of a node's first round is started when the handler is made, before any
    request (as torch's c10d handler connects to its store then): its port is the one the
    join announces and rank 0 serves. A later round gets a fresh server on another port."""
    server.seed_run(RUN_NAME, spec(1))
    a = nodes("a")
    started = a.stores.port
    assert started is not None and not nodes.gateway(a).calls  # no request yet
    first = a.next_rendezvous()
    assert (first.rank, first.bootstrap_store_info.master_port) == (0, started)
    assert parse_run(server.run(RUN_NAME)).status.store == StoreAddress("127.0.0.1", started)
    second = a.next_rendezvous()  # a restart: the node asks again, alone, round 2
    status = parse_run(server.run(RUN_NAME)).status
    assert (status.round, status.store) == (2, StoreAddress("127.0.0.1", a.stores.port))
    assert second.bootstrap_store_info.master_port == a.stores.port != started


def test_an_address_the_store_cannot_serve_on_fails_the_handler_when_it_is_made(
        server: FakeApiServer) -> None:
    given = dataclasses.replace(settings("a"), address="no-such-host.invalid")
    gateway = FakeGateway(server, RUN_NAME)
    with pytest.raises(RendezvousError,
                       match=r"node 'a'.*'no-such-host.invalid' does not resolve"):
        K8sRendezvousHandler(given, gateway=gateway)
    assert not gateway.calls  # nothing asked of the API server


@pytest.mark.parametrize("first_out_done", [True, False])
def test_a_member_leaving_a_run_that_already_succeeded_asks_no_store_for_its_proof(
        server: FakeApiServer, nodes: Nodes, pool: ThreadPoolExecutor,
        monkeypatch: pytest.MonkeyPatch, first_out_done: bool) -> None:
    """The member out first proves the exit barrier and marks the run ``Succeeded``, then
    closes rank 0's store: the others read the run before they would ask that store.
    Control (``first_out_done`` False): the first member out asks it, once."""
    from elasticrun.handler import handler as handler_mod

    server.seed_run(RUN_NAME, spec(2))
    a, b = nodes("a"), nodes("b")
    first = pool.submit(a.next_rendezvous)
    nodes.listed(a)
    infos([first, pool.submit(b.next_rendezvous)])
    if first_out_done:
        run = parse_run(server.run(RUN_NAME))
        done = rounds.leave(run.status, "a", now(), finished=True)
        assert done is not None
        write_status(server, done)
    asked: list[object] = []
    monkeypatch.setattr(handler_mod.exitbarrier, "passed",
                        lambda store: asked.append(store) or True)
    b.shutdown()
    status = parse_run(server.run(RUN_NAME)).status
    assert (status.phase, status.round) == ("Succeeded", 1)
    assert [m.name for m in status.lost_members if m.reason == rounds.FINISHED] == \
        (["a"] if first_out_done else ["b"])
    assert len(asked) == (0 if first_out_done else 1)


def test_a_member_whose_pod_is_going_asks_for_no_next_round(
        server: FakeApiServer, nodes: Nodes, pool: ThreadPoolExecutor) -> None:
    # The operator removes a member on its Pod's deletion; the member's agent sees
    # the signal move before the kubelet stops it.  Were it to ask again, the
    # survivor could seal a round with it, which would break when it stops.
    server.seed_run(RUN_NAME, spec(2))
    a, b = nodes("a"), nodes("b")
    first = pool.submit(a.next_rendezvous)
    nodes.listed(a)
    infos([first, pool.submit(b.next_rendezvous)])
    asked = join_of(server, "b")
    run = parse_run(server.run(RUN_NAME))
    removed = rounds.remove_member(run.status, "b", rounds.POD_DELETED, now(),
                                   "pod b is being deleted")
    assert removed is not None
    write_status(server, removed)
    wait_for(lambda: b.num_nodes_waiting() > 0, BOUND, "b to see the removal", interval=0.01)
    with pytest.raises(RendezvousClosedError,
                       match=r"removed from round 1 because its Pod is going \(PodDeleted: "
                             r"pod b is being deleted\)"):
        b.next_rendezvous()
    assert join_of(server, "b") == asked  # no new request: the survivor cannot admit it
    assert observer_pending(server) == ()


def test_a_lost_seal_is_retried_from_the_winners_state(
        server: FakeApiServer, nodes: Nodes,
        pool: ThreadPoolExecutor) -> None:
    server.seed_run(RUN_NAME, spec(2))
    a, b = nodes("a"), nodes("b")

    def other_seals_first() -> None:
        run = parse_run(server.run(RUN_NAME))
        write_status(server, rounds.seal_round(run, now(), observer_pending(server)))

    nodes.gateway(b).on_next("replace_status", other_seals_first)  # b's seal is fenced out
    first = pool.submit(a.next_rendezvous)
    nodes.listed(a)
    got = infos([first, pool.submit(b.next_rendezvous)])
    assert nodes.gateway(b).calls["replace_status"] == 1  # lost once, and not tried again
    assert server.run(RUN_NAME)["status"]["round"] == 1  # the winner's round, not a second one
    assert sorted((info.rank, info.world_size) for info in got) == [(0, 2), (1, 2)]


def test_a_store_rank_0_did_not_announce_is_refused(
        server: FakeApiServer, nodes: Nodes,
        pool: ThreadPoolExecutor, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(executor_mod, "STORE_CHECK_SECONDS", 0.2)
    seeded = server.seed_run(RUN_NAME, spec(3))
    leader = LeaseKeeper(FakeGateway(server, RUN_NAME), "a", 30, 10, seeded["metadata"]["uid"])
    leader.acquire(WaitingNode(name="a", address="127.0.0.1", store_port=29400, since=now()))
    b = nodes("b")
    call = pool.submit(b.next_rendezvous)
    nodes.listed(b)
    run = parse_run(server.run(RUN_NAME))
    sealed = rounds.seal_round(run, now(), observer_pending(server))
    assert sealed.store == StoreAddress("127.0.0.1", 29400) and sealed.participant("a")
    write_status(server, dataclasses.replace(sealed, store=StoreAddress("127.0.0.1", 29401)))
    with pytest.raises(RendezvousStateError, match="refusing the store of round 1"):
        call.result(BOUND)
    # Its listing's copy showed another store, so it read rank 0's Lease, by name.
    assert nodes.gateway(b).calls["lease"] >= 1 and nodes.gateway(b).calls["listed_lease"] == 0


def test_a_round_of_a_failed_calls_request_leaves_the_next_calls_request_standing(
        server: FakeApiServer, nodes: Nodes,
        pool: ThreadPoolExecutor, monkeypatch: pytest.MonkeyPatch) -> None:
    """A call that failed (a forged store refused) leaves its request on the Lease, and
    the round that answered it is still the run's when the node calls again.  Its new
    request must be its only one: a second would tell the others that rank 0 moved on
    while a round answering the first was sealed, and they would form yet another."""
    monkeypatch.setattr(executor_mod, "STORE_CHECK_SECONDS", 0.2)
    server.seed_run(RUN_NAME, spec(3))
    a, b = nodes("a"), nodes("b")
    first = [pool.submit(node.next_rendezvous) for node in (a, b)]
    nodes.listed(a)
    nodes.listed(b)
    run = parse_run(server.run(RUN_NAME))
    sealed = rounds.seal_round(run, now(), observer_pending(server))
    assert len(sealed.participants) == 2
    write_status(server, dataclasses.replace(sealed, store=StoreAddress("127.0.0.1", 1)))
    for call in first:
        with pytest.raises(RendezvousStateError):
            call.result(BOUND)
    c = nodes("c")
    third = pool.submit(c.next_rendezvous)
    nodes.listed(c)
    writes = {n: nodes.gateway(n).calls["patch_lease"] for n in (a, b)}
    got = infos([pool.submit(a.next_rendezvous), pool.submit(b.next_rendezvous), third])
    assert {n: nodes.gateway(n).calls["patch_lease"] - writes[n] for n in (a, b)} == \
        {a: 1, b: 1}  # one request each (renewals are 10 s apart)
    assert sorted((info.rank, info.world_size) for info in got) == [(0, 3), (1, 3), (2, 3)]
    status = parse_run(server.run(RUN_NAME)).status
    assert status.round == 2 and (a.round, b.round, c.round) == (2, 2, 2)
    assert status.store != StoreAddress("127.0.0.1", 1)


def test_rank_0_takes_no_round_of_its_earlier_request_even_on_its_own_store(
        server: FakeApiServer, nodes: Nodes, pool: ThreadPoolExecutor) -> None:
    """A round holding the previous requests (a status restored by hand) names rank 0's
    store.  The other nodes read rank 0's new request on its Lease and take the round
    for one whose rank 0 moved on, so rank 0 must too: all meet in the round after."""
    server.seed_run(RUN_NAME, spec(2))
    a, b = nodes("a"), nodes("b")
    first = pool.submit(a.next_rendezvous)
    nodes.listed(a)
    infos([first, pool.submit(b.next_rendezvous)])
    run = parse_run(server.run(RUN_NAME))
    assert run.status.participant("a").rank == 0  # type: ignore[union-attr]
    write_status(server, run.status.replace(round=2, signal=run.status.signal + 1))
    wait_for(lambda: a.num_nodes_waiting() > 0 and b.num_nodes_waiting() > 0, BOUND,
             "a and b to see round 2", interval=0.01)
    leader = pool.submit(a.next_rendezvous)
    nodes.listed(a)
    got = infos([leader, pool.submit(b.next_rendezvous)])
    assert [(info.rank, info.world_size) for info in got] == [(0, 2), (1, 2)]
    status = parse_run(server.run(RUN_NAME)).status
    assert status.round == 3 and (a.round, b.round) == (3, 3)
    assert {p.name: p.since for p in status.participants} == {
        n: lease_state(server.lease_of(RUN_NAME, n)).join.since  # type: ignore[union-attr]
        for n in "ab"}


def test_a_run_closed_while_waiting_ends_the_call_and_withdraws_the_request(
        server: FakeApiServer, nodes: Nodes,
        pool: ThreadPoolExecutor) -> None:
    server.seed_run(RUN_NAME, spec(2))
    a = nodes("a")
    call = pool.submit(a.next_rendezvous)
    nodes.listed(a)
    FakeGateway(server, RUN_NAME).close()
    run = parse_run(server.run(RUN_NAME))
    write_status(server, run.status.replace(phase="Closed", signal=run.status.signal + 1))
    with pytest.raises(RendezvousClosedError, match="the run is closed") as info:
        call.result(BOUND)
    assert not isinstance(info.value, RunSucceededError)
    assert join_of(server, "a") is None


def test_a_succeeded_run_ends_the_call_with_exit_status_0(
        server: FakeApiServer, nodes: Nodes) -> None:
    server.seed_run(RUN_NAME, spec(2), RunStatus(phase="Succeeded", round=3, signal=5))
    with pytest.raises(RunSucceededError, match="already succeeded") as info:
        nodes("late").next_rendezvous()
    assert info.value.code == 0


def test_the_join_timeout_fails_the_call_and_withdraws_the_request(
        server: FakeApiServer, nodes: Nodes) -> None:
    """The shortest join timeout a run may have, 1 s: the one test here that takes a second."""
    server.seed_run(RUN_NAME, dataclasses.replace(spec(2), join_timeout=1))
    a = nodes("a")
    started = time.monotonic()
    with pytest.raises(RendezvousTimeoutError, match="no round formed within the join timeout"):
        a.next_rendezvous()
    assert 1.0 <= time.monotonic() - started < 1.5
    assert server.lease_of(RUN_NAME, "a") is not None and join_of(server, "a") is None


def test_an_unreachable_api_server_is_a_connection_error_within_api_timeout(
        server: FakeApiServer, nodes: Nodes) -> None:
    server.seed_run(RUN_NAME, spec(2))
    a = nodes("a", 0.3)
    nodes.gateway(a).fail_next("*", 1000)
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match=r"did not answer within 0s"):
        a.next_rendezvous()
    assert time.monotonic() - started <= 0.3 + 0.1
    assert nodes.gateway(a).calls["read"] >= 3  # retried, not given up at once
    nodes.gateway(a).heal()


def test_a_waiting_node_that_loses_the_api_server_fails_with_a_connection_error(
        server: FakeApiServer, nodes: Nodes,
        pool: ThreadPoolExecutor) -> None:
    server.seed_run(RUN_NAME, spec(2))
    a = nodes("a", 0.3)
    call = pool.submit(a.next_rendezvous)
    # Listed (its last request before it waits), and watching.
    wait_for(lambda: nodes.gateway(a).reached["leases"] and server.watches, BOUND,
             "a to wait on its watch", interval=0.01)
    nodes.gateway(a).fail_next("*", 1000)
    server.end_watches()  # the watch ends, and no request gets through again
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match=r"lost the watch .* \(api_timeout\)"):
        call.result(BOUND)
    # api_timeout, then at most the watch's next reconnect attempt (0.1, 0.2, 0.5 s apart)
    assert time.monotonic() - started < 0.3 + 0.5 + 0.2
    nodes.gateway(a).heal()


def test_a_seal_that_keeps_losing_ends_with_a_closed_error_once_shutdown_begins(
        server: FakeApiServer, nodes: Nodes,
        pool: ThreadPoolExecutor) -> None:
    """A conflict on every seal (List, Seal, List, ...: no wait in between) is left at
    the next action once the agent shuts the handler down, not at the join timeout."""
    server.seed_run(RUN_NAME, spec(1))
    a = nodes("a")
    nodes.gateway(a).fail_next("replace_status", 100_000, "conflict")
    call = pool.submit(a.next_rendezvous)
    wait_for(lambda: nodes.gateway(a).calls["replace_status"] >= 3, BOUND,
             "a to lose its seal again and again", interval=0.01)
    started = time.monotonic()
    a.shutdown()
    with pytest.raises(RendezvousClosedError, match="the agent is shutting down"):
        call.result(BOUND)
    assert time.monotonic() - started < 1.0  # within shutdown()'s close_timeout, 0.5 s
    assert server.run(RUN_NAME)["status"].get("round", 0) == 0
    assert join_of(server, "a") is None


def test_a_round_its_workers_report_lost_is_re_formed_in_place_by_the_followers(
        server: FakeApiServer, nodes: Nodes, pool: ThreadPoolExecutor, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """In-place mode: a's workers report round 1 failed (no change of the run shows it);
    a's follower rejoins, its join notice moves b's, and both form round 2 without a
    restart: each round file names round 2, and num_nodes_waiting() stays 0."""
    monkeypatch.setenv(ROUND_FILE_VARIABLE, "unset")  # the handler sets it; restored after
    server.seed_run(RUN_NAME, spec(2))
    files = {name: tmp_path / f"{name}.json" for name in ("a", "b")}
    a, b = nodes("a", round_file=files["a"]), nodes("b", round_file=files["b"])
    first = pool.submit(a.next_rendezvous)
    nodes.listed(a)
    infos([first, pool.submit(b.next_rendezvous)])
    request = join_of(server, "a")  # round 1's, still on a's Lease
    reported = time.monotonic()
    FileRoundSource(files["a"]).report_lost(1)
    wait_for(lambda: join_of(server, "a") not in (None, request), BOUND,
             "a's follower to ask again", interval=0.01)
    rejoined = time.monotonic() - reported

    waiting: set[int] = set()  # what torchrun's monitor sees meanwhile

    def told() -> list[int]:
        waiting.update((a.num_nodes_waiting(), b.num_nodes_waiting()))
        return [decode_round(files[n].read_bytes()).number for n in ("a", "b")]

    wait_for(lambda: told() == [2, 2], BOUND, "round 2 in both round files", interval=0.01)
    assert (a.round, b.round) == (2, 2)
    assert rejoined < 2.0  # LOST_FILE_INTERVAL (0.2 s) and the join, with room for a loaded CPU
    assert [p["name"] for p in server.run(RUN_NAME)["status"]["participants"]] == ["a", "b"]
    assert waiting == {0}


def seal_as_the_operator(server: FakeApiServer, *names: str) -> RunStatus:
    """The operator's seal of a large run once ``names`` asked: where members are told in
    slices, the status with the signal left alone, then the round's slices; elsewhere the
    status with the signal moved."""
    for name in names:
        wait_for(lambda name=name: join_of(server, name), BOUND, f"{name}'s request")
    run = parse_run(server.run(RUN_NAME))
    in_slices = rounds.members_told_in_slices(run.spec)
    status = rounds.seal_round(run, now(), observer_pending(server), in_slices=in_slices)
    write_status(server, status)
    assert run.uid is not None
    for piece in slices.due(status.assignments(), frozenset()) \
            if in_slices else ():
        path = slices.slice_path(server.namespace, slices.slice_name(run.uid, piece.index))
        server.apply(server.key_of(path), piece.manifest(RUN_NAME, server.namespace, run.uid),
                     "elasticrun-operator")
    return status


def formed_large_run(server: FakeApiServer, nodes: Nodes, pool: ThreadPoolExecutor,
                     run_spec: RunSpec | None = None) -> tuple[K8sRendezvousHandler, RunStatus]:
    """Round 1 of a large run (by default one told in slices), members a (rank 0) and
    b, sealed by the operator, with a watching the round quietly."""
    server.seed_run(RUN_NAME, run_spec or large_spec())
    a, b = nodes("a"), nodes("b")
    calls = [pool.submit(a.next_rendezvous), pool.submit(b.next_rendezvous)]
    status = seal_as_the_operator(server, "a", "b")
    assert sorted(info.rank for info in infos(calls)) == [0, 1]
    wait_for(lambda: nodes.gateway(a).reached["watch_round"], BOUND, "a's quiet watch",
             interval=0.01)
    assert a.watcher is not None and a.watcher.quiet_round == 1
    return a, status


@pytest.mark.parametrize(("run_spec", "reads"), [
    (large_spec, 0),  # told in its slice, which the operator checked for it
    (quiet_spec, 1),  # told in the status, which anyone who may write the run could write
])
def test_a_member_told_in_its_slice_takes_the_store_without_reading_rank_0s_lease(
        server: FakeApiServer, nodes: Nodes, pool: ThreadPoolExecutor,
        run_spec: Callable[[], RunSpec], reads: int) -> None:
    formed_large_run(server, nodes, pool, run_spec())
    b = nodes.gateways["b"]
    assert b.calls["lease"] == reads and b.calls["listed_lease"] == 0


def lose(server: FakeApiServer, member: str, reason: str) -> str:
    """The operator's removal of ``member`` from the running round; the run's new version."""
    lost = rounds.remove_member(parse_run(server.run(RUN_NAME)).status, member, reason, now())
    assert lost is not None
    write_status(server, lost)
    return str(server.run(RUN_NAME)["metadata"]["resourceVersion"])


def test_a_member_of_a_large_run_hears_of_a_loss_in_one_event_and_rejoins_reading_nothing(
        server: FakeApiServer, nodes: Nodes, pool: ThreadPoolExecutor) -> None:
    a, status = formed_large_run(server, nodes, pool)
    assert a.watcher is not None
    # Its copy shows round 1 (read, say, when its Lease renewal rechecked the run): that
    # copy would have it announce itself, were it not stale.
    assert a.watcher.recheck()
    watched = nodes.gateway(a)
    seen, reads = a.watcher.events_received, watched.reached["read"]
    watches = watched.reached["watch_run"]
    # A write that leaves round 1 undisturbed (a spare's request summarised) sends nothing.
    write_status(server, status.replace(waiting=(
        WaitingNode(name="spare", address="10.0.0.9", store_port=1, since=now()),)))
    time.sleep(0.3)
    assert (a.num_nodes_waiting(), a.watcher.events_received) == (0, seen)
    # The loss: one event, of metadata only, and a waiting node without reading the run.
    version = lose(server, "b", rounds.LEASE_EXPIRED)
    wait_for(a.num_nodes_waiting, BOUND, "a to hear of the loss", interval=0.01)
    assert a.num_nodes_waiting() == 1
    assert (a.watcher.events_received, watched.reached["read"]) == (seen + 1, reads)
    assert a.watcher.disturbed_version == version
    # Asking again, it rejoins from the copy it holds, reading nothing: it writes its
    # request, announces nothing from that copy, watches for the run's end only, and
    # holds the round its Lease tells it.
    asked = join_of(server, "a")
    again = pool.submit(a.next_rendezvous)
    wait_for(lambda: join_of(server, "a") != asked, BOUND, "a's new request")
    wait_for(lambda: watched.reached["watch_end"], BOUND, "a's watch for the run's end",
             interval=0.01)
    seal_as_the_operator(server, "a")
    assert (again.result(BOUND).rank, a.round, a.watcher.quiet_round) == (0, 2, 2)
    assert (watched.reached["read"], watched.reached["watch_run"],
            watched.reached["announce"]) == (reads, watches, 0)
    assert a.num_nodes_waiting() == 0


@pytest.mark.parametrize(("run_spec", "watch", "read"), [
    (large_spec, "watch_end", 1),  # told in slices: the run's metadata, then one read
    (quiet_spec, "watch_settled", 0),  # told by broadcast: the settled run, whole
])
def test_a_large_run_closed_while_a_woken_member_rejoins_ends_its_call_from_its_watch(
        server: FakeApiServer, nodes: Nodes, pool: ThreadPoolExecutor,
        run_spec: Callable[[], RunSpec], watch: str, read: int) -> None:
    a, _ = formed_large_run(server, nodes, pool, run_spec())
    watched = nodes.gateway(a)
    lose(server, "b", rounds.LEASE_EXPIRED)
    wait_for(a.num_nodes_waiting, BOUND, "a to hear of the loss", interval=0.01)
    asked, reads = join_of(server, "a"), watched.reached["read"]
    again = pool.submit(a.next_rendezvous)
    wait_for(lambda: join_of(server, "a") != asked, BOUND, "a's new request")
    wait_for(lambda: watched.reached[watch], BOUND, f"a's {watch}", interval=0.01)
    closed = rounds.close(parse_run(server.run(RUN_NAME)), now())
    assert closed is not None
    write_status(server, closed)
    written = time.monotonic()
    with pytest.raises(RendezvousClosedError, match="the run is closed"):
        again.result(BOUND)
    # From the watch's event, not from the read its defer timer would make.
    assert time.monotonic() - written < rounds.defer_seal_wait(run_spec()) / 2
    assert watched.reached["read"] == reads + read
    assert join_of(server, "a") is None  # its request withdrawn


def test_a_member_told_by_broadcast_rejoins_on_the_settled_run_reading_nothing(
        server: FakeApiServer, nodes: Nodes, pool: ThreadPoolExecutor) -> None:
    """maxNodes 256: the member watches its round quietly, and once woken waits for the run
    to settle: one event, the whole run as the next seal wrote it, and no read, no full
    watch, no watch of its Lease in between."""
    a, status = formed_large_run(server, nodes, pool, quiet_spec())
    assert a.watcher is not None
    watched = nodes.gateway(a)
    seen, reads, watches = (a.watcher.events_received, watched.reached["read"],
                            watched.reached["watch_run"])
    lose(server, "b", rounds.LEASE_EXPIRED)
    wait_for(a.num_nodes_waiting, BOUND, "a to hear of the loss", interval=0.01)
    assert (a.watcher.events_received, watched.reached["read"]) == (seen + 1, reads)
    asked = join_of(server, "a")
    again = pool.submit(a.next_rendezvous)
    wait_for(lambda: join_of(server, "a") != asked, BOUND, "a's new request")
    wait_for(lambda: watched.reached["watch_settled"], BOUND, "a's watch for the run to settle",
             interval=0.01)
    # While the run re-forms, a write that leaves it unsettled sends nothing.
    write_status(server, parse_run(server.run(RUN_NAME)).status.replace(waiting=(
        WaitingNode(name="spare", address="10.0.0.9", store_port=1, since=now()),)))
    time.sleep(0.3)
    assert not again.done() and a.watcher.events_received == seen + 1
    resealed = seal_as_the_operator(server, "a")
    assert resealed.signal > status.signal
    assert (again.result(BOUND).rank, a.round, a.watcher.quiet_round) == (0, 2, 2)
    time.sleep(0.3)  # a settled watch opened again would be sent the run again at once
    assert a.watcher.events_received == seen + 2
    assert (watched.reached["read"], watched.reached["watch_run"], watched.reached["watch_end"],
            watched.reached["watch_settled"], watched.reached["announce"]) == (
        reads, watches, 0, 1, 0)
    assert a.mailbox is None  # told by broadcast: no slice watched, none written
    assert [key for key in server.objects if key[0] == slices.slices_path(server.namespace)] \
        == []
    assert a.num_nodes_waiting() == 0


def test_a_woken_member_whose_pod_is_going_withdraws_the_request_its_stale_copy_made(
        server: FakeApiServer, nodes: Nodes, pool: ThreadPoolExecutor) -> None:
    """Its copy predates its own removal; the operator deleted its Lease with it, so the
    join finds the Lease gone and reads the run (the one read), which shows why."""
    a, _ = formed_large_run(server, nodes, pool)
    watched = nodes.gateway(a)
    lose(server, "a", rounds.POD_DELETED)
    assert FakeGateway(server, RUN_NAME).delete_lease("a")
    wait_for(a.num_nodes_waiting, BOUND, "a to hear of its removal", interval=0.01)
    reads = watched.reached["read"]
    with pytest.raises(RendezvousClosedError, match="because its Pod is going"):
        a.next_rendezvous()
    assert watched.reached["read"] == reads + 1
    assert join_of(server, "a") is None


def test_a_member_reaching_a_round_told_on_its_lease_reads_the_run_once_it_is_disturbed(
        server: FakeApiServer) -> None:
    """Its copy predates round 2; the quiet watch of round 2 says when that copy no longer
    tells whether the round still stands (reach_store's superseded check)."""
    store = StoreAddress("10.0.0.1", 29400)
    server.seed_run(RUN_NAME, large_spec(), sealed("a", "b", round_=1).replace(store=store))
    gateway = FakeGateway(server, RUN_NAME)
    session = RunSession(settings("a"), gateway)
    held = session.read_or_raise()
    write_status(server, sealed("b", "a", round_=2).replace(store=store))
    session.watcher.watch_quietly(2)
    session.watcher.start()
    try:
        wait_for(lambda: gateway.reached["watch_round"], BOUND, "the quiet watch", interval=0.01)
        time.sleep(0.2)
        assert session.newest(held, 2) is held  # undisturbed: nothing read
        version = lose(server, "b", rounds.LEASE_EXPIRED)
        wait_for(lambda: session.watcher.disturbed(2), BOUND, "round 2 disturbed",
                 interval=0.01)
        reads = gateway.reached["read"]
        fresh = session.newest(held, 2)
        assert (fresh.status.round, fresh.status.restart_round) == (2, 2)
        assert step.superseded(fresh, 2, "a", "b") == "its rank 0, b, was removed from it"
        assert session.newest(held, 2) is fresh  # read once
        assert gateway.reached["read"] == reads + 1
        assert gateway.read_versions[-1] == version
    finally:
        session.watcher.stop()


def test_the_run_watch_fits_what_the_node_holds(server: FakeApiServer) -> None:
    """RunSession.follow, the one rule: quiet while it holds a round of a large run outside
    in-place mode; while its copy is stale, the run's end only where members are told in
    slices, else the run settled; otherwise the full watch."""
    server.seed_run(RUN_NAME, large_spec(),
                    sealed("a", "b", round_=1).replace(store=StoreAddress("10.0.0.1", 29400)))
    small = spec(2)
    gateway = FakeGateway(server, RUN_NAME)
    session = RunSession(settings("a"), gateway)
    in_place = RunSession(dataclasses.replace(settings("a"), in_place=True), gateway)
    large = session.read_or_raise().spec
    session.watcher.start()
    try:
        wait_for(lambda: gateway.reached["watch_run"], BOUND, "the full watch", interval=0.01)
        session.follow(large, stale=False, holding=1)
        assert session.watcher.quiet_round == 1
        wait_for(lambda: gateway.reached["watch_round"], BOUND, "the quiet watch",
                 interval=0.01)
        session.follow(large, stale=True)
        assert session.watcher.quiet_round == 0
        wait_for(lambda: gateway.reached["watch_end"], BOUND, "the watch for the run's end",
                 interval=0.01)
        session.follow(quiet_spec(), stale=True)
        wait_for(lambda: gateway.reached["watch_settled"], BOUND,
                 "the watch for the run to settle", interval=0.01)
        assert gateway.reached["watch_end"] == 1
        full = gateway.reached["watch_run"]
        session.follow(large, stale=False)
        wait_for(lambda: gateway.reached["watch_run"] > full, BOUND, "the full watch again",
                 interval=0.01)
        # Holding a round of a small run, or in in-place mode, the watch stays full.
        session.follow(small, stale=False, holding=1)
        in_place.follow(large, stale=False, holding=1)
        assert (session.watcher.quiet_round, in_place.watcher.quiet_round) == (0, 0)
    finally:
        session.watcher.stop()


def test_a_woken_member_whose_copy_shows_the_disturbance_starts_from_it_watching_fully(
        server: FakeApiServer) -> None:
    """A copy read since the quiet watch's event is not stale: the call starts from it with
    the full watch, not from a version it already shows."""
    server.seed_run(RUN_NAME, large_spec(),
                    sealed("a", "b", round_=1).replace(store=StoreAddress("10.0.0.1", 29400)))
    gateway = FakeGateway(server, RUN_NAME)
    session = RunSession(settings("a"), gateway)
    held = session.read_or_raise()
    session.watcher.watch_quietly(1)
    session.watcher.start()
    try:
        wait_for(lambda: gateway.reached["watch_round"], BOUND, "the quiet watch", interval=0.01)
        version = lose(server, "b", rounds.LEASE_EXPIRED)
        wait_for(lambda: session.watcher.disturbed(1), BOUND, "round 1 disturbed",
                 interval=0.01)
        # Positive control: from the copy held before the loss, the call starts stale.
        assert session.current() == (held, version)
        session.watcher.watch_quietly(1)
        wait_for(lambda: session.watcher.disturbed(1), BOUND, "round 1 disturbed again",
                 interval=0.01)
        fresh = session.read_or_raise()
        assert fresh.resource_version == version
        full = gateway.reached["watch_run"]
        run, woken = session.current()
        assert (run, woken) == (fresh, None)
        wait_for(lambda: gateway.reached["watch_run"] > full, BOUND, "the full watch",
                 interval=0.01)
    finally:
        session.watcher.stop()


def test_rank_0_in_place_announces_no_next_store(
        server: FakeApiServer, nodes: Nodes, pool: ThreadPoolExecutor, tmp_path: Path) -> None:
    """In-place mode: torchrun's agent keeps its exit barrier in its last round's store, which
    a store started ahead for every follower round would retire a round early; rank 0
    asks again instead (the test below is the positive control)."""
    keeps = dataclasses.replace(spec(2), max_nodes=rounds.DEFER_SEAL_FROM)
    server.seed_run(RUN_NAME, keeps)
    members = {name: nodes(name, round_file=tmp_path / f"{name}.json") for name in ("a", "b")}
    calls = [pool.submit(node.next_rendezvous) for node in members.values()]
    status = seal_as_the_operator(server, *members)
    assert sorted(info.rank for info in infos(calls)) == [0, 1]
    assert status.leader is not None
    time.sleep(1.0)  # the announcement below comes within milliseconds
    assert announced_by(server, status.leader) is None


@pytest.mark.parametrize("max_nodes", [rounds.DEFER_SEAL_FROM, rounds.QUIET_WATCH_FROM])
def test_rank_0_announces_the_next_rounds_store_and_a_round_keeping_every_place_meets_there(
        server: FakeApiServer, nodes: Nodes, pool: ThreadPoolExecutor, max_nodes: int) -> None:
    """Places kept (64 nodes: members watch the whole run; 256: quietly): once round 1
    holds it, rank 0 serves the next round's store and announces it on the request round 1
    answered; the operator's round for a newcomer keeps both members' places at that
    store, and they take it writing nothing.  Woken by the quiet watch, each finds its
    place in the run that watch sends (the seal was the disturbance)."""
    from elasticrun.api.leases import lease_state

    keeps = dataclasses.replace(spec(2), max_nodes=max_nodes)
    assert rounds.members_keep_places(keeps)
    server.seed_run(RUN_NAME, keeps)
    members = {name: nodes(name) for name in ("a", "b")}
    calls = [pool.submit(node.next_rendezvous) for node in members.values()]
    status = seal_as_the_operator(server, *members)
    assert sorted(info.rank for info in infos(calls)) == [0, 1]
    first = {p.name: p.since for p in status.participants}
    leader, other = (p.name for p in sorted(status.participants, key=lambda p: p.rank))
    wait_for(lambda: announced_by(server, leader), BOUND, "rank 0's announcement",
             interval=0.01)
    port = announced_by(server, leader)
    assert status.store is not None and port not in (None, status.store.port)
    assert port == members[leader].stores.port, "rank 0 serves the store it announced"
    requests = {name: lease_state(server.lease_of(RUN_NAME, name) or {}).join
                for name in members}
    assert {name: join.since if join else None for name, join in requests.items()} == first
    assert announced_by(server, other) is None, "only rank 0 announces"
    c = nodes("c")
    newcomer = pool.submit(c.next_rendezvous)
    wait_for(lambda: join_of(server, "c"), BOUND, "c's request")
    run = parse_run(server.run(RUN_NAME))
    pending = observer_pending(server)
    assert port is not None
    kept = rounds.kept_places(run, list(members), now(), pending,
                              leader_next=StoreAddress("127.0.0.1", port))
    write_status(server, rounds.seal_round(run, now(), [*pending, *kept]))
    # As torchrun's agents do: each comes back once its num_nodes_waiting() is positive.
    for node in members.values():
        wait_for(node.num_nodes_waiting, BOUND, "the members to hear of the round",
                 interval=0.01)
        assert node.watcher is not None and node.watcher.latest is not None
        assert node.watcher.latest.status.round == 2, "the event carried the round"
    reads = {name: nodes.gateways[name].reached["read"] for name in members}
    quietly = rounds.members_watch_quietly(keeps)
    again = {name: pool.submit(node.next_rendezvous) for name, node in members.items()}
    got = {name: call.result(BOUND) for name, call in again.items()}
    assert {name: info.rank for name, info in got.items()} == {leader: 0, other: 1}
    # Each learned its place from its watch (woken quietly, from the whole run that watch
    # sends where places are kept), never from a read.
    assert {name: nodes.gateways[name].reached["read"] for name in members} == reads
    assert newcomer.result(BOUND).rank == 2
    assert {info.bootstrap_store_info.master_port  # type: ignore[union-attr]
            for info in [*got.values(), newcomer.result(BOUND)]} == {port}
    second = parse_run(server.run(RUN_NAME)).status
    assert {p.name: p.since for p in second.participants if p.name != "c"} == first
    assert {name: lease_state(server.lease_of(RUN_NAME, name) or {}).join.since  # type: ignore[union-attr]
            for name in members} == first, "the members wrote no new request"
    assert all(nodes.gateways[name].reached["watch_round"] for name in members) is quietly


def test_woken_members_ask_again_once_their_rank_0_is_lost(
        server: FakeApiServer, nodes: Nodes, pool: ThreadPoolExecutor) -> None:
    """maxNodes 256 (places kept, members watch quietly): a round that lost its rank 0
    keeps no place; woken by the quiet watch, which sends the whole run where places are
    kept, the members find it without its rank 0, and each writes a new request at once,
    which the next round answers."""
    from elasticrun.api.leases import lease_state

    keeps = dataclasses.replace(spec(2), max_nodes=rounds.QUIET_WATCH_FROM)
    server.seed_run(RUN_NAME, keeps)
    members = {name: nodes(name) for name in ("a", "b", "c")}
    calls = [pool.submit(node.next_rendezvous) for node in members.values()]
    status = seal_as_the_operator(server, *members)
    assert sorted(info.rank for info in infos(calls)) == [0, 1, 2]
    first = {p.name: p.since for p in status.participants}
    leader = status.leader
    assert leader is not None
    wait_for(lambda: announced_by(server, leader), BOUND, "rank 0's announcement",
             interval=0.01)
    survivors = {name: node for name, node in members.items() if name != leader}
    lose(server, leader, rounds.POD_DELETED)
    for node in survivors.values():
        wait_for(node.num_nodes_waiting, BOUND, "the survivors to hear of the loss",
                 interval=0.01)
    reads = {name: nodes.gateways[name].reached["read"] for name in survivors}
    started = time.monotonic()
    again = {name: pool.submit(node.next_rendezvous) for name, node in survivors.items()}
    requests = {}
    for name in survivors:
        wait_for(lambda name=name: lease_state(server.lease_of(RUN_NAME, name) or {}).join
                 is not None and lease_state(server.lease_of(RUN_NAME, name) or {}).join.since
                 != first[name], BOUND, f"{name}'s new request")
        requests[name] = nodes.gateways[name].reached["read"] - reads[name]
    assert requests == {name: 0 for name in survivors}, "the quiet watch sent the run"
    # They asked on the answer, not once the wait for a kept place ran out.
    assert time.monotonic() - started < rounds.defer_seal_wait(keeps)
    seal_as_the_operator(server, *survivors)
    got = {name: call.result(BOUND) for name, call in again.items()}
    assert sorted(info.rank for info in got.values()) == [0, 1]
    assert {info.world_size for info in got.values()} == {2}


def announced_by(server: FakeApiServer, node: str) -> int | None:
    """The next round's store port ``node``'s request announces (None: none)."""
    from elasticrun.api.leases import lease_state

    lease = server.lease_of(RUN_NAME, node)
    join = lease_state(lease).join if lease is not None else None
    return join.next_store_port if join is not None else None
