"""The servers each backend needs, started inside the benchmark and stopped by PID.

* ``k8s``: the project's own :class:`LocalControlPlane` (kube-apiserver + etcd,
  audit log on), with elasticrun's CRDs applied (ElasticRun, ElasticRunSlice).
* ``etcd-v2``: Debian's etcd 3.4 (the last line that serves the v2 API, behind
  ``--enable-v2``), on a free loopback port, data in a temporary directory.
* ``c10d`` needs none: one of the nodes hosts the TCPStore, as torch does.

Both etcds keep their data on tmpfs or skip fsync (the control plane's etcd runs
with ``--unsafe-no-fsync``; Debian's 3.4 lacks that flag, so its data dir goes
to ``/dev/shm``), so neither backend is charged for disk flushes the other skips.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from elasticrun.api.kube import KubeClient, load_credentials

from bench.proc import free_port, stop_pid
from controlplane.crds import CrdNotServedError, install_crds, read_manifests
from controlplane.localcluster import LocalControlPlane

ROOT = Path(__file__).resolve().parent.parent
CRD_FILE = ROOT / "deploy" / "crds" / "elasticrun.dev_elasticruns.yaml"
#: The slices a sealed round's places are told in, in the largest runs
#: (:mod:`elasticrun.api.slices`).
SLICE_CRD_FILE = ROOT / "deploy" / "crds" / "elasticrun.dev_elasticrunslices.yaml"
#: The CRDs a control plane of this tree serves, in the order to apply them.
CRD_FILES = (CRD_FILE, SLICE_CRD_FILE)
ETCD_V2_BINARY = os.environ.get("BENCH_ETCD_V2", "/usr/bin/etcd")
READY_BOUND = 60.0


def crd_files(tree: Path) -> tuple[Path, ...]:
    """The CRD files of the source tree ``tree`` (another revision's, extracted), in the
    order to apply them: the ElasticRun's, then the ElasticRunSlice's where ``tree``
    has one (a revision before slices has not)."""
    crds = tree / CRD_FILE.relative_to(ROOT).parent
    slice_file = crds / SLICE_CRD_FILE.name
    return (crds / CRD_FILE.name, *((slice_file,) if slice_file.is_file() else ()))


class SetupError(RuntimeError):
    """A server the benchmark needs is missing or would not start; says how to fix it."""


def _wait(what: str, probe: Any, pid: int, log: Path, bound: float = READY_BOUND) -> None:
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            raise SetupError(f"{what} exited during start-up: {_tail(log)}") from None
        if probe():
            return
        time.sleep(0.1)
    raise SetupError(f"{what} not ready within {bound:.0f}s: {_tail(log)}")


def _tail(log: Path, lines: int = 15) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class EtcdV2Server:
    """Debian's etcd with the v2 API on, for torch's ``etcd-v2`` backend."""

    def __init__(self, log_dir: Path) -> None:
        self.log = log_dir / "etcd-v2.log"
        self.pid = 0
        self.port = 0
        self.data_dir: str | None = None

    @staticmethod
    def version() -> str:
        out = subprocess.run([ETCD_V2_BINARY, "--version"], capture_output=True, text=True,
                             check=True, timeout=10).stdout
        return out.splitlines()[0].split(":", 1)[1].strip()

    def start(self) -> None:
        if not Path(ETCD_V2_BINARY).exists():
            raise SetupError(f"{ETCD_V2_BINARY} not found: torch's etcd-v2 backend needs an etcd "
                             "that serves the v2 API; run `bash bench/setup.sh` (apt-get install "
                             "etcd-server) or set BENCH_ETCD_V2")
        shm = Path("/dev/shm")
        base = str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None
        self.data_dir = tempfile.mkdtemp(prefix="bench-etcd-v2-", dir=base)
        self.port, peer = free_port(), free_port()
        client_url, peer_url = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{peer}"
        with open(self.log, "ab") as log:
            proc = subprocess.Popen(
                [ETCD_V2_BINARY, "--name", "bench", "--data-dir", self.data_dir,
                 "--enable-v2=true", "--listen-client-urls", client_url,
                 "--advertise-client-urls", client_url, "--listen-peer-urls", peer_url,
                 "--initial-advertise-peer-urls", peer_url,
                 "--initial-cluster", f"bench={peer_url}", "--log-level", "warn",
                 "--logger", "zap"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = proc.pid
        _wait("etcd (v2)", self._ready, self.pid, self.log)

    def _ready(self) -> bool:
        try:
            with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
                    f"http://127.0.0.1:{self.port}/v2/keys/", timeout=2) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.pid:
            stop_pid(self.pid)
            self.pid = 0
        if self.data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self.data_dir = None


class ControlPlane:
    """The local kube-apiserver + etcd, with the CRDs served and an admin client."""

    def __init__(self, directory: Path, crd_files: Sequence[Path] = CRD_FILES) -> None:
        self.local = LocalControlPlane(directory)
        self.crd_files = tuple(crd_files)
        self.client: KubeClient | None = None

    def start(self) -> None:
        state = self.local.start()
        self.client = KubeClient(load_credentials(str(state.kubeconfig)), timeout=30)
        try:
            install_crds(self.client, read_manifests(self.crd_files), manager="elasticrun-bench",
                         timeout=READY_BOUND)
        except CrdNotServedError as exc:
            raise SetupError(str(exc)) from None

    @property
    def api(self) -> KubeClient:
        assert self.client is not None
        return self.client

    @property
    def kubeconfig(self) -> str:
        assert self.local.state is not None
        return str(self.local.state.kubeconfig)

    @property
    def audit_log(self) -> Path:
        assert self.local.state is not None
        return Path(self.local.state.audit_log)

    @property
    def pids(self) -> dict[str, int]:
        assert self.local.state is not None
        return {"kube-apiserver": int(self.local.state.apiserver_pid),
                "etcd": int(self.local.state.etcd_pid)}

    def metrics(self) -> str:
        return str(self.local.metrics())

    def versions(self) -> dict[str, str]:
        version = self.api.request("GET", "/version")
        return {"kube-apiserver": str(version.get("gitVersion")),
                "etcd (control plane)": _etcd_version(self.local)}

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
        self.local.stop()


def _etcd_version(local: LocalControlPlane) -> str:
    state = local.state
    if state is None:
        return "?"
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
                f"http://127.0.0.1:{state.etcd_port}/version", timeout=5) as response:
            return str(json.loads(response.read()).get("etcdserver", "?"))
    except (urllib.error.URLError, OSError, ValueError):
        return "?"
