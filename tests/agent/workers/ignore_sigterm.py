"""Worker that ignores SIGTERM and sleeps, so only the agent's SIGKILL can stop it."""

import os
import signal
import sys
import time
from pathlib import Path

signal.signal(signal.SIGTERM, signal.SIG_IGN)
Path(sys.argv[1]).mkdir(parents=True, exist_ok=True)
(Path(sys.argv[1]) / f"pid-{os.environ['RANK']}").write_text(str(os.getpid()))
time.sleep(600)
