#!/usr/bin/env python3
"""A real Kubernetes on 127.0.0.1, for tests, the demo and benchmarks.

Two modes:

- **apiserver** (the envtest set-up): etcd + kube-apiserver only.  Everything
  the API server itself does is real (schema and CEL validation, server-side
  apply, watches, RBAC, TokenRequest, admission, audit); nothing runs a pod.
  Starts in seconds, on free ports, as many at once as you like.
- **node**: a complete single-node cluster: the above plus kube-scheduler,
  kube-controller-manager and a node (containerd, runc, kubelet; see
  :mod:`controlplane.node`), so Jobs, StatefulSets, Deployments, garbage
  collection, evictions and namespace deletion are real.  The API server
  listens on 127.0.0.1:443 and the Service range is 127.0.0.0/24, which makes
  the ``kubernetes`` Service 127.0.0.1:443: in-cluster clients in pods reach the
  API server with their ServiceAccount token and no Service IP ever leads off
  the machine.  One node cluster per machine (fixed ports, one kubelet).

    python -m controlplane.localcluster up   [--dir .cluster] [--mode node|apiserver]
    python -m controlplane.localcluster down [--dir .cluster]

In both modes the API server runs with ``--enable-aggregator-routing``: a
webhook or APIService that names a Service is called at the Service's
endpoints, never at its ClusterIP.

Binaries come from ``tests/controlplane/build.sh`` and ``build-runtime.sh``
(built once, cached outside the repository).  Every process is started in its
own session and stopped by its PID.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import secrets
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from controlplane.node import LocalNode
from controlplane.procs import (
    STOP_TIMEOUT,
    clean_env,
    descendants,
    kill_tree,
    pid_alive,
    processes_naming,
    stop_pid,
)

__all__ = ["STOP_TIMEOUT", "ClusterState", "LocalControlPlane", "clean_env", "descendants",
           "kill_tree", "pid_alive", "reap_orphans", "running", "stop_pid", "wait_usable"]

HERE = Path(__file__).resolve().parent
READY_TIMEOUT = 120.0

AUDIT_POLICY = """\
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
    resources:
      - group: elasticrun.dev
      - group: coordination.k8s.io
        resources: [leases]
  - level: None
"""


#: The node mode's fixed API server port: the ``kubernetes`` Service's port.
NODE_APISERVER_PORT = 443
#: A loopback Service range: every ClusterIP is an address of this machine.
SERVICE_RANGE = "127.0.0.0/24"
APISERVER_ONLY, NODE = "apiserver", "node"
MODES = (APISERVER_ONLY, NODE)


def build_binaries(node: bool = False) -> Path:
    """Path of the cached Kubernetes binaries, building what is missing."""
    wanted = ["kube-apiserver", "etcd"]
    if node:
        wanted += ["kubelet", "kube-scheduler", "kube-controller-manager"]
    explicit = os.environ.get("CONTROLPLANE_BIN")
    if explicit and all((Path(explicit) / b).exists() for b in wanted):
        return Path(explicit)
    out = subprocess.run(["bash", str(HERE / "build.sh"), *(["--node"] if node else [])],
                         check=True, stdout=subprocess.PIPE, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _openssl(cwd: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(d: Path) -> None:
    """A CA, serving certificates for the API server and webhooks, and the SA key."""
    if (d / "sa.key").exists():
        return
    _openssl(d, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
             "ca.crt", "-days", "30", "-subj", "/CN=elasticrun-test-ca", "-addext",
             "keyUsage=critical,keyCertSign,cRLSign")
    for name in ("apiserver", "webhook"):
        (d / f"{name}.ext").write_text(
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n"
            "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
            "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n")
        _openssl(d, "req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
                 f"{name}.csr", "-subj", f"/CN={name}")
        _openssl(d, "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.crt", "-days", "30", "-extfile",
                 f"{name}.ext")
    _openssl(d, "genrsa", "-traditional", "-out", "sa.key", "2048")


@dataclass
class ClusterState:
    """What `up` wrote and `down` needs: ports, PIDs and credentials."""

    dir: str
    etcd_port: int
    etcd_peer_port: int
    apiserver_port: int
    token: str
    etcd_pid: int = 0
    apiserver_pid: int = 0
    scheduler_pid: int = 0
    controller_manager_pid: int = 0
    mode: str = APISERVER_ONLY
    apiserver_args: list[str] = field(default_factory=list)
    #: The process whose lifetime bounds this control plane (a pytest session);
    #: 0 for one that should outlive its starter (``make cluster``).
    owner_pid: int = 0
    #: Add-on controllers (controlplane.addons) by name: their PIDs.
    addon_pids: dict[str, int] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.apiserver_port}"

    @property
    def path(self) -> Path:
        return Path(self.dir)

    @property
    def kubeconfig(self) -> Path:
        return self.path / "kubeconfig"

    @property
    def ca(self) -> Path:
        return self.path / "ca.crt"

    @property
    def audit_log(self) -> Path:
        return self.path / "audit.log"

    def save(self) -> None:
        (self.path / "state.json").write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, d: Path) -> ClusterState | None:
        try:
            return cls(**json.loads((d / "state.json").read_text()))
        except (FileNotFoundError, json.JSONDecodeError, TypeError):
            return None


#: Directory prefixes of the clusters test sessions start (apiserver and node mode).
SESSION_PREFIXES = ("elasticrun-cp-", "elasticrun-node-")


def reap_orphans(parent: Path, prefixes: Sequence[str] = SESSION_PREFIXES) -> list[Path]:
    """Stop clusters whose owning test session died without stopping them.

    A pytest killed by SIGKILL cannot run its teardown, and its etcd,
    kube-apiserver, operators and node agents run in sessions of their own, so
    they would live on.  The next session stops a node first (every process in
    its mount namespace, pods included), then every process that names the
    dead session's directory, clients first, and removes the directory.
    Clusters without an owner (``make cluster``) stay.
    """
    reaped = []
    found = sorted(d for prefix in prefixes for d in parent.glob(f"{prefix}*"))
    for directory in found:
        state = ClusterState.load(directory)
        if state is None or not state.owner_pid or pid_alive(state.owner_pid):
            continue
        if state.mode == NODE:
            LocalNode(directory, state.kubeconfig, Path()).stop()
        servers = {state.apiserver_pid, state.etcd_pid}
        left = processes_naming(Path(state.dir))
        for pid in sorted(left, key=lambda p: p in servers):  # the servers last
            stop_pid(pid)
        shutil.rmtree(directory, ignore_errors=True)
        reaped.append(directory)
    return reaped


class LocalControlPlane:
    """Start, restart and stop one etcd + kube-apiserver pair in a directory."""

    def __init__(self, directory: Path, bin_dir: Path | None = None,
                 extra_apiserver_args: Sequence[str] = (), owner_pid: int = 0,
                 mode: str = APISERVER_ONLY, addons: str = "") -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        self.dir = directory.resolve()
        self.bin_dir = bin_dir
        self.extra_apiserver_args = list(extra_apiserver_args)
        self.owner_pid = owner_pid
        self.mode = mode
        #: ``CLUSTER_ADDONS``' form: "kubeflow" (JobSet + Trainer), "jobset", "kueue",
        #: comma-separated, or "".
        self.addons = addons
        self.state: ClusterState | None = None

    @property
    def node(self) -> LocalNode | None:
        """The node of a node-mode cluster (None in apiserver mode)."""
        if self.mode != NODE:
            return None
        assert self.state and self.bin_dir
        return LocalNode(self.dir, self.state.kubeconfig, self.bin_dir)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> ClusterState:
        existing = ClusterState.load(self.dir)
        if existing and pid_alive(existing.etcd_pid) and pid_alive(existing.apiserver_pid):
            self.state = existing
            self.wait_ready()
            return existing
        if existing:
            self.state = existing
            self.stop()
        self.dir.mkdir(parents=True, exist_ok=True)
        node = self.mode == NODE
        bin_dir = self.bin_dir or build_binaries(node=node)
        self.bin_dir = bin_dir
        if node:
            _require_free(NODE_APISERVER_PORT, "the node mode's API server")
        make_pki(self.dir)
        state = ClusterState(dir=str(self.dir), etcd_port=free_port(),
                             etcd_peer_port=free_port(),
                             apiserver_port=NODE_APISERVER_PORT if node else free_port(),
                             token=secrets.token_hex(16),
                             apiserver_args=self.extra_apiserver_args,
                             owner_pid=self.owner_pid, mode=self.mode)
        (self.dir / "tokens.csv").write_text(f"{state.token},admin,admin-uid,system:masters\n")
        (self.dir / "audit-policy.yaml").write_text(AUDIT_POLICY)
        self.state = state
        self._start_etcd()
        self._start_apiserver()
        state.save()
        self._write_kubeconfig()
        try:
            if node:
                self._start_node()
            if self.addons:
                self._start_addons()
        except BaseException:
            self.stop()
            raise
        return state

    def _start_addons(self) -> None:
        """JobSet / Trainer / Kueue controllers as processes (controlplane.addons), webhooks
        serving."""
        from elasticrun.api.kube import KubeClient, load_credentials

        from controlplane import addons as addons_mod

        assert self.state
        wanted = addons_mod.wanted(self.addons)
        bins = addons_mod.build(wanted)
        helm = Path(subprocess.run(["bash", str(HERE.parent / "helmtool" / "build.sh")],
                                   check=True, stdout=subprocess.PIPE, text=True
                                   ).stdout.strip().splitlines()[-1])
        kubectl_bin = shutil.which("kubectl", path=f"{Path(sys.executable).parent}"
                                                    f"{os.pathsep}{os.environ.get('PATH', '')}")
        if kubectl_bin is None:
            raise RuntimeError("kubectl not found (make setup installs it into .venv/bin)")
        kubeconfig = str(self.state.kubeconfig)

        def kubectl(*args: str, check: bool = True, input: str | None = None) -> None:
            subprocess.run([kubectl_bin, *args], env={**clean_env(), "KUBECONFIG": kubeconfig},
                           input=input, text=True, capture_output=True, check=check,
                           timeout=120)

        client = KubeClient(load_credentials(kubeconfig), timeout=10)
        try:
            for running in addons_mod.start(wanted, self.dir, client, kubectl, helm, bins,
                                             free_port):
                self.state.addon_pids[running.name] = running.pid
                self.state.save()
        finally:
            client.close()

    def _start_node(self) -> None:
        """kube-scheduler, kube-controller-manager and the node, on this API server."""
        assert self.state and self.bin_dir
        s, d, k = self.state, self.dir, str(self.state.kubeconfig)
        common = [f"--kubeconfig={k}", f"--authentication-kubeconfig={k}",
                  f"--authorization-kubeconfig={k}", "--bind-address=127.0.0.1",
                  "--leader-elect=false", "--v=1"]
        s.scheduler_pid = self._popen("kube-scheduler", [
            str(self.bin_dir / "kube-scheduler"), *common, "--secure-port=10259"])
        s.controller_manager_pid = self._popen("kube-controller-manager", [
            str(self.bin_dir / "kube-controller-manager"), *common, "--secure-port=10257",
            f"--service-account-private-key-file={d}/sa.key", f"--root-ca-file={d}/ca.crt",
            "--use-service-account-credentials=true",
            # Its default, /usr/libexec/kubernetes/..., would be created on the machine.
            f"--flex-volume-plugin-dir={d}/node/flexvolume",
            # A Pod on a node that stopped reporting is evicted quickly in tests.
            "--node-monitor-grace-period=20s"])
        s.save()
        from elasticrun.api.kube import KubeClient, load_credentials

        client = KubeClient(load_credentials(str(s.kubeconfig)), timeout=10)
        try:
            node = self.node
            assert node is not None
            node.start(client)
            wait_usable(client)
        finally:
            client.close()

    def _popen(self, name: str, argv: list[str]) -> int:
        log = open(self.dir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=clean_env(),
                                start_new_session=True, cwd=self.dir)
        log.close()
        return proc.pid

    def _start_etcd(self) -> None:
        assert self.state and self.bin_dir
        s = self.state
        s.etcd_pid = self._popen("etcd", [
            str(self.bin_dir / "etcd"), "--name", "default",
            "--data-dir", str(self.dir / "etcd-data"),
            "--listen-client-urls", f"http://127.0.0.1:{s.etcd_port}",
            "--advertise-client-urls", f"http://127.0.0.1:{s.etcd_port}",
            "--listen-peer-urls", f"http://127.0.0.1:{s.etcd_peer_port}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{s.etcd_peer_port}",
            "--initial-cluster", f"default=http://127.0.0.1:{s.etcd_peer_port}",
            "--unsafe-no-fsync", "--log-level", "warn",
        ])
        self._wait("etcd", s.etcd_pid, lambda: _http_ok(f"http://127.0.0.1:{s.etcd_port}/health"))

    def _start_apiserver(self) -> None:
        assert self.state and self.bin_dir
        s, d = self.state, self.dir
        s.apiserver_pid = self._popen("kube-apiserver", [
            str(self.bin_dir / "kube-apiserver"),
            f"--etcd-servers=http://127.0.0.1:{s.etcd_port}",
            "--bind-address=127.0.0.1", f"--secure-port={s.apiserver_port}",
            "--advertise-address=127.0.0.1", "--endpoint-reconciler-type=none",
            f"--tls-cert-file={d}/apiserver.crt", f"--tls-private-key-file={d}/apiserver.key",
            f"--cert-dir={d}/certs", f"--client-ca-file={d}/ca.crt",
            f"--token-auth-file={d}/tokens.csv", "--authorization-mode=RBAC",
            f"--service-cluster-ip-range={SERVICE_RANGE}", "--allow-privileged=true",
            "--enable-aggregator-routing=true",
            # Without a controller manager nobody creates ServiceAccounts, and
            # the admission plugin would refuse every pod.
            *(["--kubelet-preferred-address-types=InternalIP,Hostname"] if s.mode == NODE
              else ["--disable-admission-plugins=ServiceAccount"]),
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={d}/sa.key",
            f"--service-account-signing-key-file={d}/sa.key",
            f"--audit-policy-file={d}/audit-policy.yaml", f"--audit-log-path={d}/audit.log",
            "--audit-log-format=json", "--audit-log-maxsize=200", "--audit-log-maxbackup=1",
            "--profiling=false", "--v=1",
            *s.apiserver_args,
        ])
        self._wait("kube-apiserver", s.apiserver_pid, self.ready)

    def _wait(self, name: str, pid: int, probe: object) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            if not pid_alive(pid):
                raise RuntimeError(f"{name} exited during start-up; log tail:\n"
                                   f"{self.log_tail(name)}")
            if probe():  # type: ignore[operator]
                return
            time.sleep(0.2)
        raise TimeoutError(f"{name} not ready within {READY_TIMEOUT:.0f}s; log tail:\n"
                           f"{self.log_tail(name)}")

    def ready(self) -> bool:
        assert self.state
        return _http_ok(f"{self.state.url}/readyz", token=self.state.token, ca=self.state.ca)

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ready():
                return
            time.sleep(0.2)
        raise TimeoutError("kube-apiserver not ready")

    def stop_apiserver(self) -> None:
        assert self.state
        stop_pid(self.state.apiserver_pid)

    def start_apiserver(self) -> None:
        """Start the API server again on the same port (etcd keeps the data)."""
        self._start_apiserver()
        assert self.state
        self.state.save()

    def stop_etcd(self) -> None:
        assert self.state
        stop_pid(self.state.etcd_pid)

    def start_etcd(self) -> None:
        self._start_etcd()
        assert self.state
        self.state.save()

    def stop(self) -> None:
        """Stop everything this cluster started, the node first, etcd last.

        A node cluster's data goes with it: its objects name a node and pods
        that no longer exist, so the next start begins from an empty etcd.
        """
        state = self.state or ClusterState.load(self.dir)
        if state is None:
            return
        for pid in state.addon_pids.values():
            stop_pid(pid)
        if state.mode == NODE:
            LocalNode(self.dir, state.kubeconfig, Path()).stop()
        for pid in (state.controller_manager_pid, state.scheduler_pid, state.apiserver_pid,
                    state.etcd_pid):
            stop_pid(pid)
        with contextlib.suppress(FileNotFoundError):
            (self.dir / "state.json").unlink()
        if state.mode == NODE:
            shutil.rmtree(self.dir / "etcd-data", ignore_errors=True)
            shutil.rmtree(self.dir / "node", ignore_errors=True)

    def log_tail(self, name: str, lines: int = 30) -> str:
        try:
            text = (self.dir / f"{name}.log").read_text(errors="replace")
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    # ------------------------------------------------------------------ clients

    def _write_kubeconfig(self) -> None:
        assert self.state
        ca = base64.b64encode(self.state.ca.read_bytes()).decode()
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "elasticrun-local",
            "clusters": [{"name": "elasticrun-local", "cluster": {
                "server": self.state.url, "certificate-authority-data": ca}}],
            "users": [{"name": "admin", "user": {"token": self.state.token}}],
            "contexts": [{"name": "elasticrun-local", "context": {
                "cluster": "elasticrun-local", "user": "admin", "namespace": "default"}}],
        }
        self.state.kubeconfig.write_text(json.dumps(config, indent=2))
        self.state.kubeconfig.chmod(0o600)

    def metrics(self) -> str:
        """The API server's Prometheus text (admin only)."""
        assert self.state
        return _http_get(f"{self.state.url}/metrics", token=self.state.token,
                         ca=self.state.ca).decode()


#: What a new user's first commands need beyond a Ready node, each made by a controller
#: some time after the API server is up: a pod in ``default`` is refused until its
#: ServiceAccount exists (ServiceAccount admission), and its token volume is not
#: mounted until the namespace's root-CA ConfigMap exists.
USABLE = (
    ("/api/v1/namespaces/default/serviceaccounts/default",
     "the default ServiceAccount in namespace default (serviceaccount controller)"),
    ("/api/v1/namespaces/default/configmaps/kube-root-ca.crt",
     "the kube-root-ca.crt ConfigMap in namespace default (root-ca-cert-publisher)"),
    ("/api/v1/namespaces/kube-system/serviceaccounts/default",
     "the default ServiceAccount in namespace kube-system"),
)


def wait_usable(client: object, timeout: float = READY_TIMEOUT) -> None:
    """Return once every object of :data:`USABLE` exists; a TimeoutError names the missing."""
    from elasticrun.api.kube import ApiConnectionError, ApiError

    deadline = time.monotonic() + timeout
    missing = list(USABLE)
    while True:
        still = []
        for path, what in missing:
            try:
                client.request("GET", path)  # type: ignore[attr-defined]
            except (ApiError, ApiConnectionError):
                still.append((path, what))
        missing = still
        if not missing:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the cluster is not usable after {timeout:.0f}s: no "
                               + "; no ".join(what for _, what in missing))
        time.sleep(0.2)


def _require_free(port: int, what: str) -> None:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as exc:
            raise RuntimeError(
                f"127.0.0.1:{port} is in use, and {what} needs it: is another node-mode "
                f"cluster running (`make cluster-down` stops the one `make cluster` started)?"
            ) from exc


def _ssl_context(ca: Path | None) -> ssl.SSLContext | None:
    return ssl.create_default_context(cafile=str(ca)) if ca else None


def _http_get(url: str, token: str | None = None, ca: Path | None = None,
              timeout: float = 5.0) -> bytes:
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                         urllib.request.HTTPSHandler(context=_ssl_context(ca)))
    with opener.open(request, timeout=timeout) as response:
        body: bytes = response.read()
        return body


def _http_ok(url: str, token: str | None = None, ca: Path | None = None) -> bool:
    try:
        _http_get(url, token, ca, timeout=2.0)
    except (urllib.error.URLError, OSError, ssl.SSLError):
        return False
    return True


@contextlib.contextmanager
def running(directory: Path, **kwargs: object) -> Iterator[LocalControlPlane]:
    cp = LocalControlPlane(directory, **kwargs)  # type: ignore[arg-type]
    try:
        cp.start()
        yield cp
    finally:
        cp.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["up", "down", "status", "build"])
    parser.add_argument("--dir", type=Path, default=Path(".cluster"),
                        help="state directory (default: .cluster)")
    parser.add_argument("--mode", choices=MODES, default=NODE,
                        help="node: a complete single-node cluster (default); "
                             "apiserver: etcd + kube-apiserver only")
    parser.add_argument("--addons", default=os.environ.get("CLUSTER_ADDONS", ""),
                        help="kubeflow (JobSet + Kubeflow Trainer controllers), jobset, "
                             "kueue, comma-separated; "
                             "default: $CLUSTER_ADDONS, else none")
    args = parser.parse_args(argv)
    cp = LocalControlPlane(args.dir, mode=args.mode, addons=args.addons)
    if args.command == "build":
        print(build_binaries(node=args.mode == NODE))
        return 0
    if args.command == "down":
        state = ClusterState.load(args.dir.resolve())
        cp.stop()
        left = LocalNode(args.dir, Path(), Path()).leftovers() if state and state.mode == NODE \
            else []
        if left:
            print(f"the node in {args.dir} left {', '.join(left)}", file=sys.stderr)
            return 1
        print(f"stopped the cluster in {args.dir}", file=sys.stderr)
        return 0
    if args.command == "status":
        state = ClusterState.load(args.dir.resolve())
        up = bool(state and pid_alive(state.etcd_pid) and pid_alive(state.apiserver_pid))
        print("running" if up else "stopped")
        return 0 if up else 1
    started = time.monotonic()
    state = cp.start()
    what = ("node Ready, default ServiceAccount present" if state.mode == NODE
            else "kube-apiserver ready")
    if state.addon_pids:
        what += ", " + ", ".join(f"{name} (pid {pid})" for name, pid in state.addon_pids.items())
    print(f"{state.mode} cluster at {state.url}: {what} in {time.monotonic() - started:.1f}s "
          f"(etcd pid {state.etcd_pid}, kube-apiserver pid {state.apiserver_pid})",
          file=sys.stderr)
    print(f"export KUBECONFIG={state.kubeconfig}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
