#!/usr/bin/env bash
# Builds helm from its pinned Go module and prints the path of the binary.
#
# helm lives in its own wrapper module because it pins its own k8s.io versions;
# sharing the control plane's module would let MVS move those.  Idempotent: the
# binary is cached outside the repository, keyed by the helm version and the
# go.sum hash, so a second run (or a second checkout) costs nothing.
#
#   HELM_BIN          use this binary instead of building one
#   XDG_CACHE_HOME    cache root (default ~/.cache)
#
# The capability ldflags make `helm template` and `helm lint` assume the
# Kubernetes minor we test against (1.37) instead of helm's built-in v1.20.0.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
if [[ -n ${HELM_BIN:-} && -x ${HELM_BIN} ]]; then echo "$HELM_BIN"; exit 0; fi
V="$(sed -nE 's#^(require)?[[:space:]]*helm\.sh/helm/v3 (v[0-9.]+)([[:space:]].*)?$#\2#p' "$HERE/go.mod" | head -n1)"
[[ -n $V ]] || { echo "build.sh: cannot read the helm.sh/helm/v3 version from $HERE/go.mod" >&2; exit 2; }
K8S_MINOR=37
OUT="${XDG_CACHE_HOME:-$HOME/.cache}/elasticrun/helm/$V-$(sha256sum "$HERE/go.sum" | cut -c1-12)"
if [[ -x $OUT/helm ]]; then echo "$OUT/helm"; exit 0; fi
# One build at a time (parallel test sessions, checkouts); the winner's binary serves the rest.
mkdir -p "$(dirname "$OUT")"
exec 9>"$OUT.lock"
flock 9
if [[ -x $OUT/helm ]]; then echo "$OUT/helm"; exit 0; fi
command -v go >/dev/null || { echo "build.sh: 'go' not found; Go >= 1.26 is needed to build helm" >&2; exit 2; }

echo "build.sh: building helm $V into $OUT (first time only; a few minutes)" >&2
rm -rf "$OUT.tmp"
mkdir -p "$OUT.tmp"
cd "$HERE"
export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS="-mod=readonly -trimpath"
M=helm.sh/helm/v3
LDF="-s -w -X $M/internal/version.version=$V -X $M/internal/version.metadata= -X $M/internal/version.gitTreeState=clean"
for pkg in pkg/chartutil pkg/lint/rules; do
  LDF="$LDF -X $M/$pkg.k8sVersionMajor=1 -X $M/$pkg.k8sVersionMinor=$K8S_MINOR"
done
start=$SECONDS
go build -ldflags "$LDF" -o "$OUT.tmp/helm" helm.sh/helm/v3/cmd/helm >&2
"$OUT.tmp/helm" version --short >&2
echo "build.sh: built in $((SECONDS - start)) s" >&2
rm -rf "$OUT"
mv "$OUT.tmp" "$OUT"
echo "$OUT/helm"
