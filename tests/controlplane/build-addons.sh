#!/usr/bin/env bash
# Builds the launchers' controllers from their pinned Go modules and prints the
# directory that holds them: JobSet's controller manager (`jobset`, main.go at
# the module root) and Kubeflow Trainer's (`trainer-controller-manager`).  The
# wrapper module is addons/ (go.mod + go.sum committed); the output directory is
# keyed by both versions and the go.sum hash and lives outside the repository,
# so a second run costs nothing.  Their manifests (CRDs, RBAC, webhooks) are
# read from the same module cache at run time by controlplane.addons.
#
#   build-addons.sh [jobset|trainer ...]   (default: both)
#   ADDONS_BIN        use this directory instead of the cache
#   XDG_CACHE_HOME    cache root (default ~/.cache)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)/addons"
ver() { sed -nE "s#^(require)?[[:space:]]*$1 (v[0-9.]+)([[:space:]].*)?\$#\\2#p" "$HERE/go.mod" | head -n1; }
JOBSET="$(ver 'sigs\.k8s\.io/jobset')"
TRAINER="$(ver 'github\.com/kubeflow/trainer/v2')"
[[ -n $JOBSET && -n $TRAINER ]] || { echo "build-addons.sh: cannot read the versions from $HERE/go.mod" >&2; exit 2; }
OUT="${ADDONS_BIN:-${XDG_CACHE_HOME:-$HOME/.cache}/elasticrun/addons/jobset-$JOBSET-trainer-$TRAINER-$(sha256sum "$HERE/go.sum" | cut -c1-12)}"
mkdir -p "$(dirname "$OUT")"
exec 9>"$OUT.lock"
flock 9
WANT=("$@")
[[ ${#WANT[@]} -gt 0 ]] || WANT=(jobset trainer)
MISSING=()
for b in "${WANT[@]}"; do
  case $b in
    jobset) [[ -x $OUT/jobset ]] || MISSING+=(jobset) ;;
    trainer) [[ -x $OUT/trainer-controller-manager ]] || MISSING+=(trainer) ;;
    *) echo "build-addons.sh: unknown add-on '$b' (jobset, trainer)" >&2; exit 2 ;;
  esac
done
if [[ ${#MISSING[@]} -eq 0 ]]; then echo "$OUT"; exit 0; fi
command -v go >/dev/null || { echo "build-addons.sh: 'go' not found; Go >= 1.26 is needed" >&2; exit 2; }

echo "build-addons.sh: building ${MISSING[*]} (JobSet $JOBSET, Trainer $TRAINER) into $OUT" \
  "(first time only; a few minutes each on 2 cores, plus module downloads)" >&2
mkdir -p "$OUT.tmp"
[[ -d $OUT ]] && cp -a "$OUT/." "$OUT.tmp/"
cd "$HERE"
export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS="-mod=readonly -trimpath -buildvcs=false"
start=$SECONDS
for b in "${MISSING[@]}"; do
  t=$SECONDS
  if [[ $b == jobset ]]; then
    go build -ldflags "-s -w -X sigs.k8s.io/jobset/pkg/version.GitVersion=$JOBSET" \
      -o "$OUT.tmp/jobset" sigs.k8s.io/jobset >&2
  else
    go build -ldflags "-s -w" -o "$OUT.tmp/trainer-controller-manager" \
      github.com/kubeflow/trainer/v2/cmd/trainer-controller-manager >&2
  fi
  echo "build-addons.sh: $b built in $((SECONDS - t)) s" >&2
done
echo "build-addons.sh: built ${MISSING[*]} in $((SECONDS - start)) s" >&2
rm -rf "$OUT"
mv "$OUT.tmp" "$OUT"
echo "$OUT"
