#!/usr/bin/env bash
# Builds the launchers' controllers from their pinned Go modules and prints the
# directory that holds them: JobSet's controller manager (`jobset`, main.go at
# the module root) and Kubeflow Trainer's (`trainer-controller-manager`).  The
# wrapper module is addons/ (go.mod + go.sum committed); the output directory is
# keyed by both versions and the go.sum hash and lives outside the repository,
# so a second run costs nothing.  Their manifests (CRDs, RBAC, webhooks) are
# read from the same module cache at run time by controlplane.addons.
#
# Kueue (`kueue`, cmd/kueue) is a module of its own, kueue/ (its dependencies
# are not JobSet's and Trainer's: k8s.io/kubernetes v1.36, Trainer v2.2.1), with
# a cache directory of its own keyed by its version and its go.sum, so building
# it never invalidates the JobSet/Trainer directory and the other way round.
# Ask for it alone; the same lock discipline applies to both directories.
#
#   build-addons.sh [jobset|trainer ...]   (default: both)
#   build-addons.sh kueue
#   ADDONS_BIN        use this directory instead of the cache
#   XDG_CACHE_HOME    cache root (default ~/.cache)
set -euo pipefail
WANT=("$@")
[[ ${#WANT[@]} -gt 0 ]] || WANT=(jobset trainer)
ROOT="$(cd "$(dirname "$0")" && pwd)"
if [[ " ${WANT[*]} " == *" kueue "* ]]; then
  [[ ${#WANT[@]} -eq 1 ]] || { echo "build-addons.sh: build kueue on its own (its own module)" >&2; exit 2; }
  HERE="$ROOT/kueue"
else
  HERE="$ROOT/addons"
fi
ver() { sed -nE "s#^(require)?[[:space:]]*$1 (v[0-9.]+)([[:space:]].*)?\$#\\2#p" "$HERE/go.mod" | head -n1; }
SUM="$(sha256sum "$HERE/go.sum" | cut -c1-12)"
if [[ $HERE == */kueue ]]; then
  KUEUE="$(ver 'sigs\.k8s\.io/kueue')"
  [[ -n $KUEUE ]] || { echo "build-addons.sh: cannot read the version from $HERE/go.mod" >&2; exit 2; }
  KEY="kueue-$KUEUE-$SUM" WHAT="Kueue $KUEUE"
else
  JOBSET="$(ver 'sigs\.k8s\.io/jobset')"
  TRAINER="$(ver 'github\.com/kubeflow/trainer/v2')"
  [[ -n $JOBSET && -n $TRAINER ]] || { echo "build-addons.sh: cannot read the versions from $HERE/go.mod" >&2; exit 2; }
  KEY="jobset-$JOBSET-trainer-$TRAINER-$SUM" WHAT="JobSet $JOBSET, Trainer $TRAINER"
fi
OUT="${ADDONS_BIN:-${XDG_CACHE_HOME:-$HOME/.cache}/elasticrun/addons/$KEY}"
mkdir -p "$(dirname "$OUT")"
exec 9>"$OUT.lock"
flock 9
MISSING=()
for b in "${WANT[@]}"; do
  case $b in
    jobset) [[ -x $OUT/jobset ]] || MISSING+=(jobset) ;;
    trainer) [[ -x $OUT/trainer-controller-manager ]] || MISSING+=(trainer) ;;
    kueue) [[ -x $OUT/kueue ]] || MISSING+=(kueue) ;;
    *) echo "build-addons.sh: unknown add-on '$b' (jobset, trainer, kueue)" >&2; exit 2 ;;
  esac
done
if [[ ${#MISSING[@]} -eq 0 ]]; then echo "$OUT"; exit 0; fi
command -v go >/dev/null || { echo "build-addons.sh: 'go' not found; Go >= 1.26 is needed" >&2; exit 2; }

echo "build-addons.sh: building ${MISSING[*]} ($WHAT) into $OUT" \
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
  elif [[ $b == kueue ]]; then
    go build -ldflags "-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=$KUEUE" \
      -o "$OUT.tmp/kueue" sigs.k8s.io/kueue/cmd/kueue >&2
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
