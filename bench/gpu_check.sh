#!/usr/bin/env bash
# One command on a GPU machine: installs elasticft into the torch already there and prints the
# GPU check's table (bench/gpu_check.py: NCCL shim self-check, a record per NCCL op with its GPU
# time, per-call overhead with and without the shim, a hang found through NCCL against plain
# torchrun, bench/ckpt_gpu.py's GPU checkpoint figures, the `gpu`-marked tests).
#
#   bash bench/gpu_check.sh [--torchrun-hang-s 90]
#                           [--parts ops,overhead,hang,ckpt,recovery,inprocess,conformance,torchtitan,persist,tests]
#                                                         (PYTHON=... to pick the interpreter)
#
# Without a CUDA device it installs nothing, checks the set-up and says so in one line.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

if ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  if ! compgen -G "elasticft/diag/_nccl_shim*.so" >/dev/null && command -v cc >/dev/null; then
    bash scripts/build_shim.sh
  fi
  PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "$PYTHON" bench/gpu_check.py --dry-run "$@"
fi

# elasticft without its dependencies (the torch pin must not replace the machine's torch), then
# whichever of its light dependencies are missing.
# Exit 3: run from the tree (PYTHONPATH is set below in any case).
bash scripts/install_into.sh "$PYTHON"
case $? in 0|3) ;; *) echo "gpu_check: cannot install elasticft nor build its shim" >&2; exit 1;; esac
missing=$("$PYTHON" - <<'PY'
import importlib.util
import shutil
wanted = {"numpy": "numpy", "yaml": "pyyaml", "psutil": "psutil", "tenacity": "tenacity",
          "prometheus_client": "prometheus-client", "pynvml": "nvidia-ml-py", "zlib_ng": "zlib-ng",
          "pytest": "pytest", "pytest_timeout": "pytest-timeout"}
missing = [pkg for mod, pkg in wanted.items() if importlib.util.find_spec(mod) is None]
print(" ".join(missing + ([] if shutil.which("py-spy") else ["py-spy"])))
PY
)
if [ -n "$missing" ]; then
  # A machine without a package index: wheels brought along in .whl/ (pip download ... -d .whl).
  if [ -d .whl ]; then
    "$PYTHON" -m pip install -q --no-index --find-links .whl $missing \
      || echo "gpu_check: could not install from .whl/: $missing"
  else
    "$PYTHON" -m pip install -q $missing \
      || echo "gpu_check: could not install: $missing (no index? put their wheels in .whl/)"
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" bench/gpu_check.py "$@"
