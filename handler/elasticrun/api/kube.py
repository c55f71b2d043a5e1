"""A thin, synchronous Kubernetes REST client for the few calls elasticrun makes.

The official client is used for what it does best, finding credentials
(kubeconfig, exec plugins, in-cluster tokens that rotate).  Requests go through
one urllib3 pool with explicit timeouts and no hidden retries, because the
handler must turn an unreachable API server into ``RendezvousConnectionError``
within its configured bound, and must be able to cut a watch short on shutdown.
"""

from __future__ import annotations

import json
import logging
import os
import ssl
import threading
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode

import urllib3

from elasticrun.api import crd

# What the client raises; re-exported (PEP 484's ``X as X``), so its callers name them here.
from elasticrun.api.errors import ApiConnectionError as ApiConnectionError  # noqa: PLC0414
from elasticrun.api.errors import ApiError as ApiError  # noqa: PLC0414

log = logging.getLogger(__name__)

JSON = "application/json"
MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"
#: Asks for objects as metadata only (``PartialObjectMetadata``): a watch's events then
#: carry name, resourceVersion, labels, annotations and managedFields, never spec or status.
METADATA_ONLY = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"


@dataclass(frozen=True)
class Credentials:
    host: str
    ca_file: str | None
    cert_file: str | None
    key_file: str | None
    verify: bool
    config: Any  # kubernetes.client.Configuration, for token refresh hooks

    def authorization(self) -> str | None:
        """The Authorization header; asks the client, which refreshes rotating tokens."""
        for setting in self.config.auth_settings().values():
            if setting.get("in") == "header" and setting.get("key", "").lower() == \
                    "authorization" and setting.get("value"):
                return str(setting["value"])
        return None


#: Held while the official client loads credentials.  For a certificate given inline
#: (``certificate-authority-data``, ``client-key-data``) its loader writes a file, which it
#: remembers by content for every later load in the process, and it remembers the file's
#: name before it has written the file: another thread loading the same kubeconfig at
#: that moment is handed a file still empty.  Several handlers in one process (the
#: benchmarks' workers) load at once.
_LOADING = threading.Lock()


def load_credentials(kubeconfig: str | None = None, context: str | None = None) -> Credentials:
    """In-cluster credentials inside a pod, else the kubeconfig (``KUBECONFIG`` or ~/.kube)."""
    from kubernetes import client, config  # noqa: PLC0415 - heavy import, done once

    cfg = client.Configuration()
    with _LOADING:
        if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
        else:
            config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=kubeconfig, context=context, client_configuration=cfg)
    return Credentials(host=cfg.host.rstrip("/"), ca_file=cfg.ssl_ca_cert, cert_file=cfg.cert_file,
                       key_file=cfg.key_file, verify=bool(cfg.verify_ssl), config=cfg)


class Watch:
    """One streaming watch request; :meth:`close` may be called from another thread."""

    def __init__(self, response: urllib3.BaseHTTPResponse) -> None:
        self._response = response
        self._closed = threading.Event()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        buffer = b""
        try:
            for chunk in self._response.stream(4096, decode_content=True):
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if line.strip():
                        event: dict[str, Any] = json.loads(line)
                        yield event
        except (urllib3.exceptions.HTTPError, OSError, ValueError) as exc:
            if not self._closed.is_set():
                raise ApiConnectionError(f"watch interrupted: {exc}") from exc
        finally:
            self._closed.set()
            self._response.release_conn()

    def close(self) -> None:
        """Cut the stream short, from any thread; a no-op once it has ended."""
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self._response.shutdown()
        except RuntimeError:
            pass  # already released to the pool: the stream ended by itself
        except (AttributeError, OSError):  # pragma: no cover - urllib3 < 2.3
            self._response.close()


#: Asked before each piece of a request goes onto the socket, in the thread sending it;
#: it raises to stop the request there.  Set by :meth:`KubeClient.request_checked`.
_send_check: ContextVar[Callable[[], None] | None] = ContextVar("elasticrun_send_check",
                                                                default=None)


class _CheckedSend:
    """Mixed into the pool's connections: :data:`_send_check` runs before every ``send``.

    This is the last moment a request can still be held back: the connection is
    taken from the pool (and connected), the headers and the body are built, and
    nothing of the request has left the process before the first ``send``.
    """

    def send(self, data: Any) -> None:
        check = _send_check.get()
        if check is not None:
            check()
        super().send(data)  # type: ignore[misc]


class ResumingContext(ssl.SSLContext):
    """A client's TLS context that offers the server the session of an earlier connection.

    A node opens a new TLS connection for each watch it re-opens and each
    connection its pool adds, and a full handshake costs the API server an
    RSA signature: on this project's control plane 1.3 ms of its CPU, a third
    of all it spends while 2,048 nodes form a round (``make bench-scale``).
    Resumed from a session ticket (TLS 1.3) the handshake costs it about
    0.5 ms and the client half the time.  One context per client, so one
    node's connections share its sessions and nobody else's.  The server
    may refuse a session (a restart, expired ticket keys): the handshake is
    then a full one, as without a session.
    """

    _session: ssl.SSLSession | None = None
    #: Connections that read a response, and those of them that resumed a session.
    handshakes = 0
    resumed = 0

    def wrap_socket(self, sock: Any, *args: Any, **kwargs: Any) -> ssl.SSLSocket:
        if kwargs.get("session") is None and self._session is not None:
            kwargs["session"] = self._session
        return super().wrap_socket(sock, *args, **kwargs)

    def remember(self, sock: ssl.SSLSocket) -> None:
        """Keep ``sock``'s session for the next connection, once it carries a ticket (the
        server sends it after the handshake: it is there once a response was read)."""
        self.handshakes += 1
        self.resumed += bool(sock.session_reused)
        session = sock.session
        if session is not None and session.has_ticket:
            self._session = session


def tls_context(credentials: Credentials) -> ResumingContext:
    """The TLS context of one client: the cluster's CA and the client's certificate, loaded
    once (rather than for every connection), and its sessions resumed."""
    context = ResumingContext(ssl.PROTOCOL_TLS_CLIENT)
    if credentials.verify:
        if credentials.ca_file:
            context.load_verify_locations(credentials.ca_file)
        else:
            context.load_default_certs()
    else:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if credentials.cert_file:
        context.load_cert_chain(credentials.cert_file, credentials.key_file)
    return context


class _CheckedHTTPConnection(_CheckedSend, urllib3.connection.HTTPConnection):
    pass


class _CheckedHTTPSConnection(_CheckedSend, urllib3.connection.HTTPSConnection):
    #: Whether this connection's session was handed to its context (:class:`ResumingContext`).
    _remembered = False

    def getresponse(self) -> Any:
        response = super().getresponse()
        if not self._remembered:
            # A response was read: the session ticket came before it.
            sock = self.sock
            if isinstance(sock, ssl.SSLSocket) and isinstance(sock.context, ResumingContext):
                sock.context.remember(sock)
            self._remembered = True
        return response

    def connect(self) -> None:
        super().connect()
        self._remembered = False


class _CheckedHTTPPool(urllib3.HTTPConnectionPool):
    ConnectionCls = _CheckedHTTPConnection


class _CheckedHTTPSPool(urllib3.HTTPSConnectionPool):
    ConnectionCls = _CheckedHTTPSConnection


#: Who is calling, in the API server's audit log and metrics: the handler in the
#: pods, or the operator (:data:`OPERATOR_USER_AGENT`).
USER_AGENT = "elasticrun/0.1"
OPERATOR_USER_AGENT = "elasticrun-operator/0.1"


class KubeClient:
    """JSON in, JSON out; every request bounded by ``timeout`` seconds."""

    def __init__(self, credentials: Credentials, timeout: float = 10.0,
                 user_agent: str = USER_AGENT, connections: int = 8) -> None:
        self.credentials = credentials
        self.timeout = timeout
        self.user_agent = user_agent
        self.tls = tls_context(credentials)
        self._pool = urllib3.PoolManager(
            num_pools=4,
            maxsize=connections,
            cert_reqs="CERT_REQUIRED" if credentials.verify else "CERT_NONE",
            ssl_context=self.tls,
            retries=False,
        )
        self._pool.pool_classes_by_scheme = {"http": _CheckedHTTPPool,
                                             "https": _CheckedHTTPSPool}

    @classmethod
    def from_config(cls, kubeconfig: str | None = None, context: str | None = None,
                    timeout: float = 10.0, user_agent: str = USER_AGENT,
                    connections: int = 8) -> KubeClient:
        return cls(load_credentials(kubeconfig, context), timeout, user_agent, connections)

    def _headers(self, content_type: str | None, accept: str = JSON) -> dict[str, str]:
        headers = {"Accept": accept, "User-Agent": self.user_agent}
        if content_type:
            headers["Content-Type"] = content_type
        auth = self.credentials.authorization()
        if auth:
            headers["Authorization"] = auth
        return headers

    def _url(self, path: str, query: Mapping[str, Any] | None) -> str:
        url = self.credentials.host + path
        if query:
            url += "?" + urlencode({k: v for k, v in query.items() if v is not None})
        return url

    def request(self, method: str, path: str, *, body: Any = None,
                query: Mapping[str, Any] | None = None, content_type: str = JSON,
                timeout: float | None = None) -> dict[str, Any]:
        return self._send(method, path, body, query, content_type, timeout)

    def _send(self, method: str, path: str, body: Any, query: Mapping[str, Any] | None,
              content_type: str, timeout: float | None) -> dict[str, Any]:
        payload = None if body is None else json.dumps(body).encode()
        bound = timeout if timeout is not None else self.timeout
        try:
            response = self._pool.request(
                method, self._url(path, query), body=payload,
                headers=self._headers(content_type if payload is not None else None),
                timeout=urllib3.Timeout(connect=min(bound, 5.0), read=bound),
                preload_content=True)
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise ApiConnectionError(f"{method} {self.credentials.host}{path}: {exc}") from exc
        data = response.data
        try:
            decoded: dict[str, Any] = json.loads(data) if data else {}
        except ValueError:
            decoded = {"message": data.decode(errors="replace")[:500]}
        if response.status >= 400:
            raise ApiError(response.status, str(decoded.get("reason", response.reason)),
                           str(decoded.get("message", data[:500])), decoded)
        return decoded

    def request_checked(self, check: Callable[[], None], method: str, path: str, *,
                        body: Any = None, query: Mapping[str, Any] | None = None,
                        content_type: str = JSON, timeout: float | None = None
                        ) -> dict[str, Any]:
        """:meth:`request`, with ``check()`` asked as each piece of it is sent.

        A check made before :meth:`request` leaves a window: a process frozen
        (SIGSTOP, a paused VM) between the check and the send sends the request
        when it resumes, whatever the check would say then.  Here the check runs
        after every step that can block, just before the bytes go out; when it
        raises, the connection is closed and that exception propagates.
        """
        token = _send_check.set(check)
        try:
            return self._send(method, path, body, query, content_type, timeout)
        finally:
            _send_check.reset(token)

    def watch(self, path: str, query: Mapping[str, Any], timeout_seconds: int,
              accept: str = JSON) -> Watch:
        """Open a watch; the server ends it after ``timeout_seconds``.  ``accept``:
        :data:`METADATA_ONLY` for events that carry the objects' metadata only."""
        params = {**query, "watch": "true", "timeoutSeconds": timeout_seconds,
                  "allowWatchBookmarks": "true"}
        try:
            response = self._pool.request(
                "GET", self._url(path, params), headers=self._headers(None, accept),
                timeout=urllib3.Timeout(connect=min(self.timeout, 5.0),
                                        read=timeout_seconds + self.timeout),
                preload_content=False)
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise ApiConnectionError(f"watch {self.credentials.host}{path}: {exc}") from exc
        if response.status >= 400:
            data = response.read()
            response.release_conn()
            try:
                decoded = json.loads(data)
            except ValueError:
                decoded = {"message": data.decode(errors="replace")}
            raise ApiError(response.status, str(decoded.get("reason", response.reason)),
                           str(decoded.get("message", "")), decoded)
        return Watch(response)

    def close(self) -> None:
        self._pool.clear()


# --------------------------------------------------------------------------- paths


def runs_path(namespace: str) -> str:
    return f"/apis/{crd.GROUP}/{crd.VERSION}/namespaces/{quote(namespace)}/{crd.PLURAL}"


def run_path(namespace: str, name: str, subresource: str = "") -> str:
    path = f"{runs_path(namespace)}/{quote(name)}"
    return f"{path}/{subresource}" if subresource else path


def leases_path(namespace: str) -> str:
    return f"/apis/coordination.k8s.io/v1/namespaces/{quote(namespace)}/leases"


def lease_path(namespace: str, name: str) -> str:
    return f"{leases_path(namespace)}/{quote(name)}"


def events_path(namespace: str) -> str:
    return f"/api/v1/namespaces/{quote(namespace)}/events"


def delete_preconditions(uid: str) -> dict[str, Any]:
    """The body of a DELETE of the object with this uid only: any other object of the same
    name (one made after it) is left, and the server answers 409."""
    return {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"uid": uid}}
