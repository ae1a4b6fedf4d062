"""Copying host bytes between tensors at memory speed.

A snapshot's tensors go into a shared-memory slot on a copy thread while training runs, and a
restore copies gigabytes back into live tensors with the cores to itself. Both want a plain
``memmove`` (faster than torch's elementwise copy kernel, and ctypes releases the GIL for it);
a restore also wants its destination's fresh pages allocated in one call and the bytes split
over every core. Tensors that are not plain contiguous CPU tensors of one dtype go through
``copy_``.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import os
from collections.abc import Sequence

import torch


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``; a plain ``memmove`` for contiguous CPU tensors of the same dtype.

    glibc's memmove is 20-80% faster than torch's elementwise copy kernel on large buffers
    (measured here: 3.2 vs 3.9 GB/s for 4 MB tensors, 3.4 vs 6.2 GB/s for 300 MB), and ctypes
    releases the GIL for the call, so a copy thread does not hold up the training thread.
    """
    if _plain(dst, src):
        nbytes = dst.numel() * dst.element_size()
        if nbytes:
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
        return
    dst.copy_(src)


_PARALLEL_CHUNK = 64 << 20
"""Bytes one thread of :func:`copy_all` copies at a time."""


def _plain(dst: torch.Tensor, src: torch.Tensor) -> bool:
    return (dst.dtype == src.dtype and dst.shape == src.shape and dst.is_contiguous()
            and src.is_contiguous() and dst.device.type == "cpu" and src.device.type == "cpu"
            and type(dst) is torch.Tensor and type(src) is torch.Tensor)


_PAGE = os.sysconf("SC_PAGE_SIZE")
_MADV_POPULATE_WRITE = 23  # Linux 5.14
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def _populate_if_fresh(address: int, length: int) -> None:
    """Allocates the pages of a destination the process has never touched in one call.

    A copy into fresh memory takes a page fault per 4 KiB; ``MADV_POPULATE_WRITE`` allocates
    the whole range in one go (2 GB on two threads: 0.68 s by faults, 0.49 s populated first,
    measured here). On memory already touched it only walks the page tables, which still costs
    35-70 ms a GB, so it is done only where the range's first page is not resident: a tensor
    that a restore just created (optimizer state), not a model's initialised parameters.
    """
    start = (address + _PAGE - 1) & ~(_PAGE - 1)
    end = (address + length) & ~(_PAGE - 1)
    if end <= start:
        return
    resident = ctypes.create_string_buffer(1)
    if _libc.mincore(start, _PAGE, resident) != 0 or resident.raw[0] & 1:
        return
    _libc.madvise(start, end - start, _MADV_POPULATE_WRITE)  # an older kernel: plain faults


def copy_all(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], threads: int = 0) -> None:
    """:func:`copy_bytes` of every (dst, src) pair, the host-memory bytes split over threads.

    A restore has the cores to itself (nothing trains yet), and its copy into memory the process
    has not touched is bound by page faults, which threads take in parallel (3.2 GB out of
    /dev/shm into fresh memory took 4.5-5.7 s on one thread and 2.9 s on two, measured here)
    and :func:`_populate_if_fresh` makes fewer.
    ``threads``: 0 for one per core this process may run on, up to 8.
    """
    chunks: list[tuple[int, int, int]] = []
    for dst, src in pairs:
        if not _plain(dst, src):
            dst.copy_(src)
            continue
        nbytes = dst.numel() * dst.element_size()
        for start in range(0, nbytes, _PARALLEL_CHUNK):
            chunks.append((dst.data_ptr() + start, src.data_ptr() + start,
                           min(_PARALLEL_CHUNK, nbytes - start)))

    def copy(chunk: tuple[int, int, int]) -> None:
        dst_at, src_at, length = chunk
        _populate_if_fresh(dst_at, length)
        ctypes.memmove(dst_at, src_at, length)  # ctypes releases the GIL for the call

    workers = min(threads or len(os.sched_getaffinity(0)), 8, len(chunks))
    if workers <= 1:
        for chunk in chunks:
            copy(chunk)
        return
    with concurrent.futures.ThreadPoolExecutor(workers, "elasticft-restore") as pool:
        list(pool.map(copy, chunks))  # list() re-raises a thread's error
