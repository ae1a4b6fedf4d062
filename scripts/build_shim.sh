#!/usr/bin/env bash
# Builds the NCCL timing shim into the source tree (elasticft/diag/_nccl_shim.so) with the system
# C compiler, as setup.py's build_ext does, for running elasticft from the tree uninstalled.
set -euo pipefail
cd "$(dirname "$0")/.."
cc -O2 -std=gnu11 -fvisibility=hidden -Wall -shared -fPIC -o elasticft/diag/_nccl_shim.so \
  elasticft/diag/shim/*.c -ldl -lpthread
