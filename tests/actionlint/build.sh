#!/usr/bin/env bash
# Builds actionlint (the GitHub Actions workflow linter) from its pinned Go module
# and prints the path of the binary.  Its own wrapper module, like tests/helmtool,
# so its requirements never move another tool's; cached as tests/gotool.sh says.
#
#   ACTIONLINT_BIN    use this binary instead of building one
#   XDG_CACHE_HOME    cache root (default ~/.cache)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
if [[ -n ${ACTIONLINT_BIN:-} && -x ${ACTIONLINT_BIN} ]]; then echo "$ACTIONLINT_BIN"; exit 0; fi
M=github.com/rhysd/actionlint
V="$(sed -nE "s#^[[:space:]]*${M//./\\.} (v[0-9.]+)([[:space:]].*)?\$#\\1#p" "$HERE/go.mod" | head -n1)"
[[ -n $V ]] || { echo "build.sh: cannot read the $M version from $HERE/go.mod" >&2; exit 2; }
# shellcheck source=../gotool.sh
source "$HERE/../gotool.sh"
go_tool_build actionlint "$V" "$HERE" "$M/cmd/actionlint" "-s -w -X $M.version=$V" "under a minute"
