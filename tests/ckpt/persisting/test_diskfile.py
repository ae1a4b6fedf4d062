"""Checkpoint files on disk: the O_DIRECT file holds exactly what was written; the CRC is zlib's."""

from __future__ import annotations

import mmap
import os
import zlib
from pathlib import Path

import pytest

from elasticft.ckpt.persisting import diskfile


def _page_aligned(nbytes: int) -> mmap.mmap:
    memory = mmap.mmap(-1, nbytes)
    memory.write(os.urandom(nbytes))
    return memory


MIB = 1 << 20


@pytest.mark.parametrize(
    ("case", "writes", "direct"),
    [
        # (source offset, length) into a page-aligned buffer; flush as the string "flush".
        ("small writes only", [(0, 10), (5, 4095), (0, 1), (7, 8193)], False),
        ("a large write at a page, from a page", [(0, 3 * MIB)], True),
        ("a large write after 100 bytes, from an address 100 past a page",
         [(0, 100), (100, 3 * MIB + 7)], True),
        ("a large write whose address is not congruent with its offset",
         [(0, 100), (0, 3 * MIB)], False),
        ("more than the bounce buffer holds, not congruent", [(1, 100), (3, 5 * MIB)], False),
        ("a flush between writes, then more", [(0, 300), "flush", (300, 2 * MIB), "flush",
                                               (11, 5000)], True),
        ("empty writes", [(0, 0), (0, 4096), (0, 0)], False),
    ],
)
def test_a_direct_file_holds_exactly_what_was_written(tmp_path: Path, case: str, writes: list,
                                                     direct: bool) -> None:
    source = _page_aligned(8 * MIB)
    view = memoryview(source)
    path = tmp_path / "shard"
    expected = bytearray()
    with diskfile.open_new(path, direct=True) as f:
        if not isinstance(f, diskfile.DirectFile):
            pytest.skip("this filesystem does not take O_DIRECT")
        for write in writes:
            if write == "flush":
                f.flush()
                assert path.read_bytes() == expected, case
                continue
            start, length = write
            assert f.write(view[start : start + length]) == length
            expected += view[start : start + length]
            assert f.tell() == len(expected)
        f.flush()
        assert (f.bytes_direct > 0) == direct, case
    assert path.read_bytes() == expected, case
    view.release()
    source.close()


@pytest.mark.parametrize("start", [0, 1, 0xFFFFFFFF])
@pytest.mark.parametrize("size", [0, 1, 63, 4096, 3 * MIB + 5])
def test_the_shard_checksum_is_zlibs_crc32(start: int, size: int) -> None:
    data = os.urandom(size)
    assert diskfile.crc32(data, start) == zlib.crc32(data, start)  # shards written before read
