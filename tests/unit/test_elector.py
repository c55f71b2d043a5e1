"""The leader elector: its pure decisions, and two candidates against an in-memory Lease."""

from __future__ import annotations

import asyncio
import datetime as dt
import http.server
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, cast

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elasticrun.api.kube import ApiConnectionError, ApiError, Credentials, KubeClient
from elasticrun.operator import elector
from elasticrun.operator.elector import (
    Elector,
    FencedClient,
    LeaderLease,
    Move,
    NotLeaderError,
    Sighting,
    Timing,
    lease_spec,
    next_move,
    pause,
    read_leader_lease,
    still_leading,
)

from builders import idle_client

TIMING = Timing()
WALL = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def lease(holder: str | None, version: str = "1", renewed: str = "2026-01-01T00:00:00.000000Z",
          transitions: int = 0) -> LeaderLease:
    return read_leader_lease({"metadata": {"resourceVersion": version, "uid": "u"},
                              "spec": {"holderIdentity": holder, "renewTime": renewed,
                                       "leaseTransitions": transitions}})


def test_a_missing_lease_is_created_a_free_one_taken_its_own_renewed() -> None:
    assert next_move("me", None, 0.0, 0.0, TIMING) == Move("create")
    assert next_move("me", lease(None), 0.0, 0.0, TIMING) == Move("acquire")
    assert next_move("me", lease("me"), 0.0, 100.0, TIMING) == Move("renew")


def test_another_holder_is_waited_for_a_lease_duration_of_no_change_by_our_clock() -> None:
    held = lease("other")
    assert next_move("me", held, 50.0, 64.9, TIMING) == Move("wait", 65.0)
    assert next_move("me", held, 50.0, 65.0, TIMING) == Move("acquire")


def test_liveness_is_the_readers_sighting_never_the_renew_time_written() -> None:
    sighting = Sighting()
    # A renewTime far in the future, never changing: it expires like any other.
    frozen = lease("other", renewed="9999-12-31T23:59:59.999999Z")
    assert sighting.observe(frozen, 10.0) == 10.0
    assert sighting.observe(lease("other", renewed="9999-12-31T23:59:59.999999Z"), 30.0) == 10.0
    assert next_move("me", frozen, 10.0, 30.0, TIMING) == Move("acquire")
    # A changed record (another resourceVersion) is a renewal, seen when it is seen.
    assert sighting.observe(lease("other", version="2"), 31.0) == 31.0


def test_a_leader_stops_at_its_renew_deadline_counted_from_sending() -> None:
    assert still_leading(100.0, 109.9, TIMING)
    assert not still_leading(100.0, 110.0, TIMING)
    assert not still_leading(None, 0.0, TIMING)


# Quarter seconds: exact in binary floating point, so the bound is checked exactly.
@given(sent=st.integers(0, 4 * 10**6).map(lambda q: q / 4),
       seen_after=st.integers(0, 400).map(lambda q: q / 4))
def test_the_old_leader_stops_before_any_follower_may_start(sent: float,
                                                             seen_after: float) -> None:
    """A follower sees a renewal no sooner than it was sent, and waits a lease duration
    from then; the leader stops a renew deadline after sending it."""
    seen = sent + seen_after
    follower_starts = next_move("f", lease("leader"), seen, seen, TIMING).expires_at
    assert follower_starts is not None
    stop = sent + TIMING.renew_deadline
    assert not still_leading(sent, stop, TIMING)
    assert follower_starts - stop >= TIMING.lease_duration - TIMING.renew_deadline


@pytest.mark.parametrize("body", [
    None, "x", [], {"spec": "x"}, {"spec": {"holderIdentity": 7}},
    {"spec": {"holderIdentity": "h" * 5000}}, {"spec": {"holderIdentity": ""}},
    {"metadata": [], "spec": {"leaseTransitions": -5, "renewTime": {"a": 1}}},
    {"spec": {"leaseTransitions": 2**70, "acquireTime": 3}},
    {"spec": {"leaseTransitions": True}},
])
def test_an_unreadable_lease_has_no_holder_and_never_raises(body: Any) -> None:
    read = read_leader_lease(body)
    assert read.holder is None
    assert 0 <= read.transitions < 2**31
    assert next_move("me", read, 0.0, 0.0, TIMING) == Move("acquire")


def test_the_spec_written_counts_take_overs_and_keeps_the_acquire_time_on_renewal() -> None:
    created = lease_spec("me", None, "create", WALL, TIMING)
    assert created["holderIdentity"] == "me" and created["leaseTransitions"] == 0
    assert created["leaseDurationSeconds"] == 15
    taken = lease_spec("me", lease("other", transitions=3), "acquire", WALL, TIMING)
    assert taken["leaseTransitions"] == 4 and taken["acquireTime"] == taken["renewTime"]
    own = read_leader_lease({"metadata": {"resourceVersion": "9"},
                             "spec": {"holderIdentity": "me", "leaseTransitions": 4,
                                      "acquireTime": "2025-01-01T00:00:00.000000Z"}})
    renewed = lease_spec("me", own, "renew", WALL, TIMING)
    assert renewed["leaseTransitions"] == 4
    assert renewed["acquireTime"] == "2025-01-01T00:00:00.000000Z"
    freed = lease_spec("me", lease(None, transitions=4), "acquire", WALL, TIMING)
    assert freed["leaseTransitions"] == 4  # a released Lease: no one was displaced


def test_pauses_are_bounded_and_a_leader_keeps_its_retry_period() -> None:
    assert pause(0, TIMING, leading=True) == 2.0
    assert 2.0 <= pause(0, TIMING, leading=False, jitter=1.0) <= 2.4
    assert pause(1, TIMING, leading=False) == 4.0
    assert pause(1000, TIMING, leading=False) == TIMING.lease_duration
    assert pause(1000, Timing(120, 60, 2), leading=False) == elector.MAX_BACKOFF
    assert pause(1000, TIMING, leading=True) == 2.0


def test_timings_that_cannot_keep_one_leader_are_refused() -> None:
    assert Timing().problem() is None
    assert "longer than the renew deadline" in (Timing(10, 10, 2).problem() or "")
    assert "1.2 x the retry period" in (Timing(15, 2, 2).problem() or "")
    assert "positive" in (Timing(15, 10, 0).problem() or "")


def test_the_fenced_client_refuses_every_write_while_not_leading(
        monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[str] = []
    monkeypatch.setattr(KubeClient, "_send",
                        lambda self, method, path, *_: sent.append(method) or {})
    inner = idle_client()
    leading = False
    fenced = FencedClient(inner, lambda: leading)
    for method in ("POST", "PUT", "PATCH", "DELETE"):
        with pytest.raises(NotLeaderError, match="not the leader"):
            fenced.request(method, "/x")
    assert fenced.request("GET", "/x") == {} and sent == ["GET"]
    leading = True
    fenced.request("PUT", "/x")
    assert sent == ["GET", "PUT"]


class _Recorder(http.server.BaseHTTPRequestHandler):
    """Answers every request with ``{}`` and records its method and body."""

    seen: list[tuple[str, bytes]] = []

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.seen.append((self.command, self.rfile.read(length)))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def do_GET(self) -> None:
        self._answer()

    def do_PUT(self) -> None:
        self._answer()

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def recorder() -> Iterator[tuple[KubeClient, list[tuple[str, bytes]]]]:
    """A client of a plain HTTP server on 127.0.0.1, and what the server received."""
    seen: list[tuple[str, bytes]] = []
    handler = type("Recorder", (_Recorder,), {"seen": seen})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    client = KubeClient(Credentials(host=f"http://127.0.0.1:{server.server_port}",
                                    ca_file=None, cert_file=None, key_file=None,
                                    verify=False, config=SimpleNamespace(auth_settings=dict)),
                        timeout=5.0, user_agent="ua")
    try:
        yield client, seen
    finally:
        client.close()
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_a_write_that_lost_the_lead_after_its_first_check_sends_no_byte(
        recorder: tuple[KubeClient, list[tuple[str, bytes]]]) -> None:
    """A replica frozen between the call's check and the send (here: the lead is lost
    while the connection is taken) is refused as the bytes would go out, and the
    server receives nothing of that write."""
    client, seen = recorder
    asks: list[bool] = []

    def may_write() -> bool:
        asks.append(True)
        return len(asks) == 1  # the call's own check passes; the lead is gone after it

    fenced = FencedClient(client, may_write)
    with pytest.raises(NotLeaderError, match="PUT /x: this replica is not the leader"):
        fenced.request("PUT", "/x", body={"status": "stale"})
    assert len(asks) == 2
    # The same client still reads, and the server's record ends with that read only.
    assert fenced.request("GET", "/y") == {}
    assert seen == [("GET", b"")]


def test_a_write_that_keeps_the_lead_is_sent_whole(
        recorder: tuple[KubeClient, list[tuple[str, bytes]]]) -> None:
    """The positive control of the test above: the same write while leading arrives."""
    client, seen = recorder
    fenced = FencedClient(client, lambda: True)
    assert fenced.request("PUT", "/x", body={"status": "fresh"}) == {}
    assert seen == [("PUT", b'{"status": "fresh"}')]


def test_every_request_of_the_controllers_executor_and_observer_is_fenced(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The executor and the observer send through ``OperatorAccess``: over the fenced
    client, every write of theirs is refused while not leading."""
    from elasticrun.operator.controller import Controller
    from elasticrun.operator.metrics import Metrics

    sent: list[str] = []
    monkeypatch.setattr(KubeClient, "_send",
                        lambda self, method, path, *_: sent.append(method) or {})
    controller = Controller(FencedClient(idle_client(), lambda: False), Metrics())
    access = controller.executor.access
    assert controller.observer.access is access
    run = access.run("ns", "r")
    writes = [lambda: access.apply("/x", {}, "m"), lambda: access.delete("/x", "uid"),
              lambda: access.post_event("ns", {}), lambda: run.replace_status("1", {}, "m"),
              lambda: run.remove_annotations(["a"])]
    for write in writes:
        with pytest.raises(NotLeaderError):
            write()
    assert run.read() == {} and sent == ["GET"]


# --------------------------------------------------------------------------- two candidates


class FakeApi:
    """One Lease with resourceVersion compare-and-set, as the API server keeps it."""

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.version = 0
        self.requests: dict[str, int] = {}

    def handle(self, who: str, method: str, body: Any) -> dict[str, Any]:
        self.requests[who] = self.requests.get(who, 0) + 1
        if method == "GET":
            if self.lease is None:
                raise ApiError(404, "NotFound", "not found", {})
            return self.lease
        if method == "POST" and self.lease is not None:
            raise ApiError(409, "AlreadyExists", "exists", {})
        if method == "PUT" and (self.lease is None or body["metadata"].get("resourceVersion")
                                != self.lease["metadata"]["resourceVersion"]):
            raise ApiError(409, "Conflict", "modified", {})
        self.version += 1
        self.lease = {"metadata": {**body["metadata"], "resourceVersion": str(self.version),
                                   "uid": "lease-uid"}, "spec": body["spec"]}
        return self.lease


class FakeClient:
    def __init__(self, api: FakeApi, who: str) -> None:
        self.api, self.who, self.cut = api, who, False

    def request(self, method: str, path: str, *, body: Any = None, **_: Any) -> dict[str, Any]:
        if self.cut:
            raise ApiConnectionError("partitioned")
        return self.api.handle(self.who, method, body)


FAST = Timing(lease_duration=0.6, renew_deadline=0.4, retry_period=0.05)


def test_two_candidates_one_leads_and_a_cut_off_leader_stops_before_the_other_starts() -> None:
    async def scenario() -> None:
        api = FakeApi()
        clients = {n: FakeClient(api, n) for n in ("a", "b")}
        log: list[tuple[float, str, bool]] = []
        electors = {}
        for name, client in clients.items():
            e = Elector(cast(KubeClient, client), "ns", name, FAST,
                        on_change=lambda leading, n=name: log.append(
                            (time.monotonic(), n, leading)))
            electors[name] = e
        tasks = [asyncio.create_task(e.run()) for e in electors.values()]
        try:
            await asyncio.sleep(0.5)
            leaders = [n for n, e in electors.items() if e.may_write()]
            assert len(leaders) == 1, log
            (first,) = leaders
            other = "b" if first == "a" else "a"
            # Bounded: about one request per candidate per retry period.
            assert sum(api.requests.values()) < 2 * 0.5 / FAST.retry_period + 10
            clients[first].cut = True
            cut_at = time.monotonic()
            await asyncio.sleep(1.5)
            assert electors[other].may_write() and not electors[first].may_write()
            stopped = next(t for t, n, lead in log if n == first and not lead)
            started = next(t for t, n, lead in log if n == other and lead)
            assert stopped - cut_at <= FAST.renew_deadline + 0.05
            assert started > stopped  # never two leaders
            # At the expiry (the last renewal seen at most a jittered poll late), not a
            # poll after it.
            assert started - cut_at <= FAST.lease_duration + 1.2 * FAST.retry_period + 0.3
            assert api.lease is not None and api.lease["spec"]["holderIdentity"] == other
            assert api.lease["spec"]["leaseTransitions"] == 1
            # The old leader, reconnected, follows: the Lease is another's now.
            clients[first].cut = False
            await asyncio.sleep(0.3)
            assert not electors[first].may_write() and electors[other].may_write()
            # A clean stop releases the Lease; the other takes it at its next poll.
            await electors[other].stop()
            tasks[list(electors).index(other)].cancel()
            electors[other].release()
            assert api.lease["spec"]["holderIdentity"] is None
            await asyncio.sleep(FAST.lease_duration + 0.3)
            assert electors[first].may_write()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(scenario())


def test_a_clean_stop_releases_the_lease_even_after_a_renewal_failed() -> None:
    """A renewal that failed (timed out under load) leaves the leader no copy of the
    Lease; the release reads it afresh, and one write of ours that lands between that
    read and the release (a renewal still in flight) costs one more read, not the release."""
    async def scenario() -> None:
        api = FakeApi()
        client = FakeClient(api, "me")
        e = Elector(cast(KubeClient, client), "ns", "me", FAST)
        task = asyncio.create_task(e.run())
        try:
            await asyncio.sleep(0.3)
            assert e.may_write()
            client.cut = True  # the next renewal fails: the leader drops its copy
            await asyncio.sleep(2 * FAST.retry_period)
            client.cut = False
            await e.stop()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            assert api.lease is not None and api.lease["spec"]["holderIdentity"] == "me"
            handle = api.handle
            landed: list[str] = []

            def renewal_lands_first(who: str, method: str, body: Any) -> dict[str, Any]:
                if method == "PUT" and not landed:
                    landed.append("renewal")
                    assert api.lease is not None
                    handle(who, "PUT", {"metadata": api.lease["metadata"],
                                        "spec": api.lease["spec"]})
                return handle(who, method, body)

            api.handle = renewal_lands_first  # type: ignore[method-assign]
            e.release()
            assert landed == ["renewal"]
            assert api.lease["spec"]["holderIdentity"] is None
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())


def test_a_garbage_lease_is_taken_over_without_a_hot_loop() -> None:
    async def scenario() -> None:
        api = FakeApi()
        api.version = 1
        api.lease = {"metadata": {"resourceVersion": "1"},
                     "spec": {"holderIdentity": "x" * 4000, "leaseTransitions": -1,
                              "renewTime": "9999-12-31T23:59:59.999999Z"}}
        e = Elector(cast(KubeClient, FakeClient(api, "me")), "ns", "me", FAST)
        task = asyncio.create_task(e.run())
        try:
            await asyncio.sleep(0.5)
            assert e.may_write()
            assert api.lease["spec"]["holderIdentity"] == "me"
            assert api.requests["me"] <= 0.5 / FAST.retry_period + 3
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())


def test_the_controller_decides_only_between_lead_and_follow() -> None:
    from elasticrun.operator.controller import Controller
    from elasticrun.operator.metrics import Metrics
    from elasticrun.operator.runstate import RunState

    async def scenario() -> None:
        controller = Controller(idle_client(), Metrics())
        reconciled: list[tuple[str, str]] = []

        async def reconcile(key: tuple[str, str]) -> None:
            reconciled.append(key)

        controller.queue.work = reconcile
        controller.states = {("ns", "a"): RunState(raw={}), ("ns", "b"): RunState(raw={})}
        controller.enqueue(("ns", "a"))  # a follower: events queue nothing
        await asyncio.sleep(0.05)
        assert reconciled == []
        controller.reconcile = reconcile  # type: ignore[method-assign]
        await controller.lead()  # every run held is reconciled once
        await asyncio.sleep(0.05)
        assert sorted(reconciled) == [("ns", "a"), ("ns", "b")]
        await controller.follow()
        controller.enqueue(("ns", "a"))
        await asyncio.sleep(0.05)
        assert len(reconciled) == 2
        await controller.lead()  # a second term: the queue runs again
        await asyncio.sleep(0.05)
        assert len(reconciled) == 4
        await controller.stop()

    asyncio.run(scenario())
