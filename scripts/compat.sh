#!/usr/bin/env bash
# Runs the smoke subset (tests marked `smoke`) on another torch release:
#   scripts/compat.sh TORCH_VERSION [pytest args...]      e.g. scripts/compat.sh 2.14.1
# It creates, once, a virtualenv with exactly that torch (from pip's configured indexes) and
# installs elasticft into it with `pip install -e .[dev]`, then checks that pip kept that torch.
# The environment is cached outside the repository, one per version, in
#   ${ELASTICFT_COMPAT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/elasticft/compat}/TORCH_VERSION
# TEST_WORKERS: pytest-xdist workers (default 2, a test file each; 0 for one process).
# Exit status: pytest's (non-zero when a test fails); 1 when the environment cannot be made or a
# smoke test was skipped or none ran (a skipped smoke test would hide a broken torch).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

if [ $# -lt 1 ] || [[ ! "$1" =~ ^[0-9]+\.[0-9]+(\.[0-9]+)?$ ]]; then
  echo "usage: scripts/compat.sh TORCH_VERSION [pytest args...]  (e.g. 2.14.1)" >&2
  exit 2
fi
VERSION=$1
shift
PYTHON=${PYTHON:-python3}
CACHE=${ELASTICFT_COMPAT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/elasticft/compat}
VENV=$CACHE/$VERSION
mkdir -p "$CACHE"
started=$(date +%s)

# One creator at a time per version (several checkouts may share the cache).
exec 9>"$CACHE/$VERSION.lock"
flock 9

# The environment is throwaway: a machine-wide pip constraints file (which may cap torch below
# the release asked for) does not apply to it. Nothing outside it is changed.
pip_here() { PIP_CONSTRAINT=/dev/null nice -n 10 "$VENV/bin/python" -m pip "$@"; }
quiet() { grep -v -e "^WARNING: Location" -e "^$" || true; }

if [ ! -f "$VENV/.torch-installed" ]; then
  echo "compat: creating $VENV with torch $VERSION (once; large download)"
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  pip_here install -q --upgrade pip 2>&1 | quiet
  pip_here install -q "torch==$VERSION" 2>&1 | quiet
  "$VENV/bin/python" -W ignore -c "import torch" || { echo "compat: torch $VERSION did not install" >&2; exit 1; }
  touch "$VENV/.torch-installed"
fi

# Installed again when the checkout or what pip reads from it (pyproject.toml, setup.py, the
# shim's C sources) changed: by content, not by date, so a fresh clone of the same tree in the
# same place reuses the install (a clone's files are all newer than any stamp).
stamp=$VENV/.elasticft-installed
installed_from="$ROOT $(cat pyproject.toml setup.py elasticft/diag/shim/* | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$installed_from" ]; then
  # What a user does: install elasticft into an environment that already has its torch. One
  # editable install of the checkout at a time (scripts/setup.sh's may run beside this one).
  exec 7<"$ROOT/setup.py"
  flock 7
  pip_here install -q -e "$ROOT[dev]" 2>&1 | quiet
  flock -u 7
  echo "$installed_from" > "$stamp"
fi
found=$("$VENV/bin/python" -W ignore -c 'import torch; print(torch.__version__)')  # e.g. 2.14.1+cpu
if [ "${found%%+*}" != "$VERSION" ]; then
  echo "compat: installing elasticft replaced torch $VERSION by ${found%%+*}" >&2
  rm -f "$stamp" "$VENV/.torch-installed"
  exit 1
fi
ready=$(date +%s)
echo "compat: torch $found ready in $((ready - started)) s; running the smoke subset"

bash scripts/install-servers.sh
report=$(mktemp -d)
trap 'rm -rf "$report"' EXIT
set +e
# Files go to the workers longest first, as in scripts/test.sh (tests/conftest.py orders them).
PYTHONPATH=$ROOT "$VENV/bin/python" -m pytest -p no:cacheprovider -q -m smoke -rfEs \
  -n "${TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder --junitxml="$report/smoke.xml" \
  "$@" tests
status=$?
set -e
# A skipped or missing smoke test is a failure here: it would hide what the torch changed.
if ! "$VENV/bin/python" - "$report/smoke.xml" "$VERSION" <<'EOF'
import sys
import xml.etree.ElementTree as ET

path, version = sys.argv[1], sys.argv[2]
try:
    suites = ET.parse(path).getroot()
except (OSError, ET.ParseError):
    sys.exit(f"compat: torch {version}: pytest wrote no report")
suite = suites if suites.tag == "testsuite" else suites.find("testsuite")
counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
bad = counts["failures"] + counts["errors"] + counts["skipped"]
print(f"compat: torch {version}: {'pass' if passed and not bad else 'FAIL'}: {passed} passed, "
      f"{counts['failures']} failed, {counts['errors']} errors, {counts['skipped']} skipped")
sys.exit(0 if counts["skipped"] == 0 and counts["tests"] > 0 else 1)
EOF
then
  [ "$status" -ne 0 ] || status=1
fi
echo "compat: torch $VERSION smoke subset exit $status after $(( $(date +%s) - started )) s"
exit "$status"
