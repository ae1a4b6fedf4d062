"""Worker that writes its environment to <dir>/env-<RANK>.json and exits."""

import json
import os
import sys
from pathlib import Path

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
(out / f"env-{os.environ['RANK']}.json").write_text(json.dumps(dict(os.environ), indent=1))
