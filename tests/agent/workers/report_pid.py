"""Worker that writes its pid to ``<dir>/<RANK>`` and then sleeps (until something ends it)."""

import os
import sys
import time
from pathlib import Path

Path(sys.argv[1], os.environ["RANK"]).write_text(str(os.getpid()))
time.sleep(600)
