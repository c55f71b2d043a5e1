#!/usr/bin/env bash
# What the benchmark needs outside the venv: an etcd that still serves the v2 API,
# for torch's etcd-v2 rendezvous backend.  Debian's etcd-server 3.4 does (behind
# --enable-v2); etcd 3.6 removed it.  Idempotent; called by bench/run.py.
set -euo pipefail
ETCD="${BENCH_ETCD_V2:-/usr/bin/etcd}"
if [[ -x $ETCD ]] && "$ETCD" --help 2>&1 | grep -q -- '--enable-v2'; then
  exit 0
fi
if [[ -n ${BENCH_ETCD_V2:-} ]]; then
  echo "bench/setup.sh: BENCH_ETCD_V2=$ETCD is not an etcd with --enable-v2" >&2
  exit 2
fi
if ! command -v apt-get >/dev/null; then
  echo "bench/setup.sh: $ETCD missing and no apt-get: install an etcd 3.4 or 3.5 (v2 API) and set BENCH_ETCD_V2" >&2
  exit 2
fi
SUDO=""
if [[ $(id -u) != 0 ]]; then
  command -v sudo >/dev/null || { echo "bench/setup.sh: need root (or sudo) to apt-get install etcd-server" >&2; exit 2; }
  SUDO="sudo"
fi
echo "bench/setup.sh: installing Debian's etcd-server (etcd with the v2 API)" >&2
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq >&2
$SUDO apt-get install -y -qq --no-install-recommends etcd-server >&2
"$ETCD" --version >&2
