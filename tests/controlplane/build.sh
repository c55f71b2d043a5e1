#!/usr/bin/env bash
# Builds kube-apiserver and etcd from the pinned Go modules and prints the
# directory that holds them.  Idempotent: the output directory is keyed by the
# Kubernetes version and the go.sum hash and lives outside the repository, so a
# second run (or a second checkout) costs nothing.
#
#   CONTROLPLANE_BIN   use this directory instead of the cache
#   XDG_CACHE_HOME     cache root (default ~/.cache)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
V="$(sed -nE 's#^(require)?[[:space:]]*k8s\.io/kubernetes (v[0-9.]+)([[:space:]].*)?$#\2#p' "$HERE/go.mod" | head -n1)"
[[ -n $V ]] || { echo "build.sh: cannot read the k8s.io/kubernetes version from $HERE/go.mod" >&2; exit 2; }
OUT="${CONTROLPLANE_BIN:-${XDG_CACHE_HOME:-$HOME/.cache}/elasticrun/controlplane/$V-$(sha256sum "$HERE/go.sum" | cut -c1-12)}"
if [[ -x $OUT/kube-apiserver && -x $OUT/etcd ]]; then echo "$OUT"; exit 0; fi
command -v go >/dev/null || { echo "build.sh: 'go' not found; Go >= 1.26 is needed to build the control plane" >&2; exit 2; }

echo "build.sh: building kube-apiserver $V and etcd into $OUT (first time only; ~10-20 min on 2 cores)" >&2
mkdir -p "$OUT.tmp"
cd "$HERE"
export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS="-mod=readonly -trimpath"
MINOR="$(echo "$V" | cut -d. -f2)"
P=k8s.io/component-base/version
LDF="-s -w -X $P.gitVersion=$V -X $P.gitMajor=1 -X $P.gitMinor=$MINOR -X $P.gitTreeState=clean"
LDF="$LDF -X k8s.io/client-go/pkg/version.gitVersion=$V -X k8s.io/client-go/pkg/version.gitMajor=1 -X k8s.io/client-go/pkg/version.gitMinor=$MINOR"
ETCDV="$(go list -m -f '{{.Version}}' go.etcd.io/etcd/server/v3)"
start=$SECONDS
go build -ldflags "$LDF" -o "$OUT.tmp/kube-apiserver" k8s.io/kubernetes/cmd/kube-apiserver >&2
go build -ldflags "-s -w -X go.etcd.io/etcd/api/v3/version.GitSHA=$ETCDV" -o "$OUT.tmp/etcd" go.etcd.io/etcd/server/v3 >&2
"$OUT.tmp/kube-apiserver" --version >&2
"$OUT.tmp/etcd" --version >&2
echo "build.sh: built in $((SECONDS - start)) s" >&2
rm -rf "$OUT"
mv "$OUT.tmp" "$OUT"
echo "$OUT"
