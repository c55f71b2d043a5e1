#!/usr/bin/env bash
# Builds kube-apiserver and etcd from the pinned Go modules and prints the
# directory that holds them; with --node also kubelet, kube-scheduler and
# kube-controller-manager (the full single-node cluster).  Idempotent: the
# output directory is keyed by the Kubernetes version and the go.sum hash and
# lives outside the repository, so a second run (or a second checkout) costs
# nothing, and --node later adds only the binaries that are missing.
#
#   build.sh [--node]
#   CONTROLPLANE_BIN   use this directory instead of the cache
#   XDG_CACHE_HOME     cache root (default ~/.cache)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
V="$(sed -nE 's#^(require)?[[:space:]]*k8s\.io/kubernetes (v[0-9.]+)([[:space:]].*)?$#\2#p' "$HERE/go.mod" | head -n1)"
[[ -n $V ]] || { echo "build.sh: cannot read the k8s.io/kubernetes version from $HERE/go.mod" >&2; exit 2; }
OUT="${CONTROLPLANE_BIN:-${XDG_CACHE_HOME:-$HOME/.cache}/elasticrun/controlplane/$V-$(sha256sum "$HERE/go.sum" | cut -c1-12)}"
# One build at a time per output directory (parallel test sessions, checkouts).
mkdir -p "$(dirname "$OUT")"
exec 9>"$OUT.lock"
flock 9
WANT=(kube-apiserver etcd)
[[ ${1:-} == --node ]] && WANT+=(kubelet kube-scheduler kube-controller-manager)
MISSING=()
for b in "${WANT[@]}"; do [[ -x $OUT/$b ]] || MISSING+=("$b"); done
if [[ ${#MISSING[@]} -eq 0 ]]; then echo "$OUT"; exit 0; fi
command -v go >/dev/null || { echo "build.sh: 'go' not found; Go >= 1.26 is needed to build the control plane" >&2; exit 2; }

echo "build.sh: building ${MISSING[*]} ($V) into $OUT (first time only; about 5 minutes each for" \
  "kube-apiserver and kubelet on 2 cores, plus module downloads)" >&2
mkdir -p "$OUT.tmp"
[[ -d $OUT ]] && cp -a "$OUT/." "$OUT.tmp/"
cd "$HERE"
export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS="-mod=readonly -trimpath"
MINOR="$(echo "$V" | cut -d. -f2)"
P=k8s.io/component-base/version
LDF="-s -w -X $P.gitVersion=$V -X $P.gitMajor=1 -X $P.gitMinor=$MINOR -X $P.gitTreeState=clean"
LDF="$LDF -X k8s.io/client-go/pkg/version.gitVersion=$V -X k8s.io/client-go/pkg/version.gitMajor=1 -X k8s.io/client-go/pkg/version.gitMinor=$MINOR"
ETCDV="$(go list -m -f '{{.Version}}' go.etcd.io/etcd/server/v3)"
start=$SECONDS
for b in "${MISSING[@]}"; do
  t=$SECONDS
  if [[ $b == etcd ]]; then
    go build -ldflags "-s -w -X go.etcd.io/etcd/api/v3/version.GitSHA=$ETCDV" -o "$OUT.tmp/etcd" \
      go.etcd.io/etcd/server/v3 >&2
  else
    go build -ldflags "$LDF" -o "$OUT.tmp/$b" "k8s.io/kubernetes/cmd/$b" >&2
  fi
  echo "build.sh: $b built in $((SECONDS - t)) s" >&2
done
"$OUT.tmp/kube-apiserver" --version >&2
"$OUT.tmp/etcd" --version | sed -n 1p >&2  # not head: SIGPIPE under pipefail
echo "build.sh: built ${MISSING[*]} in $((SECONDS - start)) s" >&2
rm -rf "$OUT"
mv "$OUT.tmp" "$OUT"
echo "$OUT"
