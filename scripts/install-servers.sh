#!/usr/bin/env bash
# Installs the real servers the test suite runs against (etcd, Slurm, munge) when absent.
set -euo pipefail
# One install at a time (apt's lock): scripts/test.sh and scripts/compat.sh may both call this
# at once; the second then finds the servers there.
exec 8<"$0"
flock 8
missing=()
command -v etcd >/dev/null 2>&1 || missing+=(etcd-server)
command -v slurmctld >/dev/null 2>&1 || missing+=(slurm-wlm)
command -v munged >/dev/null 2>&1 || missing+=(munge)
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null 2>&1 || { echo "install-servers: need root to install ${missing[*]}" >&2; exit 1; }
  SUDO=sudo
fi
echo "install-servers: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q >/dev/null
$SUDO apt-get install -y -q "${missing[@]}" >/dev/null
