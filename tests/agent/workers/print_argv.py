"""Writes the arguments it was started with, as it received them, to the JSON file $ARGV_OUT."""

import json
import os
import sys
from pathlib import Path

Path(os.environ["ARGV_OUT"]).write_text(json.dumps(sys.argv[1:]))
