"""Simulated nodes: many rendezvous clients in one asyncio process, for the scale benchmark.

Run as ``python -m bench.simnode``; it reads one JSON line on stdin (the run,
the nodes, when to start), writes one JSON line per formed node on stdout,
then renews the nodes' Leases until stdin closes.  Each formed node keeps its
run watch open, as a member's handler does, and writes one more line
(``{"node", "event": "change", "t"}``) when the run first shows it what makes
its ``num_nodes_waiting()`` positive (a loss, a newcomer): the moment a member
knows.

A simulated node sends what a real handler of a large run sends, built by the
product's own code: it reads the run, creates its Lease with its join request
(:func:`elasticrun.api.leases.node_lease`, ``WaitingNode`` as the handler writes it), opens
the narrow watch (``status.signal!=S`` from the resourceVersion it read) and, in
runs of 256 nodes or more, the watch of its own Lease, where the operator writes
its place in the round, and renews its Lease with the handler's merge patch.  It
leaves sealing to the operator, as a real node of a run of 64 nodes or more does
(:func:`elasticrun.api.rounds.nodes_defer_seal`); it does not host a TCPStore.
Each node has its own connections (requests, run watch, Lease watch), as a handler's
connection pool does, so the API server serves exactly the connections,
requests and bytes of real nodes.

Client CPU is what lets one machine play 2,048 nodes: one thread, raw
HTTP/1.1, and each distinct watch event parsed once per process (every watcher
receives the same bytes).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode, urlsplit

from elasticrun.api.kube import (
    MERGE_PATCH,
    USER_AGENT,
    Credentials,
    lease_path,
    leases_path,
    load_credentials,
    run_path,
    runs_path,
)
from elasticrun.api.leases import ASSIGNMENT_ANNOTATION, node_lease, read_assignment
from elasticrun.api.model import ElasticRun, RunSpec, WaitingNode, format_time, now, parse_run
from elasticrun.api.naming import lease_name
from elasticrun.api.rounds import members_told_by_lease, nodes_waiting

#: Bound on one request, and on a whole formation as a node sees it.
REQUEST_BOUND = 60.0


class HttpError(RuntimeError):
    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:200]!r}")
        self.status = status


@dataclass
class Connection:
    """One keep-alive HTTP/1.1 connection to the API server."""

    host: str
    port: int
    tls: ssl.SSLContext | None
    auth: str | None
    reader: asyncio.StreamReader | None = None
    writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port,
                                                                 ssl=self.tls)

    async def send(self, method: str, path: str, body: Any = None,
                   content_type: str = "application/json") -> None:
        if self.writer is None:
            await self.open()
        assert self.writer is not None
        data = b"" if body is None else json.dumps(body).encode()
        head = [f"{method} {path} HTTP/1.1", f"Host: {self.host}:{self.port}",
                "Accept: application/json", f"User-Agent: {USER_AGENT}",
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


async def watch_lines(connection: Connection, path: str, query: dict[str, Any]) -> Any:
    """The lines (events) of one watch of ``path``, as they arrive."""
    query = {**query, "watch": "true", "timeoutSeconds": 300, "allowWatchBookmarks": "true"}
    await connection.send("GET", f"{path}?{urlencode(query)}")
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

    def connection(self) -> Connection:
        return Connection(self.host, self.port, self.tls, self.credentials.authorization())

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
        tls = ssl.create_default_context(cafile=credentials.ca_file)
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
        self.requests = shared.connection()
        self.watch = shared.connection()
        self.mailbox = shared.connection()
        #: The name of its Lease, once created; the holder it writes there, as a handler's.
        self.lease: str | None = None
        self.holder = f"{name}@{uuid.uuid4().hex[:8]}"
        #: The round this node formed (its result), set by whichever watch saw it first.
        self.formed: asyncio.Future[dict[str, Any]] | None = None
        #: The run watch, kept open after formation to see the round change.
        self.follower: asyncio.Task[float | None] | None = None

    async def rendezvous(self) -> dict[str, Any]:
        """Read the run, join through the Lease, wait for the round on both watches.

        A large run's node learns its place from its own Lease; a seal that
        moves the signal (a node's, or an older operator's under ``--baseline``)
        reaches it on the narrow run watch instead.  Whichever comes first forms
        it.  The run watch stays open afterwards (:attr:`follower`), as a
        handler's does, until the node's round changes (:meth:`_follow_run`).
        """
        s = self.shared
        run = json.loads(await self.requests.request("GET", run_path(s.namespace, s.run)))
        spec, meta = run["spec"], run["metadata"]
        join = WaitingNode(name=self.name, address="127.0.0.1", store_port=self.port,
                           since=now())
        self.lease = lease_name(s.run, self.name)
        body = node_lease(s.run, self.name, self.holder, spec["heartbeatTimeoutSeconds"],
                          meta["uid"], now(), join)  # the handler's body
        created = json.loads(await self.requests.request("POST", leases_path(s.namespace), body))
        signal = (run.get("status") or {}).get("signal", 0)
        formed: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.formed = formed
        self.follower = asyncio.create_task(self._follow_run(signal, meta["resourceVersion"]))
        waits: list[asyncio.Future[Any]] = [formed, self.follower]
        mailbox = None
        if members_told_by_lease(RunSpec.from_dict(spec)):  # as the handler does
            mailbox = asyncio.create_task(
                self._from_lease(join, created["metadata"]["resourceVersion"]))
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

    async def _follow_run(self, signal: int, resource_version: str) -> float | None:
        """The narrow run watch: this node's place in a round, then the round's change.

        Returns when (monotonic) the run first shows that this node's
        ``num_nodes_waiting()`` is positive (:func:`knows_of_change`); None when
        the watch ended first.
        """
        s = self.shared
        query = {"fieldSelector": f"metadata.name={s.run},status.signal!={signal}",
                 "resourceVersion": resource_version}
        assert self.formed is not None
        try:
            async for line in watch_lines(self.watch, runs_path(s.namespace), query):
                event = s.parse(line)
                if event.get("type") not in ("ADDED", "MODIFIED"):
                    continue
                if not self.formed.done():
                    obj = event.get("object") or {}
                    for p in (obj.get("status") or {}).get("participants") or ():
                        if p["name"] == self.name:
                            self.formed.set_result({
                                "t_done": time.monotonic(), "rank": p["rank"],
                                "world": len(obj["status"]["participants"]),
                                "round": obj["status"]["round"]})
                    continue
                if knows_of_change(s.run_of(line), int(self.formed.result()["round"])):
                    return time.monotonic()
            return None
        finally:
            self.watch.close()

    async def _from_lease(self, join: WaitingNode, resource_version: str) -> dict[str, Any]:
        assert self.lease is not None
        query = {"fieldSelector": f"metadata.name={self.lease}",
                 "resourceVersion": resource_version}
        async for line in watch_lines(self.mailbox, leases_path(self.shared.namespace),
                                       query):
            meta = (json.loads(line).get("object") or {}).get("metadata") or {}
            told = read_assignment((meta.get("annotations") or {}).get(ASSIGNMENT_ANNOTATION))
            if told is not None and told.since == join.since:
                return {"t_done": time.monotonic(), "rank": told.rank,
                        "world": told.world_size, "round": told.round}
        raise ConnectionError("the Lease watch ended before a round formed")

    async def renew(self, interval: float) -> None:
        """The handler's renewal: a merge patch of renewTime, every ``interval``."""
        assert self.lease is not None
        path = lease_path(self.shared.namespace, self.lease)
        while True:
            await asyncio.sleep(interval)
            body = {"spec": {"renewTime": format_time(now()),
                             "holderIdentity": self.holder}}
            try:
                await self.requests.request("PATCH", path, body, MERGE_PATCH)
            except (HttpError, OSError, asyncio.IncompleteReadError):
                return  # the run (and its Leases) were deleted: the benchmark is over


def knows_of_change(run: ElasticRun, my_round: int) -> bool:
    """Whether a member of ``my_round`` would now see ``num_nodes_waiting() > 0``."""
    return nodes_waiting(run, my_round, now=now()) > 0


async def _form(node: SimNode, start_at: float, out: asyncio.Queue[dict[str, Any]]
                ) -> bool:
    """Form ``node`` and report it; False when it did not form."""
    await asyncio.sleep(max(0.0, start_at - time.monotonic()))
    result: dict[str, Any] = {"node": node.name, "t_start": time.monotonic()}
    try:
        result.update(await asyncio.wait_for(node.rendezvous(), REQUEST_BOUND * 5))
    except Exception as exc:  # reported to the coordinator
        result.update({"t_done": time.monotonic(), "error": f"{type(exc).__name__}: {exc}"})
    await out.put(result)
    return "error" not in result


async def _follow(node: SimNode, out: asyncio.Queue[dict[str, Any]]) -> None:
    """Report when the formed ``node`` learnt that its round changed (a ``change`` line)."""
    if node.follower is None:
        return
    with contextlib.suppress(HttpError, OSError, asyncio.IncompleteReadError, ValueError):
        seen = await node.follower
        if seen is not None:
            await out.put({"node": node.name, "event": "change", "t": seen})


async def _forward(out: asyncio.Queue[dict[str, Any]]) -> None:
    while True:
        sys.stdout.write(json.dumps(await out.get()) + "\n")
        sys.stdout.flush()


async def main_async(config: dict[str, Any]) -> None:
    shared = shared_from(config["kubeconfig"], config["namespace"], config["run"])
    nodes = [SimNode(shared, name, 20000 + i) for i, name in enumerate(config["nodes"])]
    out: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    forward = asyncio.create_task(_forward(out))
    formed = await asyncio.gather(*(_form(n, float(config["start_at"]), out) for n in nodes))
    shared.parsed.clear()
    followers = [asyncio.create_task(_follow(n, out))
                 for n, ok in zip(nodes, formed, strict=True) if ok]
    renewals = [asyncio.create_task(n.renew(float(config["renew_interval"])))
                for n in nodes if n.lease is not None]
    # Stay live members (renewing, watching the run) until the coordinator closes stdin.
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    for task in [*followers, *renewals, forward]:
        task.cancel()
    for node in nodes:
        if node.follower is not None:
            node.follower.cancel()
        node.requests.close()
        node.watch.close()


def main() -> int:
    config = json.loads(sys.stdin.readline())
    asyncio.run(main_async(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
