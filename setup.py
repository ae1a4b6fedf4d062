"""Native part of elasticft: the NCCL timing shim, a plain shared library loaded with LD_PRELOAD.

Metadata lives in pyproject.toml; this file only declares the C library so that ``build_ext``
(run by ``pip install``, ``pip install -e .`` and wheel builds) compiles it with the system C
compiler and ships it inside the package. It is built like an extension module for packaging
purposes but never imported: it links only libdl and libpthread, and resolves NCCL and the CUDA
runtime at run time.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "elasticft.diag._nccl_shim",
            sources=[
                f"elasticft/diag/shim/{part}.c"
                for part in ("resolve", "ring", "events", "comms", "entry", "probe")
            ],
            depends=["elasticft/diag/shim/shim.h"],
            libraries=["dl", "pthread"],
            extra_compile_args=["-O2", "-std=gnu11", "-fvisibility=hidden", "-Wall"],
        )
    ],
)
