#!/usr/bin/env bash
# Builds the node's container runtime from pinned Go modules and prints the
# directory that holds it: containerd, its runc shim and ctr; runc; the CNI
# loopback plugin; and a static `pause` for the sandbox image.  Idempotent: the
# output directory is keyed by the pinned versions and lives outside the
# repository, so a second run (or a second checkout) costs nothing.
#
#   RUNTIME_BIN       use this directory instead of the cache
#   XDG_CACHE_HOME    cache root (default ~/.cache)
#
# runc needs cgo (its nsenter part) and libseccomp: without seccomp, pods that
# ask for the RuntimeDefault profile (the chart's operator does) cannot start.
# Its default build tags name libpathrs, a Rust library Debian does not have,
# so the tags are given explicitly.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
CONTAINERD=v2.4.2
RUNC=v1.5.3
CNI_PLUGINS=v1.10.0
PAUSE_REV=1  # bump when the pause build below changes
OUT="${RUNTIME_BIN:-${XDG_CACHE_HOME:-$HOME/.cache}/elasticrun/runtime/containerd-$CONTAINERD-runc-$RUNC-cni-$CNI_PLUGINS-pause-$PAUSE_REV}"
mkdir -p "$(dirname "$OUT")"
exec 9>"$OUT.lock"
flock 9
WANT=(containerd containerd-shim-runc-v2 ctr runc loopback pause)
have_all() { for b in "${WANT[@]}"; do [[ -x $OUT/$b ]] || return 1; done; }
if have_all; then echo "$OUT"; exit 0; fi
command -v go >/dev/null || { echo "build-runtime.sh: 'go' not found; Go >= 1.26 is needed" >&2; exit 2; }
command -v gcc >/dev/null || { echo "build-runtime.sh: 'gcc' not found (runc needs cgo)" >&2; exit 2; }

if [[ ! -e /usr/include/seccomp.h ]]; then
  echo "build-runtime.sh: installing Debian's libseccomp-dev (runc's seccomp support)" >&2
  if [[ $(id -u) -eq 0 ]]; then SUDO=(); else SUDO=(sudo); fi
  "${SUDO[@]}" apt-get update -qq >&2 || true
  DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y -qq libseccomp-dev >&2
fi

echo "build-runtime.sh: building containerd $CONTAINERD, runc $RUNC, CNI loopback $CNI_PLUGINS into $OUT" >&2
mkdir -p "$OUT.tmp"
export GOBIN="$OUT.tmp" GOTOOLCHAIN=local GOFLAGS="-trimpath -buildvcs=false"
start=$SECONDS
CGO_ENABLED=0 go install -tags urfave_cli_no_docs \
  -ldflags "-s -w -X github.com/containerd/containerd/v2/version.Version=$CONTAINERD" \
  "github.com/containerd/containerd/v2/cmd/containerd@$CONTAINERD" \
  "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2@$CONTAINERD" \
  "github.com/containerd/containerd/v2/cmd/ctr@$CONTAINERD" >&2
CGO_ENABLED=1 go install -tags "seccomp urfave_cli_no_docs" -ldflags "-s -w -X main.version=${RUNC#v}" \
  "github.com/opencontainers/runc@$RUNC" >&2
CGO_ENABLED=0 go install -ldflags "-s -w" \
  "github.com/containernetworking/plugins/plugins/main/loopback@$CNI_PLUGINS" >&2

# The sandbox ("pause") process, from the Kubernetes module's own source, so
# containerd never pulls registry.k8s.io/pause.
K8S_DIR="$(cd "$HERE" && GOFLAGS=-mod=readonly go list -m -f '{{.Dir}}' k8s.io/kubernetes)"
gcc -Os -static -DVERSION="elasticrun" -o "$OUT.tmp/pause" "$K8S_DIR/build/pause/linux/pause.c"
strip "$OUT.tmp/pause"

"$OUT.tmp/containerd" --version >&2
"$OUT.tmp/runc" --version | sed -n 1p >&2  # not head: SIGPIPE under pipefail
echo "build-runtime.sh: built in $((SECONDS - start)) s" >&2
rm -rf "$OUT"
mv "$OUT.tmp" "$OUT"
echo "$OUT"
