"""One real node: containerd, runc and kubelet, confined to a private mount namespace.

kubelet and containerd mount and write at hard-coded host paths, and kubelet
sets kernel tunables when it starts.  Here both run inside ``node-ns.sh``'s
mount namespace, where ``/run``, ``/var/lib`` and ``/var/log`` are directories
of the node's own, and the tunables kubelet checks (``protectKernelDefaults``)
read as it expects from read-only copies; the machine's values never change.
Stopping the node stops every process in that namespace by PID, after which
the namespace and all of its mounts are gone.

Every pod uses ``hostNetwork``: there is no CNI beyond loopback.  The Node's
address is 127.0.0.1, so a pod's ``status.podIP`` (and the ``POD_IP`` a
rendezvous binds its TCPStore to) stays on loopback.  kubelet refuses
``--node-ip`` on loopback, so it runs with ``--cloud-provider=external`` and
this module does the one thing a cloud controller would: it sets the Node's
addresses and removes the "uninitialized" taint.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from controlplane.image import IMAGE, write_image
from controlplane.procs import clean_env, kill_tree, pid_alive, processes_naming, stop_pid

HERE = Path(__file__).resolve().parent
PROJECT = HERE.parent.parent
NODE_NAME = "elasticrun-node"
NODE_IP = "127.0.0.1"
READY_TIMEOUT = 120.0
UNINITIALIZED_TAINT = "node.cloudprovider.kubernetes.io/uninitialized"
#: The kernel tunables kubelet would set; their host values must never change.
TUNABLES = ("vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops")
#: Host paths where kubelet, containerd, CNI or the controller manager write by
#: default; the node confines all of them, and a stopped node leaves none.
HOST_PATHS = ("/var/lib/kubelet", "/var/lib/containerd", "/var/lib/cni", "/var/log/pods",
              "/var/log/containers", "/run/containerd", "/run/netns", "/run/mount",
              "/opt/containerd", "/opt/elasticrun", "/etc/cni", "/usr/libexec/kubernetes")
#: Where kubelet's cgroupfs driver puts pods, in every cgroup v1 hierarchy.
CGROUP_ROOT = Path("/sys/fs/cgroup")

CONTAINERD_CONFIG = """\
version = 3
root = "{d}/containerd/root"
state = "{d}/containerd/state"
temp = "{d}/containerd/tmp"

[grpc]
  address = "{d}/containerd.sock"
[ttrpc]
  address = "{d}/containerd.sock.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""

[plugins.'io.containerd.internal.v1.opt']
  path = "{d}/containerd/opt"
[plugins.'io.containerd.nri.v1.nri']
  disable = true
[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  disable_tcp_service = true
[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{image}"
[plugins.'io.containerd.cri.v1.runtime']
  enable_cdi = false
  # No CAP_SYS_RESOURCE on our machines: never ask runc to lower oom_score_adj.
  restrict_oom_score_adj = true
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["{runtime}"]
    conf_dir = "{d}/cni"
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = "{runtime}/runc"
        SystemdCgroup = false
        Root = "{d}/containerd/runc"
"""

KUBELET_CONFIG = """\
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# cgroup v1 is what our machines have (kubelet 1.37 still supports it when told).
failCgroupV1: false
cgroupDriver: cgroupfs
# Read the kernel tunables, never write them (node-ns.sh shows expected values).
protectKernelDefaults: true
failSwapOn: false
address: 127.0.0.1
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
authentication:
  anonymous: {{enabled: true}}
  webhook: {{enabled: false}}
authorization:
  mode: AlwaysAllow
containerRuntimeEndpoint: unix://{d}/containerd.sock
podLogsDir: {d}/host/var/log/pods
volumePluginDir: {d}/kubelet/volume-plugins
registerNode: true
resolvConf: /etc/resolv.conf
# The one local image is pinned; nothing is ever pulled or garbage-collected.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard:
  memory.available: "100Mi"
  nodefs.available: "1%"
  imagefs.available: "1%"
  nodefs.inodesFree: "1%"
# Pods are deleted within seconds in tests; the node reports status promptly.
nodeStatusUpdateFrequency: 4s
syncFrequency: 10s
"""

CNI_CONFIG = '{"cniVersion":"1.0.0","name":"lo","plugins":[{"type":"loopback"}]}\n'


def build_runtime() -> Path:
    """The cached containerd/runc/CNI/pause directory, building it if needed."""
    explicit = os.environ.get("RUNTIME_BIN")
    if explicit and (Path(explicit) / "containerd").exists():
        return Path(explicit)
    out = subprocess.run(["bash", str(HERE / "build-runtime.sh")], check=True,
                         stdout=subprocess.PIPE, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def read_tunables() -> dict[str, str]:
    """The machine's current values of the tunables kubelet cares about."""
    values = {}
    for key in TUNABLES:
        with contextlib.suppress(OSError):
            values[key] = Path("/proc/sys", key).read_text().strip()
    return values


def _mount_ns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None


def _in_namespace(ns: str) -> list[int]:
    """Every process whose mount namespace is ``ns``."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and _mount_ns(int(proc.name)) == ns:
            found.append(int(proc.name))
    return found


def _read_pid(path: Path) -> int:
    try:
        return int(path.read_text().strip() or 0)
    except (OSError, ValueError):
        return 0


class LocalNode:
    """Start and stop the node of one local cluster, in ``<cluster dir>/node``."""

    def __init__(self, cluster_dir: Path, kubeconfig: Path, k8s_bin: Path,
                 runtime_bin: Path | None = None) -> None:
        self.dir = cluster_dir.resolve() / "node"
        self.kubeconfig = kubeconfig
        self.k8s_bin = k8s_bin
        self.runtime_bin = runtime_bin

    # ------------------------------------------------------------------ start

    def start(self, client: Any) -> None:
        """Start containerd + kubelet and wait until the Node is Ready.

        ``client`` is the admin KubeClient; it initializes the Node (addresses,
        taint) the way a cloud controller would.
        """
        self.runtime_bin = self.runtime_bin or build_runtime()
        self._write_files()
        log = open(self.dir / "node-ns.log", "ab")  # noqa: SIM115 - owned by the child
        proc = subprocess.Popen(
            ["unshare", "-m", "--propagation", "private", "bash", str(HERE / "node-ns.sh"),
             str(self.dir)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=clean_env(),
            start_new_session=True, cwd=self.dir)
        log.close()
        (self.dir / "ns.pid").write_text(str(proc.pid))
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the node exited during start-up:\n{self.log_tail()}")
            if self._initialize(client) and self._ready(client):
                return
            time.sleep(0.2)
        raise TimeoutError(f"node {NODE_NAME} not Ready within {READY_TIMEOUT:.0f}s:\n"
                           f"{self.log_tail()}")

    def _write_files(self) -> None:
        assert self.runtime_bin
        d = self.dir
        for sub in ("cni", "kubelet/pki", "containerd", "volumes"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        (d / "containerd.toml").write_text(
            CONTAINERD_CONFIG.format(d=d, image=IMAGE, runtime=self.runtime_bin))
        (d / "kubelet.yaml").write_text(KUBELET_CONFIG.format(d=d))
        (d / "cni" / "10-loopback.conflist").write_text(CNI_CONFIG)
        python_prefix = Path(sys.base_prefix).resolve()
        write_image(d / "image.tar", self.runtime_bin / "pause", python_prefix, PROJECT)
        env = {
            "RUNTIME_BIN": self.runtime_bin, "K8S_BIN": self.k8s_bin,
            "KUBECONFIG_FILE": self.kubeconfig, "NODE_NAME": NODE_NAME,
            "ELASTICRUN_PYTHON": python_prefix, "ELASTICRUN_PROJECT": PROJECT,
        }
        (d / "env").write_text("".join(f"{k}={shlex.quote(str(v))}\n" for k, v in env.items()))

    def _initialize(self, client: Any) -> bool:
        """Set the Node's address and lift the cloud taint, as a cloud controller would."""
        from elasticrun.api.kube import ApiError

        path = f"/api/v1/nodes/{NODE_NAME}"
        try:
            node = client.request("GET", path)
        except ApiError:
            return False  # not registered yet
        addresses = [{"type": "InternalIP", "address": NODE_IP},
                     {"type": "Hostname", "address": NODE_NAME}]
        if (node.get("status") or {}).get("addresses") != addresses:
            client.request("PATCH", f"{path}/status",
                           body={"status": {"addresses": addresses}},
                           content_type="application/merge-patch+json")
        taints = (node.get("spec") or {}).get("taints") or []
        kept = [t for t in taints if t.get("key") != UNINITIALIZED_TAINT]
        if kept != taints:
            client.request("PATCH", path, body={"spec": {"taints": kept or None}},
                           content_type="application/merge-patch+json")
        return True

    @staticmethod
    def _ready(client: Any) -> bool:
        node = client.request("GET", f"/api/v1/nodes/{NODE_NAME}")
        status = node.get("status") or {}
        ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                    for c in status.get("conditions") or [])
        tainted = any(t.get("key") == UNINITIALIZED_TAINT
                      for t in (node.get("spec") or {}).get("taints") or [])
        return ready and not tainted and bool(status.get("addresses"))

    # ------------------------------------------------------------------ stop

    def stop(self) -> None:
        """Stop kubelet, every pod, the shims and containerd; leave nothing behind.

        The order matters: kubelet first (it would restart what we stop), then
        the pods' process trees under their shims, then containerd.  Anything
        still in the node's mount namespace after that is stopped too, so the
        namespace, and every mount in it, is gone when this returns.
        """
        holder = _read_pid(self.dir / "ns.pid")
        ns = _mount_ns(holder) if pid_alive(holder) else None
        stop_pid(_read_pid(self.dir / "kubelet.pid"), timeout=10)
        for shim in self._shims():
            kill_tree(shim, signal.SIGKILL)
        stop_pid(_read_pid(self.dir / "containerd.pid"), timeout=10)
        if ns:
            for pid in _in_namespace(ns):
                kill_tree(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while _in_namespace(ns) and time.monotonic() < deadline:
                time.sleep(0.05)
        stop_pid(holder)
        self._remove_pod_cgroups()

    def _shims(self) -> list[int]:
        needle = f"{self.dir}/containerd.sock".encode()
        found = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                cmdline = (proc / "cmdline").read_bytes()
                if b"containerd-shim" in cmdline and needle in cmdline:
                    found.append(int(proc.name))
        return found

    @staticmethod
    def _remove_pod_cgroups(timeout: float = 10) -> None:
        """kubelet's pod cgroups outlive it: remove them, deepest first.

        A killed process leaves its cgroup only once it is reaped, so a
        cgroup may still be busy for a moment after the node's processes die.
        """
        deadline = time.monotonic() + timeout
        while True:
            for hierarchy in CGROUP_ROOT.glob("*/kubepods"):
                for d in sorted(hierarchy.rglob("*"), key=lambda p: len(p.parts), reverse=True):
                    if d.is_dir():
                        with contextlib.suppress(OSError):
                            d.rmdir()
                with contextlib.suppress(OSError):
                    hierarchy.rmdir()
            if not any(CGROUP_ROOT.glob("*/kubepods")) or time.monotonic() > deadline:
                return
            time.sleep(0.1)

    # ------------------------------------------------------------------ inspection

    def running(self) -> bool:
        return pid_alive(_read_pid(self.dir / "kubelet.pid"))

    def leftovers(self) -> list[str]:
        """What a stopped node must not leave: processes, mounts, pod cgroups."""
        found = [f"process {pid}" for pid in processes_naming(self.dir)]
        mounts = Path("/proc/self/mounts").read_text()
        found += [f"mount {line.split()[1]}" for line in mounts.splitlines()
                  if str(self.dir) in line]
        found += [f"cgroup {p}" for p in CGROUP_ROOT.glob("*/kubepods")]
        return found


    def log_tail(self, lines: int = 20) -> str:
        parts = []
        for name in ("node-ns", "containerd", "image-import", "kubelet"):
            try:
                text = (self.dir / f"{name}.log").read_text(errors="replace")
            except FileNotFoundError:
                continue
            parts.append(f"--- {name}.log\n" + "\n".join(text.splitlines()[-lines:]))
        return "\n".join(parts)


def host_paths() -> set[str]:
    """Which of the default host paths of kubelet and friends exist now."""
    return {p for p in HOST_PATHS if Path(p).exists()}
