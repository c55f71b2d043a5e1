"""What torchrun's command line means to the ``k8s`` backend.

torchrun hands every backend a ``RendezvousParameters``: ``--rdzv-id``,
``--rdzv-endpoint``, ``--nnodes`` and ``--rdzv-conf key=value`` strings.  This
module turns them, plus the pod's downward-API environment, into one immutable
settings object with every timeout named.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from elasticrun.api.model import MAX_POD_INDEX, RunSpec
from elasticrun.api.naming import is_dns_label
from elasticrun.api.roundfile import ROUND_FILE_VARIABLE

log = logging.getLogger(__name__)

#: Conf keys the backend reads; anything else is logged once and ignored.
CONF_KEYS = (
    "namespace", "node_name", "address", "pod", "pod_uid", "kubeconfig", "context", "create_run",
    "join_timeout", "last_call_timeout", "heartbeat_timeout", "lease_interval",
    "keep_alive_interval", "keep_alive_max_attempt", "api_timeout", "request_timeout",
    "close_timeout", "store_port", "watch_timeout", "pod_index", "in_place", "round_file",
    # injected by torch's launcher (LaunchConfig sets timeout=900); not ours to honour
    "timeout",
)
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


class SettingsError(ValueError):
    """A command-line value the backend cannot use; the message says what to write."""


@dataclass(frozen=True)
class RendezvousSettings:
    run_name: str
    namespace: str
    node_name: str
    address: str
    pod: str | None
    #: The spec used when this node has to create the ElasticRun; an existing
    #: run's own spec always wins.
    requested_spec: RunSpec
    api_server: str | None = None
    kubeconfig: str | None = None
    context: str | None = None
    create_run: bool = True
    #: How long API failures are retried before RendezvousConnectionError.
    api_timeout: float = 30.0
    #: Bound on one API request.
    request_timeout: float = 10.0
    #: Bound on leaving the membership in shutdown() and on set_closed().
    close_timeout: float = 30.0
    #: The server ends each watch after this long; the node re-opens it.
    watch_timeout: int = 300
    #: Port of the TCPStore this node hosts if it becomes rank 0 (0: any free port).
    store_port: int = 0
    #: The Pod's uid (downward API ``POD_UID``): what identifies the member's Pod to
    #: the operator, since a Pod's name can be taken by anyone who may create Pods.
    pod_uid: str | None = None
    #: The Pod's index in its workload (:func:`pod_index`), sent with every join
    #: request: newcomers are ranked by it (``rounds.order_for_ranks``).
    pod_index: int | None = None
    #: In-place mode (``--rdzv-conf in_place=1``, docs/in-place.md): after every round
    #: the node writes its place to :attr:`round_file` for workers using
    #: ``elasticrun.inplace``.
    in_place: bool = False
    #: Where this node's round file is (:func:`round_file`); None outside in-place mode.
    round_file: str | None = None


#: Where a node finds its Pod's index, first match wins: ``--rdzv-conf pod_index``,
#: then these variables.  An Indexed Job (and so a JobSet's or a TrainJob's Jobs)
#: sets ``JOB_COMPLETION_INDEX`` in every container; for a StatefulSet, or to
#: name another index, set ``ELASTICRUN_POD_INDEX`` (e.g. a downward-API
#: ``fieldRef`` of ``metadata.labels['apps.kubernetes.io/pod-index']``).
POD_INDEX_VARIABLES = ("ELASTICRUN_POD_INDEX", "JOB_COMPLETION_INDEX")


def pod_index(conf: dict[str, Any], environ: Mapping[str, str]) -> int | None:
    """The Pod's index, or None: a value that is not a whole number from 0 up
    is ignored with a warning (the node still joins, ranked without an index)."""
    candidates = [("--rdzv-conf pod_index", conf.get("pod_index"))]
    candidates += [(name, environ.get(name)) for name in POD_INDEX_VARIABLES]
    for where, raw in candidates:
        if raw is None or str(raw).strip() == "":
            continue
        text = str(raw).strip()
        if text.isdigit() and int(text) <= MAX_POD_INDEX:
            return int(text)
        log.warning("k8s rendezvous: ignoring %s=%r: a pod index is a whole number from 0 to "
                    "%d", where, text[:40], MAX_POD_INDEX)
        return None
    return None


def round_file(conf: dict[str, Any], environ: Mapping[str, str], run: str, node: str) -> str:
    """``--rdzv-conf round_file``, else ``$ELASTICRUN_ROUND_FILE``, else a file of this run
    and node in the temporary folder (workers inherit the path through the variable)."""
    given = str(conf.get("round_file") or environ.get(ROUND_FILE_VARIABLE) or "").strip()
    if given:
        return given
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", f"{run}.{node}")[:200]
    return os.path.join(tempfile.gettempdir(), f"elasticrun-{safe}.round.json")


def _as_int(conf: dict[str, Any], key: str, default: int | None) -> int | None:
    raw = conf.get(key)
    if raw is None or raw == "":
        return default
    try:
        value = int(str(raw))
    except ValueError:
        raise SettingsError(f"--rdzv-conf {key}={raw!r}: expected a whole number of "
                            "seconds") from None
    if value < 0:
        raise SettingsError(f"--rdzv-conf {key}={raw!r}: must not be negative")
    return value


def _as_bool(conf: dict[str, Any], key: str, default: bool) -> bool:
    raw = conf.get(key)
    if raw is None or raw == "":
        return default
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("1", "true", "t", "yes", "y"):
        return True
    if text in ("0", "false", "f", "no", "n"):
        return False
    raise SettingsError(f"--rdzv-conf {key}={raw!r}: expected true or false")


def _default_namespace(kubeconfig: str | None, context: str | None) -> str:
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    sa_ns = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
    if os.path.exists(sa_ns):
        with open(sa_ns) as f:
            return f.read().strip()
    try:
        from kubernetes import config  # noqa: PLC0415

        contexts, active = config.list_kube_config_contexts(  # type: ignore[no-untyped-call]
            config_file=kubeconfig)
        if context:
            active = next((c for c in contexts if c["name"] == context), active)
        ns = (active or {}).get("context", {}).get("namespace")
        if ns:
            return str(ns)
    except Exception:
        log.debug("no namespace in the kubeconfig", exc_info=True)
    return "default"


#: torchrun's ``HOST:PORT`` (a c10d store's address); HOST a name, an IPv4 or a [IPv6].
_HOST_PORT = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?)"
                        r":[0-9]{1,5}$")
#: ``host:port`` endpoints already reported, so a restarting agent logs each once.
_IGNORED_ENDPOINTS: set[str] = set()


def parse_endpoint(endpoint: str) -> tuple[str | None, str | None, str | None]:
    """``""`` | ``namespace`` | ``namespace/name`` | ``https://apiserver[:port]`` | ``host:port``.

    ``host:port`` is torchrun's own endpoint form, the address of a c10d store;
    the k8s backend has no store to reach, so it is accepted and ignored (the
    namespace then comes from the pod).  Launchers write it whatever the
    backend: a v1 PyTorchJob with ``elasticPolicy.rdzvBackend: k8s`` always
    injects ``PET_RDZV_ENDPOINT=<job>-worker-0:<port>``.
    """
    endpoint = (endpoint or "").strip()
    if not endpoint:
        return None, None, None
    if endpoint.startswith(("https://", "http://")):
        return endpoint.rstrip("/"), None, None
    if _HOST_PORT.match(endpoint):
        if endpoint not in _IGNORED_ENDPOINTS:
            _IGNORED_ENDPOINTS.add(endpoint)
            log.info("k8s rendezvous: ignoring --rdzv-endpoint=%s (a store address; the k8s "
                     "backend rendezvouses through the API server)", endpoint)
        return None, None, None
    parts = endpoint.split("/")
    if len(parts) > 2 or not all(parts) or ":" in parts[0]:
        raise SettingsError(f"--rdzv-endpoint={endpoint!r}: expected NAMESPACE, NAMESPACE/NAME, "
                            "an API server URL (https://host:port) or a store's host:port "
                            "(ignored)")
    return None, parts[0], parts[1] if len(parts) == 2 else None


def _requested_spec(min_nodes: int, max_nodes: int, conf: dict[str, Any]) -> RunSpec:
    """The spec this node asks for; torch's keep-alive keys stand in for the Lease timing."""
    defaults = RunSpec()
    heartbeat = _as_int(conf, "heartbeat_timeout", None)
    keep_alive = _as_int(conf, "keep_alive_interval", None)
    attempts = _as_int(conf, "keep_alive_max_attempt", None)
    lease_interval = _as_int(conf, "lease_interval", keep_alive) or defaults.lease_renew_interval
    if heartbeat is None:
        heartbeat = (lease_interval * attempts if attempts
                     else max(defaults.heartbeat_timeout, lease_interval * 3))
    spec = RunSpec(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        join_timeout=_as_int(conf, "join_timeout", defaults.join_timeout) or 1,
        last_call_timeout=_as_int(conf, "last_call_timeout", defaults.last_call_timeout) or 0,
        heartbeat_timeout=heartbeat,
        lease_renew_interval=lease_interval,
    )
    if spec.lease_renew_interval >= spec.heartbeat_timeout:
        raise SettingsError(f"lease_interval ({spec.lease_renew_interval}s) must be shorter "
                            f"than heartbeat_timeout ({spec.heartbeat_timeout}s)")
    return spec


def from_parameters(run_id: str, endpoint: str, min_nodes: int, max_nodes: int,
                    local_addr: str | None, conf: dict[str, Any]) -> RendezvousSettings:
    unknown = sorted(set(conf) - set(CONF_KEYS))
    if unknown:
        log.warning("k8s rendezvous: ignoring unknown --rdzv-conf keys %s (known: %s)",
                    unknown, ", ".join(k for k in CONF_KEYS if k != "timeout"))
    api_server, ep_namespace, ep_name = parse_endpoint(endpoint)
    run_name = ep_name or run_id
    if ep_name and run_id not in ("", "none", ep_name):
        log.warning("k8s rendezvous: --rdzv-endpoint names run %r, --rdzv-id says %r; using %r",
                    ep_name, run_id, ep_name)
    if not run_name or run_name == "none" or not _DNS_SUBDOMAIN.match(run_name) \
            or len(run_name) > 253:
        raise SettingsError(f"--rdzv-id={run_name!r} is not a valid ElasticRun name: use lower "
                            "case letters, digits and '-', e.g. --rdzv-id=my-run")
    kubeconfig = conf.get("kubeconfig") or None
    context = conf.get("context") or None
    namespace = conf.get("namespace") or ep_namespace or _default_namespace(kubeconfig, context)
    if not is_dns_label(namespace):
        raise SettingsError(f"namespace {namespace!r} is not a valid Kubernetes namespace")
    pod = conf.get("pod") or os.environ.get("POD_NAME") or None
    node_name = conf.get("node_name") or pod or socket.gethostname()
    if not node_name or len(node_name) > 253:
        raise SettingsError(f"node name {node_name!r} must be 1-253 characters; set "
                            "--rdzv-conf node_name=...")
    in_place = _as_bool(conf, "in_place", False)
    address = (conf.get("address") or local_addr or os.environ.get("POD_IP")
               or socket.getfqdn())
    return RendezvousSettings(
        run_name=run_name,
        namespace=namespace,
        node_name=node_name,
        address=address,
        pod=pod,
        pod_uid=(conf.get("pod_uid") or os.environ.get("POD_UID") or None) if pod else None,
        pod_index=pod_index(conf, os.environ),
        requested_spec=_requested_spec(min_nodes, max_nodes, conf),
        api_server=api_server,
        kubeconfig=kubeconfig,
        context=context,
        create_run=_as_bool(conf, "create_run", True),
        api_timeout=float(_as_int(conf, "api_timeout", 30) or 1),
        request_timeout=float(_as_int(conf, "request_timeout", 10) or 1),
        close_timeout=float(_as_int(conf, "close_timeout", 30) or 1),
        watch_timeout=_as_int(conf, "watch_timeout", 300) or 1,
        store_port=_as_int(conf, "store_port", 0) or 0,
        in_place=in_place,
        round_file=round_file(conf, os.environ, run_name, node_name) if in_place else None,
    )
