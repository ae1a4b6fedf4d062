"""A worker for the shim's self-check: optionally loads a library that needs the real libnccl
(RTLD_LOCAL, as torch does with libtorch_cuda.so), imports torch, and lives long enough for the
agent's monitor to read the check.

    python nccl_selfcheck.py [LIBRARY]
"""

import ctypes
import sys
import time

if len(sys.argv) > 1:
    ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_LOCAL)

import torch  # the bootstrap's self-check runs right after this import)

assert torch.__version__
time.sleep(1.5)
