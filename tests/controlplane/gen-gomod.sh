#!/usr/bin/env bash
# Regenerates go.mod/go.sum for the control-plane wrapper module.
#
# k8s.io/kubernetes requires every staging module at the fictitious v0.0.0 and
# maps it to ./staging/... with replace directives, which only the main module
# may use.  This wrapper is that main module: it replaces each staging module
# with its published v0.X.Y tag.  The list is read from the go.mod that the Go
# module proxy serves for the pinned release, so it is never maintained by hand.
#
# Usage: tests/controlplane/gen-gomod.sh [v1.37.2]   (run once, commit the result)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
V="${1:-v1.37.2}"
SV="v0.${V#v1.}"
export GOTOOLCHAIN=local GOFLAGS=-mod=mod
cd "$HERE"
GOMOD="$(go mod download -json "k8s.io/kubernetes@$V" | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')"
MODS="$(sed -nE 's#^[[:space:]]*(k8s\.io/[a-z0-9-]+) v0\.0\.0([[:space:]]|$).*#\1#p' "$GOMOD" | sort -u)"
rm -f go.mod go.sum
go mod init local.test/elasticrun-controlplane >/dev/null 2>&1
go mod edit -go=1.26.0 -require="k8s.io/kubernetes@$V" \
  -tool=k8s.io/kubernetes/cmd/kube-apiserver -tool=go.etcd.io/etcd/server/v3 \
  -tool=k8s.io/kubernetes/cmd/kubelet -tool=k8s.io/kubernetes/cmd/kube-scheduler \
  -tool=k8s.io/kubernetes/cmd/kube-controller-manager
for m in $MODS; do go mod edit -replace="$m=$m@$SV"; done
go mod tidy
go list -m k8s.io/kubernetes k8s.io/apiserver go.etcd.io/etcd/server/v3
