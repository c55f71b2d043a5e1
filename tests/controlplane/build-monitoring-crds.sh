#!/usr/bin/env bash
# Fetches the prometheus-operator CRDs the chart's monitoring kit renders
# objects of (ServiceMonitor, PodMonitor, PrometheusRule) and prints the
# directory that holds them.  They come from the Go module through the Go
# module proxy, like the other add-ons; nothing is compiled, only the YAML of
# example/prometheus-operator-crd/ is copied.  The module's hash is pinned here
# (and `go mod download` checks it against the checksum database too), and the
# output directory is keyed by version and hash, outside the repository, so a
# second run costs nothing.
#
#   MONITORING_CRDS   use this directory instead of the cache
#   XDG_CACHE_HOME    cache root (default ~/.cache)
set -euo pipefail
MODULE=github.com/prometheus-operator/prometheus-operator
VERSION=v0.85.0
SUM="h1:M5xLCLEoaW2IJfnuCwFzzpL+jSVQu3KGT84Pye+fW8s="
KINDS=(servicemonitors podmonitors prometheusrules)
complete() { for k in "${KINDS[@]}"; do [[ -s $1/monitoring.coreos.com_$k.yaml ]] || return 1; done; }

if [[ -n ${MONITORING_CRDS:-} ]]; then
  complete "$MONITORING_CRDS" || { echo "build-monitoring-crds.sh: $MONITORING_CRDS lacks the CRD files" >&2; exit 2; }
  echo "$MONITORING_CRDS"; exit 0
fi
OUT="${XDG_CACHE_HOME:-$HOME/.cache}/elasticrun/monitoring-crds/prometheus-operator-$VERSION-$(printf %s "$SUM" | sha256sum | cut -c1-12)"
if complete "$OUT"; then echo "$OUT"; exit 0; fi
# One fetch at a time (parallel test sessions, checkouts); the winner's copy serves the rest.
mkdir -p "$(dirname "$OUT")"
exec 9>"$OUT.lock"
flock 9
if complete "$OUT"; then echo "$OUT"; exit 0; fi
command -v go >/dev/null || { echo "build-monitoring-crds.sh: 'go' not found; Go is needed to fetch $MODULE" >&2; exit 2; }

echo "build-monitoring-crds.sh: fetching $MODULE@$VERSION (first time only)" >&2
cd "$(mktemp -d)"
trap 'rm -rf "$PWD"' EXIT
export GOTOOLCHAIN=local GOFLAGS=-mod=mod
json="$(timeout 600 go mod download -json "$MODULE@$VERSION")"
field() { sed -nE "s#^[[:space:]]*\"$1\": \"(.*)\",?\$#\\1#p" <<<"$json" | head -n1; }
got="$(field Sum)" dir="$(field Dir)"
[[ $got == "$SUM" ]] || { echo "build-monitoring-crds.sh: $MODULE@$VERSION has hash $got, expected $SUM" >&2; exit 2; }
[[ -d $dir/example/prometheus-operator-crd ]] || { echo "build-monitoring-crds.sh: no example/prometheus-operator-crd in $dir" >&2; exit 2; }
rm -rf "$OUT.tmp"
mkdir -p "$OUT.tmp"
for k in "${KINDS[@]}"; do
  cp "$dir/example/prometheus-operator-crd/monitoring.coreos.com_$k.yaml" "$OUT.tmp/"
done
chmod -R u+w "$OUT.tmp"
rm -rf "$OUT"
mv "$OUT.tmp" "$OUT"
echo "$OUT"
