"""Simulated nodes: many rendezvous clients in one asyncio process, for the scale benchmark.

Run as ``python -m bench.simnode``; it reads one JSON line on stdin (the run,
the nodes, when to start, how often to renew, how many times to rejoin), writes
one JSON line per formed node on stdout, and renews each node's Lease from its
creation until stdin closes.  Each formed node keeps its run watch open, as a
member's handler does, and writes one more line
(``{"node", "event": "change", "t", "round"}``) when the run first shows it what
makes its ``num_nodes_waiting()`` positive (a loss, a newcomer): the moment a
member of that round knows.  For its first ``rejoins`` changes it then asks for
the next round, as a torch agent restarting its workers does, and writes a
``formed`` line when it holds that round.  A later stdin line
``{"freeze": node}`` makes that node stop renewing and watching without
leaving (a hung member); it answers with a ``frozen`` line saying when its last
renewal was written.

A simulated node sends what a real handler of a large run sends, built by the
product's own code: it reads the run, creates its Lease with its join request
(:func:`elasticrun.api.leases.node_lease`, ``WaitingNode`` as the handler writes
it), opens the narrow watch (``status.signal!=S`` from the resourceVersion it
read, :func:`elasticrun.api.gateway.signal_selector`) and, in the largest runs
(:func:`elasticrun.api.rounds.members_told_in_slices`), the watch of its slice by
name, the one ``ElasticRunSlice`` of the run's 32 where the operator writes its
place in the round (:mod:`elasticrun.api.slices`), then, holding that round, the
handler's quiet watch (metadata only, ``status.stableRound!=R``,
:func:`elasticrun.api.gateway.round_selector`), and renews its Lease with the
handler's merge patch.  Placed in a round it does not lead, unless told in its
slice, it reads its rank 0's Lease before it counts as holding the round, as a
handler reads it to check the round's store before connecting
(:meth:`SimNode.check_store`).  It leaves
sealing to the operator, as a real node of a run of 64 nodes or more does
(:func:`elasticrun.api.rounds.nodes_defer_seal`); it does not host a TCPStore.
Each node has its own connections (requests, run watch, slice watch), as a handler's
connection pool does, so the API server serves exactly the connections,
requests and bytes of real nodes.

Client CPU is what lets one machine play 2,048 nodes: one thread, raw
HTTP/1.1, and each distinct watch event parsed once per process (every watcher
receives the same bytes).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import datetime as dt
import json
import ssl
import sys
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode, urlsplit

from elasticrun.api import slices
from elasticrun.api.gateway import (
    end_selector,
    round_selector,
    settled_selector,
    signal_selector,
)
from elasticrun.api.kube import (
    JSON,
    MERGE_PATCH,
    METADATA_ONLY,
    USER_AGENT,
    Credentials,
    lease_path,
    leases_path,
    load_credentials,
    run_path,
    runs_path,
)
from elasticrun.api.leases import join_annotations, node_lease
from elasticrun.api.model import ElasticRun, RunSpec, WaitingNode, format_time, now, parse_run
from elasticrun.api.naming import lease_name
from elasticrun.api.rounds import (
    defer_seal_wait,
    may_keep_place,
    members_keep_places,
    members_told_in_slices,
    members_watch_quietly,
    nodes_waiting,
)
from elasticrun.handler.step import Knowledge

#: Bound on one request, and on a whole formation as a node sees it.
REQUEST_BOUND = 60.0


class HttpError(RuntimeError):
    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:200]!r}")
        self.status = status


@dataclass
class Tickets:
    """One client's latest TLS session, offered on its next connection, as a handler's
    client does (:class:`elasticrun.api.kube.ResumingContext`): each simulated node, and
    each floor client, plays a process of its own, so each has its own."""

    session: ssl.SSLSession | None = None


#: The session the connection being opened offers (:class:`_OfferingContext`).
_offered: contextvars.ContextVar[ssl.SSLSession | None] = contextvars.ContextVar(
    "simnode_offered", default=None)


class _OfferingContext(ssl.SSLContext):
    """The process's one TLS context; each connection offers its own client's session
    (:data:`_offered`, set around the connect in the client's task)."""

    def wrap_bio(self, *args: Any, **kwargs: Any) -> ssl.SSLObject:
        if kwargs.get("session") is None:
            kwargs["session"] = _offered.get()
        return super().wrap_bio(*args, **kwargs)


@dataclass
class Connection:
    """One keep-alive HTTP/1.1 connection to the API server."""

    host: str
    port: int
    tls: ssl.SSLContext | None
    auth: str | None
    tickets: Tickets
    reader: asyncio.StreamReader | None = None
    writer: asyncio.StreamWriter | None = None
    #: One request at a time: a member's renewal and its new join request share it.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    #: Whether its TLS session was kept in :attr:`tickets` (after its first response).
    remembered: bool = False

    async def open(self) -> None:
        offered = _offered.set(self.tickets.session)
        try:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port,
                                                                     ssl=self.tls)
        finally:
            _offered.reset(offered)
        self.remembered = False

    def _remember(self) -> None:
        """Keep the session for the client's next connection once a response was read
        (the server's ticket came before it)."""
        self.remembered = True
        sslobj = self.writer.get_extra_info("ssl_object") if self.writer is not None else None
        session = sslobj.session if sslobj is not None else None
        if session is not None and session.has_ticket:
            self.tickets.session = session

    async def send(self, method: str, path: str, body: Any = None,
                   content_type: str = "application/json", accept: str = JSON) -> None:
        if self.writer is None:
            await self.open()
        assert self.writer is not None
        data = b"" if body is None else json.dumps(body).encode()
        head = [f"{method} {path} HTTP/1.1", f"Host: {self.host}:{self.port}",
                f"Accept: {accept}", f"User-Agent: {USER_AGENT}",
                f"Content-Length: {len(data)}"]
        if body is not None:
            head.append(f"Content-Type: {content_type}")
        if self.auth:
            head.append(f"Authorization: {self.auth}")
        self.writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + data)
        await self.writer.drain()

    async def head(self) -> tuple[int, dict[str, str]]:
        assert self.reader is not None
        status_line = await self.reader.readline()
        if not status_line:
            raise ConnectionError("the API server closed the connection")
        status = int(status_line.split()[1])
        if not self.remembered:
            self._remember()
        headers: dict[str, str] = {}
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            key, _, value = line.decode("latin-1").partition(":")
            headers[key.strip().lower()] = value.strip()
        return status, headers

    async def chunks(self) -> Any:
        """The body of a chunked response, chunk by chunk."""
        assert self.reader is not None
        while True:
            size = int((await self.reader.readline()).split(b";")[0], 16)
            if size == 0:
                await self.reader.readline()
                return
            data = await self.reader.readexactly(size)
            await self.reader.readline()
            yield data

    async def request(self, method: str, path: str, body: Any = None,
                      content_type: str = "application/json") -> bytes:
        async with self.lock:
            await self.send(method, path, body, content_type)
            status, headers = await self.head()
            assert self.reader is not None
            if headers.get("transfer-encoding") == "chunked":
                data = b"".join([c async for c in self.chunks()])
            else:
                data = await self.reader.readexactly(int(headers.get("content-length", "0")))
        if status >= 400:
            raise HttpError(status, data)
        return data

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


async def watch_lines(connection: Connection, path: str, query: dict[str, Any],
                      accept: str = JSON) -> Any:
    """The lines (events) of one watch of ``path``, as they arrive."""
    query = {**query, "watch": "true", "timeoutSeconds": 300, "allowWatchBookmarks": "true"}
    await connection.send("GET", f"{path}?{urlencode(query)}", accept=accept)
    status, _ = await connection.head()
    if status >= 400:
        raise HttpError(status, b"watch refused")
    buffer = b""
    async for chunk in connection.chunks():
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            yield line


@dataclass
class Shared:
    """What all nodes of this process share: where the server is, and parsed events."""

    host: str
    port: int
    tls: ssl.SSLContext | None
    credentials: Credentials
    namespace: str
    run: str
    parsed: dict[bytes, dict[str, Any]] = field(default_factory=dict)
    runs: dict[bytes, ElasticRun] = field(default_factory=dict)

    def connection(self, tickets: Tickets) -> Connection:
        """A connection of the client whose TLS sessions ``tickets`` keeps."""
        return Connection(self.host, self.port, self.tls, self.credentials.authorization(),
                          tickets)

    def parse(self, line: bytes) -> dict[str, Any]:
        """One watch event; every watcher gets the same bytes, so each is parsed once here."""
        event = self.parsed.get(line)
        if event is None:
            event = json.loads(line)
            self.parsed[line] = event
        return event

    def run_of(self, line: bytes) -> ElasticRun:
        """The run in one watch event, parsed once here like :meth:`parse`."""
        run = self.runs.get(line)
        if run is None:
            run = parse_run(self.parse(line)["object"])
            self.runs[line] = run
        return run


def shared_from(kubeconfig: str, namespace: str, run: str) -> Shared:
    credentials = load_credentials(kubeconfig)
    url = urlsplit(credentials.host)
    tls = None
    if url.scheme == "https":
        tls = _OfferingContext(ssl.PROTOCOL_TLS_CLIENT)
        if credentials.ca_file:
            tls.load_verify_locations(credentials.ca_file)
        else:
            tls.load_default_certs()
        if not credentials.verify:
            tls.check_hostname = False
            tls.verify_mode = ssl.CERT_NONE
        if credentials.cert_file:
            tls.load_cert_chain(credentials.cert_file, credentials.key_file)
    return Shared(url.hostname or "127.0.0.1", url.port or 443, tls, credentials, namespace,
                  run)


class SimNode:
    def __init__(self, shared: Shared, name: str, port: int) -> None:
        self.shared = shared
        self.name = name
        self.port = port
        self.tickets = Tickets()
        self.requests = shared.connection(self.tickets)
        self.watch = shared.connection(self.tickets)
        self.mailbox = shared.connection(self.tickets)
        #: The name of its Lease, once created; the holder it writes there, as a handler's.
        self.lease: str | None = None
        #: The run's uid, as the node first read it: its Lease's owner, and the name of
        #: the slices its place is told in (:func:`elasticrun.api.slices.slice_name`).
        self.run_uid: str | None = None
        self.holder = f"{name}@{uuid.uuid4().hex[:8]}"
        #: The run's spec, as the node first read it.
        self.spec: RunSpec | None = None
        #: The round this node asked for (its result), set by whichever watch saw it first.
        self.formed: asyncio.Future[dict[str, Any]] | None = None
        #: The run watch, kept open after formation to see the round change.
        self.follower: asyncio.Task[Change | None] | None = None
        #: Renewing its Lease, from its creation on (:meth:`renew`).
        self.renewal: asyncio.Task[None] | None = None
        #: When its Lease was last written with a renewal (monotonic): its creation, then
        #: each renewal's answer.
        self.renewed_at: float | None = None
        #: Set by the coordinator (:func:`_commands`): the node stops renewing and watching,
        #: as a hung process would, without deleting its Lease or leaving.
        self.frozen = False
        #: The request it last wrote (its ``since``): a round that answers it again after
        #: the one the node holds kept its place.
        self.since: dt.datetime | None = None

    async def rendezvous(self, interval: float) -> dict[str, Any]:
        """Read the run, join through the Lease, wait for the round on both watches.

        The largest runs' nodes learn their places from their slices; a seal that
        moves the signal (a node's, or an older operator's under ``--baseline``)
        reaches it on the narrow run watch instead.  Whichever comes first forms
        it.  The run watch stays open afterwards (:attr:`follower`), as a
        handler's does, until the node's round changes (:meth:`_follow_run`).
        The Lease is renewed every ``interval`` from its creation on, as a handler's.
        """
        s = self.shared
        run = json.loads(await self.requests.request("GET", run_path(s.namespace, s.run)))
        spec, meta = run["spec"], run["metadata"]
        join = WaitingNode(name=self.name, address="127.0.0.1", store_port=self.port,
                           since=now())
        self.since = join.since
        self.lease = lease_name(s.run, self.name)
        self.run_uid = str(meta["uid"])
        body = node_lease(s.run, self.name, self.holder, spec["heartbeatTimeoutSeconds"],
                          meta["uid"], now(), join)  # the handler's body
        await self.requests.request("POST", leases_path(s.namespace), body)
        self.renewed_at = time.monotonic()
        self.renewal = asyncio.create_task(self.renew(interval))
        signal = (run.get("status") or {}).get("signal", 0)
        self.spec = RunSpec.from_dict(spec)
        return await self._placed(self.spec, join, signal, meta["resourceVersion"])

    async def rejoin(self, change: Change) -> dict[str, Any]:
        """Ask for the next round, as a member's handler does when its round changed.

        One merge patch of its Lease's annotations (the handler's ``set_join``:
        the new request, any report of an unreachable rank 0 withdrawn), then
        the run watch re-opened from the change it saw, and in the largest runs
        its slice watch.
        Told by the quiet watch, it reads nothing, as the handler does: it
        watches for the run to settle, or in the largest runs for its end
        (:meth:`_follow_end`) until its slice tells it its place.  Where the
        operator keeps its place (:func:`~elasticrun.api.rounds.may_keep_place`)
        it writes nothing and waits for the round that keeps it, as long as the
        handler does, before it asks; woken by the quiet watch, it looks for its
        place in the run that watch sent (:meth:`_kept_quietly`).
        """
        assert self.lease is not None
        held = int(self.formed.result()["round"]) if self.formed is not None else 0
        kept = self._kept_in(change, held)
        if kept is not None:
            return kept
        if change.run is not None and change.resource_version is not None \
                and may_keep_place(change.run, self.name, held):
            with contextlib.suppress(TimeoutError):
                return await asyncio.wait_for(self._kept(change), defer_seal_wait(change.run.spec))
        if change.run is None and change.resource_version is not None \
                and self._may_keep_quietly(held):
            assert self.spec is not None
            with contextlib.suppress(TimeoutError):
                quietly = await asyncio.wait_for(
                    self._kept_quietly(held, change.resource_version, change.raw),
                    defer_seal_wait(self.spec))
                if quietly is not None:
                    return quietly
        join = WaitingNode(name=self.name, address="127.0.0.1", store_port=self.port,
                           since=now())
        self.since = join.since
        await self.requests.request(
            "PATCH", lease_path(self.shared.namespace, self.lease), join_patch(join),
            MERGE_PATCH)
        self.watch = self.shared.connection(self.tickets)
        self.mailbox = self.shared.connection(self.tickets)
        if change.run is None:
            assert self.spec is not None
            return await self._placed(self.spec, join, None, None)
        assert change.resource_version is not None
        return await self._placed(change.run.spec, join, change.run.status.signal,
                                  change.resource_version)

    def _kept_in(self, change: Change, held: int) -> dict[str, Any] | None:
        """Its place kept in the round the change showed (the operator may seal it as soon
        as the round must re-form), as :attr:`~elasticrun.handler.step.Knowledge.kept`
        takes it: a newer round answering its request again.  The run watch goes on from
        that change, for the kept round."""
        run, version = change.run, change.resource_version
        if run is None or version is None:
            return None
        mine = Knowledge(node=self.name, run=run, previous_round=held, join_deadline=0.0,
                         previous_since=self.since).kept
        if mine is None:
            return None
        formed: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        formed.set_result({"rank": mine.rank, "world": mine.world_size, "round": mine.round,
                           "leader": mine.leader, "t_done": change.t})
        self.formed = formed
        self.watch = self.shared.connection(self.tickets)
        self.follower = asyncio.create_task(
            self._follow_run(run.status.signal, version, mine.round, run.spec))
        return formed.result()

    def _may_keep_quietly(self, held: int) -> bool:
        """Whether this node, woken by its quiet watch, may wait for its place kept: as
        :func:`~elasticrun.api.rounds.may_keep_place` (``woken``) decides for a
        handler from the copy of the run it holds, which a simulated node does not
        keep (parsing every round's roster in each node would cost the simulation
        more than the API server's side of the round).  A member of a run that
        keeps places, and not its rank 0: a simulated node serves no store, so it
        announces none and asks again."""
        formed = self.formed
        return self.spec is not None and members_keep_places(self.spec) and held > 0 \
            and formed is not None and formed.result().get("rank") != 0

    async def _kept_quietly(self, held: int, woken: str, sent: dict[str, Any] | None
                            ) -> dict[str, Any] | None:
        """Woken by the quiet watch (its event at resourceVersion ``woken``): the round that
        keeps this node's place, as the handler finds it: in the run the event
        ``sent`` (or, without one, read no older than ``woken``, ``step.Read``), or,
        where that run still re-forms around this node and its rank 0, in the run as
        the next seal settles it; None where neither holds the node, which then
        asks."""
        s = self.shared
        read = sent if sent is not None else json.loads(await self.requests.request(
            "GET", run_path(s.namespace, s.run) + "?" + urlencode({"resourceVersion": woken})))
        place = placed_in(read, self.name, held)
        if place is None and keeps_waiting(read, self.name, held):
            self.watch = s.connection(self.tickets)
            place = placed_in(await self._settled() or {}, self.name, held)
        if place is None:
            return None
        formed: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        formed.set_result({"t_done": time.monotonic(), **place})
        self.formed = formed
        self.watch = s.connection(self.tickets)
        self.follower = asyncio.create_task(self._follow_quietly(place["round"]))
        return formed.result()

    async def _settled(self) -> dict[str, Any] | None:
        """The run once it settles (``RunGateway.watch_settled``'s first event, on
        :attr:`watch`); None when the watch ended first."""
        s = self.shared
        try:
            async for line in watch_lines(self.watch, runs_path(s.namespace),
                                           {"fieldSelector": settled_selector(s.run)}):
                event = s.parse(line)
                if event.get("type") in ("ADDED", "MODIFIED"):
                    return dict(event.get("object") or {})
            return None
        finally:
            self.watch.close()

    async def _kept(self, change: Change) -> dict[str, Any]:
        """The round that keeps this node's place, watched from the change it saw."""
        assert change.run is not None and change.resource_version is not None
        self.watch = self.shared.connection(self.tickets)
        self.mailbox = self.shared.connection(self.tickets)
        unused = WaitingNode(name=self.name)  # no slice watch: runs told in slices keep no place
        return await self._placed(change.run.spec, unused, change.run.status.signal,
                                  change.resource_version)

    async def _placed(self, spec: RunSpec, join: WaitingNode, signal: int | None,
                      run_version: str | None) -> dict[str, Any]:
        """Wait for the round that answers ``join``: on the run watch (from ``signal`` and
        ``run_version``; None: for the run's end only), or on its slice."""
        held = int(self.formed.result()["round"]) if self.formed is not None else 0
        formed: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.formed = formed
        self.follower = asyncio.create_task(
            self._follow_run(signal, run_version, held, spec))
        waits: list[asyncio.Future[Any]] = [formed, self.follower]
        mailbox = None
        if members_told_in_slices(spec):  # as the handler does
            mailbox = asyncio.create_task(self._from_slice(join))
            waits.append(mailbox)
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if not formed.done() and mailbox is not None and mailbox.done():
                formed.set_result(mailbox.result())
            if not formed.done():
                self.follower.result()  # what ended the run watch
                raise ConnectionError("the run watch ended before a round formed")
            return formed.result()
        except BaseException:
            self.follower.cancel()
            raise
        finally:
            if mailbox is not None:
                mailbox.cancel()
            self.mailbox.close()

    async def _follow_run(self, signal: int | None, resource_version: str | None, held: int,
                          spec: RunSpec) -> Change | None:
        """The run watch of a node: its place in a round after ``held``, then its change.

        In a large run (``members_watch_quietly``), once the node holds its
        round, by either watch, the narrow watch (or, rejoining without a read,
        ``signal`` None, the watch for the run to settle, or in the largest runs
        for its end) gives way to the handler's quiet watch of that round
        (:meth:`_follow_quietly`), as ``RunWatcher.watch_quietly`` does.
        """
        if signal is not None and resource_version is not None:
            first: Coroutine[Any, Any, Change | None] = self._follow_signal(
                signal, resource_version, held)
        elif members_told_in_slices(spec):
            first = self._follow_end()
        else:
            first = self._follow_settled(held)
        if not members_watch_quietly(spec):
            return await first
        formed = self.formed
        assert formed is not None
        narrow = asyncio.create_task(first)
        either: list[asyncio.Future[Any]] = [formed, narrow]
        try:
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        finally:
            narrow.cancel()
            await asyncio.wait([narrow])  # its own close of self.watch, before the next one
            self.watch.close()
        if not formed.done():
            return None
        self.watch = self.shared.connection(self.tickets)
        return await self._follow_quietly(int(formed.result()["round"]))

    async def _follow_settled(self, held: int) -> Change | None:
        """The handler's watch for the run to settle while it rejoins
        (``RunGateway.watch_settled``): its first event, the whole run, places the node
        when it holds the node's next round; otherwise the narrow watch goes on from
        that run."""
        settled = await self._settled()
        if settled is None:
            return None
        formed = self.formed
        assert formed is not None
        place = placed_in(settled, self.name, held)
        if place is not None:
            if not formed.done():
                formed.set_result({"t_done": time.monotonic(), **place})
            return None  # the caller watches the round it holds quietly
        self.watch = self.shared.connection(self.tickets)
        return await self._follow_signal(int((settled.get("status") or {}).get("signal") or 0),
                                         str((settled.get("metadata") or {})
                                             .get("resourceVersion")), held)

    async def _follow_end(self) -> Change | None:
        """The handler's watch for the run's end while it rejoins (``RunGateway.watch_end``):
        on its first event the node reads the run once, and the watch has ended
        (None)."""
        s = self.shared
        query = {"fieldSelector": end_selector(s.run)}
        try:
            async for line in watch_lines(self.watch, runs_path(s.namespace), query,
                                           METADATA_ONLY):
                if s.parse(line).get("type") == "BOOKMARK":
                    continue
                await self.requests.request("GET", run_path(s.namespace, s.run))
                return None
            return None
        finally:
            self.watch.close()

    async def _follow_quietly(self, round_number: int) -> Change | None:
        """The handler's quiet watch (``RunGateway.watch_round``): its first event, the run
        as metadata, is the change; the run itself is read only when the node asks again
        (:meth:`rejoin`).  None when the watch ended first."""
        s = self.shared
        query = {"fieldSelector": round_selector(s.run, round_number)}
        whole = self.spec is not None and members_keep_places(self.spec)
        try:
            async for line in watch_lines(self.watch, runs_path(s.namespace), query,
                                           JSON if whole else METADATA_ONLY):
                event = s.parse(line)
                if event.get("type") in ("ADDED", "MODIFIED"):
                    obj = event.get("object") or {}
                    meta = obj.get("metadata") or {}
                    return Change(time.monotonic(), None, str(meta.get("resourceVersion")),
                                  obj if whole else None)
            return None
        finally:
            self.watch.close()

    async def _follow_signal(self, signal: int, resource_version: str, held: int
                             ) -> Change | None:
        """The narrow run watch: this node's place in a round after ``held``, then its change.

        Each event opens the watch again from the run it carried, with that
        run's signal, as the handler's watcher does, so that the node is sent
        the run only when its signal moves.  Returns when (monotonic) the run
        first shows that this node's ``num_nodes_waiting()`` is positive
        (:func:`knows_of_change`), with the run as it saw it then; None when
        the server ended the watch first.
        """
        s = self.shared
        formed = self.formed
        assert formed is not None
        while True:
            query = {"fieldSelector": signal_selector(s.run, signal),
                     "resourceVersion": resource_version}
            seen: dict[str, Any] | None = None
            try:
                async for line in watch_lines(self.watch, runs_path(s.namespace), query):
                    event = s.parse(line)
                    if event.get("type") not in ("ADDED", "MODIFIED"):
                        continue
                    seen = event.get("object") or {}
                    version = str((seen.get("metadata") or {}).get("resourceVersion"))
                    if not formed.done():
                        place = placed_in(seen, self.name, held)
                        if place is not None:
                            formed.set_result({"t_done": time.monotonic(), **place})
                    else:
                        run = s.run_of(line)
                        if knows_of_change(run, int(formed.result()["round"])):
                            return Change(time.monotonic(), run, version)
                    break
            finally:
                self.watch.close()
            if seen is None:
                return None
            signal = int((seen.get("status") or {}).get("signal") or 0)
            resource_version = str((seen.get("metadata") or {}).get("resourceVersion"))
            self.watch = s.connection(self.tickets)

    async def _from_slice(self, join: WaitingNode) -> dict[str, Any]:
        """The place that answers ``join``, from the node's slice, watched by name.

        The slice is selected by name (``metadata.name``), as the API server's
        watch cache dispatches by name: the node receives the events of the one
        slice its place is told in, and nobody else's.  As the handler's, the
        watch names no resourceVersion: the server first sends the slice as it
        is, if the operator has written it, then its changes.  Only the
        place that answers ``join`` (its ``since``) counts: a place of the
        node's earlier request, or of another run, is none.  Each event's bytes
        are the same for every member of the slice, so each is parsed once per
        process.
        """
        s = self.shared
        assert self.run_uid is not None
        name = slices.slice_name(self.run_uid, slices.slice_index(self.name))
        query = {"fieldSelector": f"metadata.name={name}"}
        async for line in watch_lines(self.mailbox, slices.slices_path(s.namespace), query):
            event = s.parse(line)
            if event.get("type") not in ("ADDED", "MODIFIED"):
                continue
            told = slices.read_place(event.get("object"), s.run, self.name)
            if told is not None and told.since == join.since:
                return {"t_done": time.monotonic(), "rank": told.rank,
                        "world": told.world_size, "round": told.round, "leader": told.leader,
                        "vouched": True}
        raise ConnectionError("the slice watch ended before a round formed")

    async def check_store(self, place: dict[str, Any]) -> None:
        """Read the Lease of the round's rank 0, as a handler that did not seal the round
        does before it connects to that rank 0's store (``RoundExecutor``'s check of
        the store against what rank 0 announced, :func:`~elasticrun.api.gateway.readable_lease`),
        and stamp ``place`` with when the node would then hold its round.  Rank 0
        itself reads nothing: it serves the store; nor does a node told in its slice
        (``vouched``), whose store the operator checked."""
        leader = place.get("leader")
        if place.get("rank") != 0 and leader and not place.get("vouched"):
            await self.requests.request(
                "GET", lease_path(self.shared.namespace, lease_name(self.shared.run, leader)))
        place["t_done"] = time.monotonic()

    async def renew(self, interval: float) -> None:
        """The handler's renewal: a merge patch of renewTime, every ``interval``; a frozen
        node stops here, and reports when its last renewal was written."""
        assert self.lease is not None
        path = lease_path(self.shared.namespace, self.lease)
        while True:
            await asyncio.sleep(interval)
            if self.frozen:
                return
            body = {"spec": {"renewTime": format_time(now()),
                             "holderIdentity": self.holder}}
            try:
                await self.requests.request("PATCH", path, body, MERGE_PATCH)
            except (HttpError, OSError, asyncio.IncompleteReadError):
                return  # the run (and its Leases) were deleted: the benchmark is over
            self.renewed_at = time.monotonic()

    async def freeze(self) -> float | None:
        """Stop renewing and watching; when the last renewal was written (monotonic)."""
        self.frozen = True
        if self.follower is not None:
            self.follower.cancel()
        if self.renewal is not None:
            # A renewal on the wire completes (the flag stops the next one).
            await asyncio.wait([self.renewal], timeout=REQUEST_BOUND)
        return self.renewed_at


@dataclass(frozen=True)
class Change:
    """What a formed node saw when its round changed: when (monotonic), and the run then
    (None: told by the quiet watch, which carries the run's resourceVersion only)."""

    t: float
    run: ElasticRun | None
    resource_version: str | None
    #: The whole run the quiet watch sent where places are kept (unparsed).
    raw: dict[str, Any] | None = None


def join_patch(join: WaitingNode) -> dict[str, Any]:
    """The merge patch of a node's Lease that asks for the next round: the annotations a
    handler's ``set_join`` writes (:func:`~elasticrun.api.leases.join_annotations`)."""
    return {"metadata": {"annotations": join_annotations(join)}}


def placed_in(obj: dict[str, Any], node: str, held: int) -> dict[str, Any] | None:
    """``node``'s place in the round the run object shows, if it is a round after ``held``
    and ``node`` is one of its participants; None otherwise."""
    status = obj.get("status") or {}
    if int(status.get("round") or 0) <= held:
        return None
    participants = status.get("participants") or ()
    mine, leader = None, None
    for p in participants:
        if p.get("name") == node:
            mine = p
        if p.get("rank") == 0:
            leader = p.get("name")
    if mine is None:
        return None
    return {"rank": mine["rank"], "world": len(participants), "round": status["round"],
            "leader": leader}


def keeps_waiting(obj: dict[str, Any], node: str, held: int) -> bool:
    """Whether a member of round ``held`` waits for its place in the run object shows (as
    :func:`~elasticrun.api.rounds.may_keep_place` decides for a handler, on the fields a
    simulated node reads without parsing the roster): the round re-forms
    (``stableRound`` 0) and still holds the node and a rank 0."""
    status = obj.get("status") or {}
    if int(status.get("round") or 0) != held or status.get("stableRound") != 0:
        return False
    members = {p.get("name"): p.get("rank") for p in status.get("participants") or ()}
    return node in members and 0 in members.values()


def knows_of_change(run: ElasticRun, my_round: int) -> bool:
    """Whether a member of ``my_round`` would now see ``num_nodes_waiting() > 0``."""
    return nodes_waiting(run, my_round, now=now()) > 0


async def _form(node: SimNode, start_at: float, interval: float,
                out: asyncio.Queue[dict[str, Any]]) -> bool:
    """Form ``node`` and report it; False when it did not form."""
    await asyncio.sleep(max(0.0, start_at - time.monotonic()))
    result: dict[str, Any] = {"node": node.name, "t_start": time.monotonic()}
    try:
        result.update(await asyncio.wait_for(node.rendezvous(interval), REQUEST_BOUND * 5))
        await node.check_store(result)
    except Exception as exc:  # reported to the coordinator
        result.update({"t_done": time.monotonic(), "error": f"{type(exc).__name__}: {exc}"})
    await out.put(result)
    return "error" not in result


async def _follow(node: SimNode, rejoins: int, out: asyncio.Queue[dict[str, Any]]) -> None:
    """Report each change of the formed ``node``'s round (a ``change`` line, with the round it
    held); for the first ``rejoins`` of them, ask for the next round and report it (a
    ``formed`` line)."""
    with contextlib.suppress(HttpError, OSError, asyncio.IncompleteReadError, ValueError):
        while node.follower is not None and node.formed is not None:
            held = int(node.formed.result()["round"])
            change = await node.follower
            if change is None or node.frozen:
                return
            await out.put({"node": node.name, "event": "change", "t": change.t, "round": held})
            if rejoins <= 0:
                return
            rejoins -= 1
            result: dict[str, Any] = {"node": node.name, "event": "formed",
                                      "t_start": time.monotonic()}
            try:
                result.update(await asyncio.wait_for(node.rejoin(change), REQUEST_BOUND * 5))
                await node.check_store(result)
            except Exception as exc:  # reported to the coordinator
                result["error"] = f"{type(exc).__name__}: {exc}"
            result.setdefault("t_done", time.monotonic())
            await out.put(result)
            if "error" in result:
                return


async def _forward(out: asyncio.Queue[dict[str, Any]]) -> None:
    while True:
        sys.stdout.write(json.dumps(await out.get()) + "\n")
        sys.stdout.flush()


async def _commands(nodes: dict[str, SimNode], out: asyncio.Queue[dict[str, Any]]) -> None:
    """The coordinator's lines after the first, until stdin closes: ``{"freeze": node}``
    (answered with a ``frozen`` line: when its last renewal was written)."""
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        name = json.loads(line).get("freeze")
        if name in nodes:
            renewed = await nodes[name].freeze()
            await out.put({"node": name, "event": "frozen", "t_renewed": renewed})


async def main_async(config: dict[str, Any]) -> None:
    shared = shared_from(config["kubeconfig"], config["namespace"], config["run"])
    nodes = [SimNode(shared, name, 20000 + i) for i, name in enumerate(config["nodes"])]
    interval = float(config["renew_interval"])
    out: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    forward = asyncio.create_task(_forward(out))
    formed = await asyncio.gather(*(_form(n, float(config["start_at"]), interval, out)
                                    for n in nodes))
    shared.parsed.clear()
    followers = [asyncio.create_task(_follow(n, int(config.get("rejoins", 0)), out))
                 for n, ok in zip(nodes, formed, strict=True) if ok]
    # Stay live members (renewing, watching the run) until the coordinator closes stdin.
    await _commands({n.name: n for n in nodes}, out)
    for task in [*followers, forward]:
        task.cancel()
    for node in nodes:
        if node.follower is not None:
            node.follower.cancel()
        if node.renewal is not None:
            node.renewal.cancel()
        node.requests.close()
        node.watch.close()


def main() -> int:
    config = json.loads(sys.stdin.readline())
    asyncio.run(main_async(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
