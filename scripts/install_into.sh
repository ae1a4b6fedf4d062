#!/usr/bin/env bash
# Installs elasticft from this tree into an existing Python without its dependencies, so that the
# machine's own torch (a CUDA build) stays as it is.
#
#   bash scripts/install_into.sh PYTHON
#
# Exit 0: installed. Exit 3: pip could not install it (see the log it names); the NCCL shim was
# built in the tree instead, and the caller runs elasticft from the tree (PYTHONPATH=<the tree>).
# Any other exit: neither worked.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${1:?usage: bash scripts/install_into.sh PYTHON}
log=${TMPDIR:-/tmp}/elasticft_install.log
: >"$log"
# pyproject.toml declares its license as an SPDX expression, which setuptools reads from 77 on.
# A Python with an older one builds in pip's isolated environment instead, which fetches a newer
# setuptools from the package index.
if "$PYTHON" -c 'import setuptools, sys; sys.exit(int(setuptools.__version__.split(".")[0]) < 77)' \
    >>"$log" 2>&1; then
  "$PYTHON" -m pip install -q --no-deps --no-build-isolation -e . >>"$log" 2>&1 && exit 0
fi
"$PYTHON" -m pip install -q --retries 1 --timeout 15 --no-deps -e . >>"$log" 2>&1 && exit 0
echo "elasticft: pip could not install this tree into $PYTHON (setuptools older than 77 and" \
     "no package index to fetch one? see $log); running it from the tree instead" >&2
bash scripts/build_shim.sh || { echo "elasticft: cannot build the NCCL shim with cc" >&2; exit 1; }
exit 3
