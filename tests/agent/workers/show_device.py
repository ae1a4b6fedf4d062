"""Worker that records what its warm spare prepared and what it sees of CUDA, then waits.

    show_device.py OUT_DIR [MODE]

Writes OUT_DIR/<$SHOW_START_TAG>.json. MODE ``cuda`` first makes a CUDA context on its device
(a GPU worker), ``cpu`` (the default) does not; both then sleep until signalled.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch

out, mode = Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "cpu"
spare = sys.modules.get("_elasticft_warm_device")
cuda = torch.cuda.is_available()
state = {
    "pid": os.getpid(),
    "prepared": getattr(spare, "PREPARED", None),
    "local_rank": os.environ.get("LOCAL_RANK"),
    "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    "warm_device_env": os.environ.get("ELASTICFT_WARM_DEVICE"),
    "cuda_initialized": torch.cuda.is_initialized(),
    "current_device": torch.cuda.current_device() if cuda else None,
    "memory_allocated": torch.cuda.memory_allocated() if cuda else 0,
    "session_leader": os.getsid(0) == os.getpid(),
}
if mode == "cuda":
    torch.ones(1, device=f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}")
out.mkdir(parents=True, exist_ok=True)
# Renamed into place: the test waits for the file to exist, then reads it.
tmp = out / f".{os.environ['SHOW_START_TAG']}.json.tmp"
tmp.write_text(json.dumps(state))
tmp.replace(out / f"{os.environ['SHOW_START_TAG']}.json")
while True:
    time.sleep(1)
