# Sourced by the build scripts of Go tools the tests run (tests/helmtool/build.sh,
# tests/actionlint/build.sh): one cached, locked build of a binary from a pinned
# wrapper module.
#
#   go_tool_build NAME VERSION MODULE_DIR PACKAGE LDFLAGS WHEN
#
# Prints the binary's path and exits.  The binary lives in
# ${XDG_CACHE_HOME:-~/.cache}/elasticrun/NAME/VERSION-<go.sum hash>/NAME, outside
# the repository, so a second run (or a second checkout) costs nothing; one build
# at a time (parallel test sessions, checkouts), the winner's binary serves the rest.
# WHEN says how long a first build takes, for the message.
go_tool_build() {
  local name=$1 version=$2 dir=$3 package=$4 ldflags=$5 when=$6
  local out
  out="${XDG_CACHE_HOME:-$HOME/.cache}/elasticrun/$name/$version-$(sha256sum "$dir/go.sum" | cut -c1-12)"
  if [[ -x $out/$name ]]; then echo "$out/$name"; exit 0; fi
  mkdir -p "$(dirname "$out")"
  exec 9>"$out.lock"
  flock 9
  if [[ -x $out/$name ]]; then echo "$out/$name"; exit 0; fi
  command -v go >/dev/null || { echo "build.sh: 'go' not found; Go >= 1.26 is needed to build $name" >&2; exit 2; }
  echo "build.sh: building $name $version into $out (first time only; $when)" >&2
  rm -rf "$out.tmp"
  mkdir -p "$out.tmp"
  cd "$dir"
  export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS="-mod=readonly -trimpath"
  local start=$SECONDS
  go build -ldflags "$ldflags" -o "$out.tmp/$name" "$package" >&2
  echo "build.sh: built in $((SECONDS - start)) s" >&2
  rm -rf "$out"
  mv "$out.tmp" "$out"
  echo "$out/$name"
  exit 0
}
