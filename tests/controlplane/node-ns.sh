#!/usr/bin/env bash
# The node's private mount namespace: containerd and kubelet live here, so that
# nothing they mount or write lands on the machine, and kubelet reads the kernel
# tunables it expects without ever changing the machine's own.
#
#   setsid unshare -m --propagation private node-ns.sh NODE_DIR
#
# NODE_DIR/env (written by node.py) names the binaries, the kubeconfig and the
# host paths pods may mount.  This script is the namespace's first process: it
# records its PID, starts containerd, imports the local images, starts kubelet
# and waits; node.py stops kubelet, the pods, the shims and containerd by PID,
# after which this process exits and the namespace, with every mount in it, is
# gone.
set -euo pipefail
D=$1
# shellcheck source=/dev/null
source "$D/env"
echo $$ > "$D/ns.pid"

# kubelet runs with protectKernelDefaults: it only reads these and refuses to
# start on a mismatch.  Read-only copies with the values it expects hide the
# machine's own, in this namespace only.
mkdir -p "$D/sysctl"
for entry in vm/overcommit_memory=1 vm/panic_on_oom=0 kernel/panic=10 kernel/panic_on_oops=1 \
             kernel/keys/root_maxkeys=1000000 kernel/keys/root_maxbytes=25000000; do
  key=${entry%%=*} value=${entry#*=}
  [[ -e /proc/sys/$key ]] || continue
  copy="$D/sysctl/${key//\//.}"
  echo "$value" > "$copy"
  mount -n --bind "$copy" "/proc/sys/$key"
  mount -n -o remount,bind,ro "/proc/sys/$key"
done

# Hard-coded host paths of kubelet, containerd and CNI (/var/lib/kubelet,
# /var/lib/cni, /run/containerd, /run/netns, /var/log/pods, ...) land in NODE_DIR.
for path in run var/lib var/log; do
  mkdir -p "$D/host/$path"
  mount -n --bind "$D/host/$path" "/$path"
done

# /opt/elasticrun: the interpreter and the checkout pods run from (read-only),
# at paths that are the same on every machine; the local image links the
# machine's own paths there (see image.py).
mount -n -t tmpfs -o mode=0755,size=1m tmpfs /opt
for name in python project; do
  src_var="ELASTICRUN_${name^^}"
  mkdir -p "/opt/elasticrun/$name"
  mount -n --bind "${!src_var}" "/opt/elasticrun/$name"
  mount -n -o remount,bind,ro "/opt/elasticrun/$name"
done

export PATH="$RUNTIME_BIN:/usr/sbin:/usr/bin:/sbin:/bin"
"$RUNTIME_BIN/containerd" --config "$D/containerd.toml" > "$D/containerd.log" 2>&1 &
echo $! > "$D/containerd.pid"
for _ in $(seq 200); do [[ -S $D/containerd.sock ]] && break; sleep 0.05; done
[[ -S $D/containerd.sock ]] || { echo "containerd did not start; see $D/containerd.log" >&2; exit 1; }
# cAdvisor looks for containerd at the default socket.
mkdir -p /run/containerd && ln -sf "$D/containerd.sock" /run/containerd/containerd.sock
"$RUNTIME_BIN/ctr" --address "$D/containerd.sock" -n k8s.io images import \
  --platform linux/amd64 "$D/image.tar" > "$D/image-import.log" 2>&1

"$K8S_BIN/kubelet" --config "$D/kubelet.yaml" --kubeconfig "$KUBECONFIG_FILE" \
  --root-dir "$D/kubelet" --cert-dir "$D/kubelet/pki" --hostname-override "$NODE_NAME" \
  --cloud-provider external --v 1 > "$D/kubelet.log" 2>&1 &
echo $! > "$D/kubelet.pid"
wait
