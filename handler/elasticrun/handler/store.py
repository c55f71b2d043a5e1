"""The data-plane store: a TCPStore hosted by the rank-0 node.

The API server carries membership only.  Every node starts a TCPStore server
before it joins a round and publishes the port in its waiting entry, so
whichever node becomes rank 0 already serves the store when the round is
sealed: nobody waits an extra round trip.  The server binds to the node's own address, not to every
interface: TCPStore has no authentication.
"""

from __future__ import annotations

import datetime as dt
import logging
import socket

import torch.distributed as dist

log = logging.getLogger(__name__)


class StoreHost:
    """This node's TCPStore server for one round.

    torch's workers connect to it as clients for as long as their round runs
    (``use_agent_store``); the handler replaces it when the next round starts.
    """

    def __init__(self, address: str, port: int = 0, timeout: float = 300.0) -> None:
        bind_host = _bind_address(address)
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


def _bind_address(address: str) -> str:
    """The IP to bind for ``address`` (an IP, or a name that resolves to this host)."""
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
    except OSError:
        log.warning("cannot resolve %r; the TCPStore listens on all interfaces", address)
        return "0.0.0.0"


def connect(host: str, port: int, timeout: float) -> dist.Store:
    return dist.TCPStore(host, port, is_master=False, use_libuv=True,
                         timeout=dt.timedelta(seconds=timeout))
