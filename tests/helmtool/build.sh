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
M=helm.sh/helm/v3
LDF="-s -w -X $M/internal/version.version=$V -X $M/internal/version.metadata= -X $M/internal/version.gitTreeState=clean"
for pkg in pkg/chartutil pkg/lint/rules; do
  LDF="$LDF -X $M/$pkg.k8sVersionMajor=1 -X $M/$pkg.k8sVersionMinor=$K8S_MINOR"
done
# shellcheck source=../gotool.sh
source "$HERE/../gotool.sh"
go_tool_build helm "$V" "$HERE" "$M/cmd/helm" "$LDF" "a few minutes"
