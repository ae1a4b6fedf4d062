"""Installs elasticft's diagnostics recorder in an unmodified training script.

When diagnostics are on, the agent puts this directory first on each worker's PYTHONPATH, so the
interpreter runs this file at start-up (Python's ``sitecustomize`` hook) without any change to the
script or its command line. It arms :mod:`elasticft.diag.autoinstall` (which waits for ``torch`` to
be imported, and imports nothing heavy itself), then runs the ``sitecustomize`` this one shadows,
if any, so a site's own customisation keeps working. Any failure is swallowed: diagnostics must
never stop a training script from starting.
"""

import os
import sys


def _run_shadowed() -> None:
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


try:
    from elasticft.diag import autoinstall

    autoinstall.arm(os.environ)
except Exception:  # never break the user's interpreter
    pass
_run_shadowed()
