"""Loads a library the way torch loads libtorch_cuda.so (ctypes, RTLD_LOCAL), calls the named
cases in order and prints one JSON line: each case's return code, and the shim's self-check.

    python nccl_calls.py LIBRARY CASE [CASE...]      (a case may repeat: CASE*N)
"""

import ctypes
import json
import sys

from elasticft.diag import shimcheck


def main() -> None:
    library = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_LOCAL)
    codes = []
    for case in sys.argv[2:]:
        name, _, times = case.partition("*")
        for _ in range(int(times or 1)):
            codes.append([name, getattr(library, name)()])
    print(json.dumps({"codes": codes, "probe": shimcheck.probe().to_json()}))


if __name__ == "__main__":
    main()
