"""The data-plane store: a TCPStore hosted by the rank-0 node.

The API server carries membership only.  Every node starts a TCPStore server
before it joins a round and publishes the port in its waiting entry, so
whichever node becomes rank 0 already serves the store when the round is
sealed: nobody waits an extra round trip.  The first round's server is started
with the handler, as torch's c10d handler connects to its store when it is
made: a TCPStore's own client resolves its peer's name (``getnameinfo()``, a
reverse DNS query), and where a resolver drops a burst of them the first round
of every node would wait out its timeout.  The server binds to the node's own
address, not to every interface: TCPStore has no authentication.
"""

from __future__ import annotations

import datetime as dt
import logging
import socket

import torch.distributed as dist

log = logging.getLogger(__name__)

#: How long a store operation waits for a key another node has not written yet.
#: torch's agent has every non-zero rank ``get`` the worker ranks that rank 0
#: writes only once *every* agent of the round has reached the store, so a
#: client waits on the slowest agent, not on the server.
OPERATION_TIMEOUT = 300.0


class StoreAddressError(OSError):
    """The node's address names no interface of its own to serve the TCPStore on."""


class StoreHost:
    """This node's TCPStore server for one round.

    torch's workers connect to it as clients for as long as their round runs
    (``use_agent_store``); the handler replaces it when the next round starts.
    """

    def __init__(self, address: str, port: int = 0, timeout: float = OPERATION_TIMEOUT) -> None:
        bind_host = bind_address(address)
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((bind_host, port))
        self._socket.listen(1024)
        self.address = address
        self.port: int = self._socket.getsockname()[1]
        self.store = dist.TCPStore(
            address, self.port, is_master=True, wait_for_workers=False, multi_tenant=True,
            master_listen_fd=self._socket.fileno(), use_libuv=True,
            timeout=dt.timedelta(seconds=timeout))
        # The server owns the listening descriptor from here on and closes it
        # when it is destroyed.
        self._socket.detach()
        log.debug("TCPStore server on %s:%d", bind_host, self.port)

    def close(self) -> None:
        """Stop serving: dropping the server closes its socket (idempotent)."""
        self.__dict__.pop("store", None)


class RoundStores:
    """The store this node serves for the round it may lead, and its client to a leader's.

    torchrun's workers share the agent's store and key their process group by
    restart count only (``/worker/attempt_N``).  A node restarted because a
    peer was lost keeps its count while a node whose workers failed bumps it,
    so a store that outlives a round hands new workers the addresses of dead
    ones (pytorch/pytorch#135712).  A fresh server per round starts every
    worker group from an empty store; the previous one is kept until the next
    round so nothing still holding it breaks mid-call.
    """

    def __init__(self) -> None:
        self.host: StoreHost | None = None
        self._retired: StoreHost | None = None
        self._clients: dict[tuple[str, int], dist.Store] = {}
        #: Whether a round has been given ``host`` (its port was published in a join).
        self._used = False

    @property
    def port(self) -> int | None:
        """The port this node's server listens on (published in its join request)."""
        return self.host.port if self.host is not None else None

    def fresh(self, address: str, pinned_port: int = 0) -> None:
        """Start a new server for the next round, retiring the current one."""
        old, self.host = self.host, None
        if old is not None and pinned_port:
            old.close()  # a pinned port can serve one store at a time
            old = None
        if self._retired is not None:
            self._retired.close()
        self._retired = old
        self.host = StoreHost(address, pinned_port)
        self._clients.clear()
        self._used = False

    def for_round(self, address: str, pinned_port: int = 0) -> None:
        """The server of the round a node is about to join: the one started ahead
        while no round has used it, else a fresh one."""
        if self.host is None or self._used:
            self.fresh(address, pinned_port)
        self._used = True

    def store_for(self, rank: int, host: str, port: int, timeout: float) -> dist.Store:
        """Our own server if we lead the round on it, else a client of the leader's.

        ``timeout`` bounds the connection only (:func:`connect`).  Raises
        RuntimeError or OSError when the leader's store cannot be reached.
        """
        assert self.host is not None
        if rank == 0 and port == self.host.port:
            return self.host.store
        client = self._clients.get((host, port))
        if client is None:
            client = connect(host, port, timeout)
            self._clients = {(host, port): client}
        return client

    def close(self) -> None:
        for host in (self._retired, self.host):
            if host is not None:
                host.close()
        self._retired = self.host = None


def bind_address(address: str) -> str:
    """The IP to bind for ``address`` (an IP, or a name that resolves to this host).

    Raises StoreAddressError when ``address`` does not resolve.
    """
    try:
        socket.inet_pton(socket.AF_INET, address)
        return address
    except OSError:
        pass
    try:
        socket.inet_pton(socket.AF_INET6, address)
        return address
    except OSError:
        pass
    try:
        return socket.gethostbyname(address)
    except OSError as exc:
        # Listening on every interface instead would expose the unauthenticated
        # store wherever the pod is reachable.
        raise StoreAddressError(
            f"cannot serve the TCPStore: the node's address {address!r} does not resolve "
            f"({exc}), and the store listens only on the node's own address, never on all "
            "interfaces. Set the address: torchrun --rdzv-conf address=<pod IP>, or the "
            "POD_IP environment variable (fieldRef status.podIP)") from exc


def connect(host: str, port: int, timeout: float) -> dist.Store:
    """A client of the store at ``host:port``, given ``timeout`` seconds to connect.

    A TCPStore keeps the timeout it was made with for every later ``get`` and
    ``wait``; the short one that bounds a connection attempt would fail the
    agent that waits for a slower peer, so the client waits
    :data:`OPERATION_TIMEOUT` once it is connected.
    """
    client = dist.TCPStore(host, port, is_master=False, use_libuv=True,
                           timeout=dt.timedelta(seconds=timeout))
    client.set_timeout(dt.timedelta(seconds=OPERATION_TIMEOUT))
    return client
