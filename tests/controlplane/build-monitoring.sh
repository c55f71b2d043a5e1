#!/usr/bin/env bash
# Prepares what the chart's monitoring tests check against and prints the
# directory that holds it:
#
#  - the prometheus-operator CRDs of ServiceMonitor, PodMonitor and
#    PrometheusRule, the YAML of example/prometheus-operator-crd/ in its Go
#    module, fetched through the Go module proxy like the other add-ons
#    (nothing of prometheus-operator is compiled). The module's hash is pinned
#    here, and `go mod download` checks it against the checksum database too;
#  - `promql-check` (promqlcheck/, go.mod + go.sum committed): Prometheus' own
#    PromQL parser over a JSON list of expressions, reporting each one's parse
#    error or the metric names its selectors read. About 40 s to build, since
#    it links only github.com/prometheus/prometheus/promql/parser, not
#    promtool's service discovery.
#
# The output directory is keyed by the CRDs' version and hash and by the
# checker's sources, outside the repository, so a second run costs nothing.
#
#   MONITORING_BIN    use this directory instead of the cache
#   XDG_CACHE_HOME    cache root (default ~/.cache)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)/promqlcheck"
MODULE=github.com/prometheus-operator/prometheus-operator
VERSION=v0.85.0
SUM="h1:M5xLCLEoaW2IJfnuCwFzzpL+jSVQu3KGT84Pye+fW8s="
KINDS=(servicemonitors podmonitors prometheusrules)
complete() {
  for k in "${KINDS[@]}"; do [[ -s $1/monitoring.coreos.com_$k.yaml ]] || return 1; done
  [[ -x $1/promql-check ]]
}

if [[ -n ${MONITORING_BIN:-} ]]; then
  complete "$MONITORING_BIN" || { echo "build-monitoring.sh: $MONITORING_BIN lacks the CRD files or promql-check" >&2; exit 2; }
  echo "$MONITORING_BIN"; exit 0
fi
KEY="$(cat <(printf %s "$SUM") "$HERE/go.sum" "$HERE/main.go" | sha256sum | cut -c1-12)"
OUT="${XDG_CACHE_HOME:-$HOME/.cache}/elasticrun/monitoring/prometheus-operator-$VERSION-$KEY"
if complete "$OUT"; then echo "$OUT"; exit 0; fi
# One build at a time (parallel test sessions, checkouts); the winner's copy serves the rest.
mkdir -p "$(dirname "$OUT")"
exec 9>"$OUT.lock"
flock 9
if complete "$OUT"; then echo "$OUT"; exit 0; fi
command -v go >/dev/null || { echo "build-monitoring.sh: 'go' not found; Go >= 1.24 is needed" >&2; exit 2; }

echo "build-monitoring.sh: fetching $MODULE@$VERSION's CRDs and building promql-check into $OUT (first time only; about a minute)" >&2
start=$SECONDS
rm -rf "$OUT.tmp"
mkdir -p "$OUT.tmp"
export GOTOOLCHAIN=local
json="$(cd "$OUT.tmp" && GOFLAGS=-mod=mod timeout 600 go mod download -json "$MODULE@$VERSION")"
field() { sed -nE "s#^[[:space:]]*\"$1\": \"(.*)\",?\$#\\1#p" <<<"$json" | head -n1; }
got="$(field Sum)" dir="$(field Dir)"
[[ $got == "$SUM" ]] || { echo "build-monitoring.sh: $MODULE@$VERSION has hash $got, expected $SUM" >&2; exit 2; }
[[ -d $dir/example/prometheus-operator-crd ]] || { echo "build-monitoring.sh: no example/prometheus-operator-crd in $dir" >&2; exit 2; }
for k in "${KINDS[@]}"; do
  cp "$dir/example/prometheus-operator-crd/monitoring.coreos.com_$k.yaml" "$OUT.tmp/"
done
chmod u+w "$OUT.tmp"/*.yaml
(cd "$HERE" && CGO_ENABLED=0 GOFLAGS="-mod=readonly -trimpath -buildvcs=false" \
  timeout 900 go build -ldflags "-s -w" -o "$OUT.tmp/promql-check" . >&2)
echo "build-monitoring.sh: done in $((SECONDS - start)) s" >&2
rm -rf "$OUT"
mv "$OUT.tmp" "$OUT"
echo "$OUT"
