#!/usr/bin/env bash
# Builds actionlint (the GitHub Actions workflow linter) from its pinned Go module
# and prints the path of the binary.  Its own wrapper module, like tests/helmtool,
# so its requirements never move another tool's.  Idempotent: the binary is
# cached outside the repository, keyed by the version and the go.sum hash.
#
#   ACTIONLINT_BIN    use this binary instead of building one
#   XDG_CACHE_HOME    cache root (default ~/.cache)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
if [[ -n ${ACTIONLINT_BIN:-} && -x ${ACTIONLINT_BIN} ]]; then echo "$ACTIONLINT_BIN"; exit 0; fi
M=github.com/rhysd/actionlint
V="$(sed -nE "s#^[[:space:]]*${M//./\\.} (v[0-9.]+)([[:space:]].*)?\$#\\1#p" "$HERE/go.mod" | head -n1)"
[[ -n $V ]] || { echo "build.sh: cannot read the $M version from $HERE/go.mod" >&2; exit 2; }
OUT="${XDG_CACHE_HOME:-$HOME/.cache}/elasticrun/actionlint/$V-$(sha256sum "$HERE/go.sum" | cut -c1-12)"
if [[ -x $OUT/actionlint ]]; then echo "$OUT/actionlint"; exit 0; fi
mkdir -p "$(dirname "$OUT")"
exec 9>"$OUT.lock"
flock 9
if [[ -x $OUT/actionlint ]]; then echo "$OUT/actionlint"; exit 0; fi
command -v go >/dev/null || { echo "build.sh: 'go' not found; Go >= 1.26 is needed to build actionlint" >&2; exit 2; }
echo "build.sh: building actionlint $V into $OUT (first time only; under a minute)" >&2
rm -rf "$OUT.tmp"
mkdir -p "$OUT.tmp"
cd "$HERE"
export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS="-mod=readonly -trimpath"
start=$SECONDS
go build -ldflags "-s -w -X $M.version=$V" -o "$OUT.tmp/actionlint" "$M/cmd/actionlint" >&2
"$OUT.tmp/actionlint" -version >&2
echo "build.sh: built in $((SECONDS - start)) s" >&2
rm -rf "$OUT"
mv "$OUT.tmp" "$OUT"
echo "$OUT/actionlint"
