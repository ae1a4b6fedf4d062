"""The disk tiers: atomic DCP-readable writes, commit marker, checksums, fallback, retention,
the CLI."""

from __future__ import annotations

import contextlib
import errno
import io
import mmap
import os
import signal
import subprocess
import sys
import textwrap
import time
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from elasticft.ckpt import Checkpointer, WorkerSettings, capture
from elasticft.ckpt.api import Snapshot, SnapshotCorrupt, StorageFull
from elasticft.ckpt.persisting import diskfile, durable
from elasticft.ckpt.snapshot import flatten, tensor_view
from elasticft.cli import main as cli_main
from tests.ckpt.helpers import remove_segments, trained_model, unique_prefix
from tests.conftest import ROOT

MIB = 1 << 20


def slot_snapshot(state: Mapping[str, Any], step: int) -> Snapshot:
    """``state`` as rank 0 of 1's snapshot at ``step``, in page-aligned memory as in a slot."""
    layout = flatten(state)
    payload = mmap.mmap(-1, max(1, layout.payload_bytes))
    for entry in layout.tensors:
        tensor_view(payload, entry.to_json()).copy_(entry.tensor)
    return Snapshot(layout.manifest(step, 0, 1), payload)


@pytest.fixture
def prefix():
    name = unique_prefix()
    yield name
    remove_segments(name)


def _persisting(prefix: str, local: Path, remote: Path | None = None, keep: int = 3,
                every: int = 1) -> WorkerSettings:
    return WorkerSettings(shm_slots=prefix, local_dir=local, remote_dir=remote,
                          persist_every=every, keep=keep)


def _save_steps(ckpt: Checkpointer, model, optim, steps) -> None:
    for step in steps:
        ckpt.save(step, capture(model, optim, {"step": step})).wait(30)
        _wait_committed(ckpt.settings.local_dir, step)


def _wait_committed(root: Path, step: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while step not in durable.committed_steps(root):
        assert time.monotonic() < deadline, f"step {step} never committed in {root}"
        time.sleep(0.05)


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.timeout(120)
def test_flipped_byte_is_detected_and_load_falls_back(tmp_path: Path, prefix: str) -> None:
    model, optim = trained_model()
    local, remote = tmp_path / "local", tmp_path / "remote"
    with Checkpointer(_persisting(prefix, local, remote), optimizers=[optim]) as ckpt:
        _save_steps(ckpt, model, optim, [1, 2])
        _wait_committed(remote, 2)
    remove_segments(prefix)  # memory gone: the disk tiers must serve
    shard = durable.step_dir(local, 2) / durable.shard_name(0)
    manifest = durable.read_rank_manifest(durable.step_dir(local, 2), 0)
    place = manifest["storage"]["model.0.weight"]
    _flip_byte(shard, place["offset"] + place["length"] - 8)
    with pytest.raises(SnapshotCorrupt, match=r"checksum mismatch in item 'model\.0\.weight'"):
        durable.read_rank_shard(durable.step_dir(local, 2), 0)
    assert cli_main(["ckpt", "verify", str(local), "--step", "2"]) == 1
    with Checkpointer(_persisting(unique_prefix(), local, remote)) as ckpt:
        step, state = ckpt.load()
    assert (step, ckpt.last_source) == (2, "remote")  # same step, next source
    assert torch.equal(state["model"]["0.weight"], model.state_dict()["0.weight"])
    # With the remote copy corrupt too, the newest intact step is loaded instead.
    _flip_byte(durable.step_dir(remote, 2) / durable.shard_name(0), place["offset"] + 100)
    with Checkpointer(_persisting(unique_prefix(), local, remote)) as ckpt:
        step, _ = ckpt.load()
    assert (step, ckpt.last_source) == (1, "local")


@pytest.mark.timeout(60)
def test_uncommitted_step_is_never_loaded(tmp_path: Path, prefix: str) -> None:
    model, optim = trained_model()
    local = tmp_path / "local"
    with Checkpointer(_persisting(prefix, local), optimizers=[optim]) as ckpt:
        _save_steps(ckpt, model, optim, [1, 2])
    remove_segments(prefix)
    (durable.step_dir(local, 2) / durable.COMMIT_MARKER).unlink()
    with Checkpointer(_persisting(unique_prefix(), local)) as ckpt:
        step, _ = ckpt.load()
    assert step == 1


@pytest.mark.timeout(120)
def test_a_step_commits_when_another_rank_writes_its_shard_last(tmp_path: Path) -> None:
    """Rank 0 commits; when rank 1's shard lands after rank 0's own, no later persist and no
    close is needed for the step to commit (a crash then would lose a durable step)."""
    model, optim = trained_model()
    local = tmp_path / "local"
    prefixes = [unique_prefix(), unique_prefix()]
    committer = Checkpointer(_persisting(prefixes[0], local), optimizers=[optim], rank=0,
                             world_size=2)
    other = Checkpointer(_persisting(prefixes[1], local), optimizers=[optim], rank=1,
                         world_size=2)
    try:
        committer.save(1, capture(model, optim, {"step": 1})).wait(30)
        deadline = time.monotonic() + 30
        while not list(durable.step_dir(local, 1).glob("*")):
            assert time.monotonic() < deadline, "rank 0 never wrote its shard"
            time.sleep(0.05)
        time.sleep(0.5)  # rank 0's own commit attempt has found rank 1 missing
        assert 1 not in durable.committed_steps(local)
        other.save(1, capture(model, optim, {"step": 1})).wait(30)
        _wait_committed(local, 1, timeout=20)
        assert durable.committed_steps(local)[1]["ranks"] == [0, 1]
    finally:
        other.close()
        committer.close()
        for name in prefixes:
            remove_segments(name)


_HALF_PERSIST = textwrap.dedent("""
    import os, signal, sys, torch
    from pathlib import Path
    from elasticft.ckpt.persisting import durable
    from elasticft.ckpt.api import Snapshot
    from elasticft.ckpt.snapshot import flatten, tensor_view
    layout = flatten({"w": torch.arange(1000.0)})
    payload = bytearray(layout.payload_bytes)
    for entry in layout.tensors:
        tensor_view(payload, entry.to_json()).copy_(entry.tensor)
    durable.write_rank_shard(Path(sys.argv[1]), Snapshot(layout.manifest(5, 0, 2), payload))
    os.kill(os.getpid(), signal.SIGKILL)   # dies before rank 1's shard and the commit
""")


@pytest.mark.timeout(60)
def test_persister_killed_midway_leaves_no_committed_checkpoint(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", _HALF_PERSIST, str(tmp_path)], cwd=ROOT,
                          timeout=50)
    assert proc.returncode == -signal.SIGKILL
    assert durable.list_steps(tmp_path) and not durable.committed_steps(tmp_path)
    assert not durable.try_commit(tmp_path, 5, 2, [0, 1])  # rank 1 never became durable
    assert durable.DurableTier(tmp_path).steps(0, 2) == []


@pytest.mark.timeout(120)
def test_full_disk_is_a_clear_error_and_memory_saves_go_on(tmp_path: Path, prefix: str,
                                                           caplog) -> None:
    model, optim = trained_model()
    local = tmp_path / "local"
    step_dir = durable.step_dir(local, 1)
    step_dir.mkdir(parents=True)
    for numel in (10, 2 << 20):  # kept in Python's buffer until the end; written at once
        # The kernel answers ENOSPC for every write to /dev/full.
        os.symlink("/dev/full", step_dir / f".{durable.shard_name(0)}.tmp")
        with pytest.raises(StorageFull, match="no space left"):
            layout = flatten({"w": torch.ones(numel)})
            durable.write_rank_shard(local, Snapshot(layout.manifest(1, 0, 1),
                                                     bytearray(layout.payload_bytes)))
    os.symlink("/dev/full", step_dir / f".{durable.shard_name(0)}.tmp")
    with Checkpointer(_persisting(prefix, local), optimizers=[optim]) as ckpt:
        assert ckpt.save(1, capture(model, optim)).wait(30).status == "memory"
        deadline = time.monotonic() + 60
        while "no space left" not in caplog.text:  # the background persist of step 1 failed
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert ckpt.save(2, capture(model, optim)).wait(30).status == "memory"
        _wait_committed(local, 2)
        assert ckpt.newest_step() == 2
    assert 1 not in durable.committed_steps(local)
    assert "no space left" in caplog.text


@pytest.mark.timeout(120)
def test_retention_keeps_the_newest_k(tmp_path: Path, prefix: str, capsys) -> None:
    model, optim = trained_model()
    local = tmp_path / "local"
    with Checkpointer(_persisting(prefix, local, keep=2), optimizers=[optim]) as ckpt:
        _save_steps(ckpt, model, optim, [1, 2, 3, 4])
    assert sorted(durable.list_steps(local)) == [3, 4]
    assert cli_main(["ckpt", "ls", str(local)]) == 0
    assert "committed+dcp" in capsys.readouterr().out
    out = tmp_path / "export.pt"
    assert cli_main(["ckpt", "export", str(local), "--out", str(out), "--format", "torch"]) == 0
    exported = torch.load(out, weights_only=True)
    assert torch.equal(exported["model"]["2.bias"], model.state_dict()["2.bias"])
    plain = tmp_path / "plain"
    assert cli_main(["ckpt", "export", str(local), "--out", str(plain)]) == 0
    target = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    dcp.load(target, checkpoint_id=str(plain), no_dist=True)
    assert torch.equal(target["model"]["0.weight"], model.state_dict()["0.weight"])
    assert cli_main(["ckpt", "export", str(local), "--out", str(plain)]) == 2  # exists

    # A damaged shard is refused, in one line, and nothing is written; an older step still goes.
    shard = durable.step_dir(local, 4) / durable.shard_name(0)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    capsys.readouterr()
    for fmt in ("dcp", "torch"):
        damaged = tmp_path / f"damaged-{fmt}"
        assert cli_main(["ckpt", "export", str(local), "--out", str(damaged),
                         "--format", fmt]) == 2
        assert not damaged.exists()
    err = capsys.readouterr().err
    assert "step 4 rank 0 is corrupt" in err and "nothing exported" in err and "--step" in err
    assert cli_main(["ckpt", "export", str(local), "--step", "3", "--out",
                     str(tmp_path / "older")]) == 0


@pytest.mark.timeout(60)
def test_shard_blobs_load_without_zip_checksums_and_torch_setting_is_restored(
    tmp_path: Path,
) -> None:
    model, optim = trained_model()
    snapshot = slot_snapshot(capture(model, optim, {"step": 1}), 1)
    durable.write_rank_shard(tmp_path, snapshot)
    directory = durable.step_dir(tmp_path, 1)
    record = durable.read_rank_manifest(directory, 0)
    data = (directory / durable.shard_name(0)).read_bytes()
    weight = record["storage"]["model.0.weight"]
    blob = data[weight["offset"] : weight["offset"] + weight["length"]]
    assert zlib.crc32(blob) == weight["crc32"]  # the shard's own checksum covers the blob
    loaded = torch.load(io.BytesIO(blob), weights_only=True)
    assert torch.equal(loaded, model.state_dict()["0.weight"])
    # torch's switch is process-wide, and a persist left running by another test in this
    # process would hold it off: the user's setting is checked in a process of its own.
    check = textwrap.dedent(f"""
        from pathlib import Path
        import torch
        from elasticft.ckpt.persisting import durable
        from tests.ckpt.persisting.test_durable import slot_snapshot
        for setting in (True, False):
            torch.serialization.set_crc32_options(setting)
            durable.write_rank_shard(Path({str(tmp_path / "own")!r}),
                                     slot_snapshot({{"w": torch.ones(5)}}, 1))
            assert torch.serialization.get_crc32_options() is setting, setting
        print("restored")
    """)
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert done.stdout.strip() == "restored", done.stderr[-2000:]


@pytest.mark.timeout(60)
def test_a_shard_goes_to_the_disk_from_the_slot_memory_and_reads_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    state = {"big": torch.randn(3 * MIB // 4 + 5), "small": torch.randn(7), "step": 3,
             "other": torch.randn(MIB // 2 + 1)}
    written = slot_snapshot(state, 3)
    files: list[diskfile.DirectFile] = []

    class Recorded(diskfile.DirectFile):
        def __init__(self, fd: int) -> None:
            super().__init__(fd)
            files.append(self)

    monkeypatch.setattr(diskfile, "DirectFile", Recorded)
    directory = durable.write_rank_shard(tmp_path, written)
    if not files:
        pytest.skip("this filesystem does not take O_DIRECT")
    big = state["big"].nbytes + state["other"].nbytes
    assert files[0].bytes_direct >= big - 4 * 4096  # all but the blobs' unaligned ends
    snapshot = durable.read_rank_shard(directory, 0)
    assert bytes(snapshot.payload) == bytes(written.payload)
    target = {"big": torch.zeros_like(state["big"]), "other": torch.zeros_like(state["other"])}
    record = durable.read_rank_manifest(directory, 0)
    data = (directory / record["file"]).read_bytes()
    for name, tensor in target.items():
        place = record["storage"][name]
        tensor.copy_(torch.load(io.BytesIO(data[place["offset"]:][: place["length"]]),
                                weights_only=True))
        assert torch.equal(tensor, state[name])


@pytest.mark.timeout(60)
def test_a_filesystem_refusing_direct_writes_gets_the_shard_through_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    original_write = os.write
    direct_fds: set[int] = set()
    original_init = diskfile.DirectFile.__init__

    def remember(self: diskfile.DirectFile, fd: int, *args: object) -> None:
        direct_fds.add(fd)
        original_init(self, fd, *args)

    def write(fd: int, data: object) -> int:
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return original_write(fd, data)

    monkeypatch.setattr(diskfile.DirectFile, "__init__", remember)
    monkeypatch.setattr(os, "write", write)
    snapshot = slot_snapshot({"w": torch.randn(MIB), "step": 1}, 1)
    directory = durable.write_rank_shard(tmp_path, snapshot)
    if not direct_fds:
        pytest.skip("this filesystem does not take O_DIRECT")
    assert "refused an O_DIRECT write" in caplog.text
    assert bytes(durable.read_rank_shard(directory, 0).payload) == bytes(snapshot.payload)
    assert sorted(p.name for p in directory.iterdir()) == ["__r0.distcp", "r0.json"]


@contextlib.contextmanager
def _small_filesystem(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``where`` (root only): a disk that really fills up."""
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small filesystem needs root")
@pytest.mark.timeout(60)
def test_a_filesystem_that_fills_up_under_direct_writes_is_a_clear_error_leaving_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    direct_fds: list[int] = []
    original_init = diskfile.DirectFile.__init__

    def remember(self: diskfile.DirectFile, fd: int, *args: object) -> None:
        direct_fds.append(fd)
        original_init(self, fd, *args)

    monkeypatch.setattr(diskfile.DirectFile, "__init__", remember)
    with _small_filesystem(tmp_path / "small", "8m") as small:
        big = flatten({"w": torch.randn(4 * MIB), "b": torch.ones(10)})  # 16 MB
        with pytest.raises(StorageFull, match=r"no space left writing .*free space there"):
            durable.write_rank_shard(small, Snapshot(big.manifest(1, 0, 1),
                                                     bytearray(big.payload_bytes)))
        if not direct_fds:
            pytest.skip("this kernel's tmpfs does not take O_DIRECT")
        step_one = durable.step_dir(small, 1)
        assert list(step_one.iterdir()) == []  # no shard, no temporary file
        assert durable.DurableTier(small).steps(0, 1) == []
        # The space is back: the next, smaller checkpoint is written whole and reads back.
        snapshot = slot_snapshot({"w": torch.randn(MIB // 4)}, 2)
        directory = durable.write_rank_shard(small, snapshot)
        assert bytes(durable.read_rank_shard(directory, 0).payload) == bytes(snapshot.payload)
        assert len(direct_fds) == 2


@pytest.mark.timeout(60)
def test_every_dtype_and_shape_reads_back_from_a_file_and_from_memory_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    state = {
        "f32": torch.randn(3, 5), "bf16": torch.randn(1000).to(torch.bfloat16),
        "i64": torch.arange(77), "bool": torch.rand(9) > 0.5, "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4), "u8": torch.randint(0, 255, (4096,), dtype=torch.uint8),
        "big": torch.randn(MIB + 3), "step": 7, "name": "run",
    }
    written = slot_snapshot(state, 7)
    directory = durable.write_rank_shard(tmp_path, written)
    fallbacks: list[str] = []
    original = durable._decode_by_torch_load

    def counted(blob, place, target, fqn, where) -> None:
        if target.nbytes:
            fallbacks.append(fqn)
        original(blob, place, target, fqn, where)

    monkeypatch.setattr(durable, "_decode_by_torch_load", counted)
    manifest = durable.read_rank_manifest(directory, 0)
    data = (directory / manifest["file"]).read_bytes()
    for snapshot in (durable.read_rank_shard(directory, 0),
                     durable.decode_shard(manifest, data, "memory")):
        assert bytes(snapshot.payload) == bytes(written.payload)
    assert fallbacks == []  # every tensor's bytes were read in place, none through torch.load
    # A damaged tensor byte is caught by the in-place path too, from a file and from memory.
    damaged = bytearray(data)
    place = manifest["storage"]["big"]
    damaged[place["offset"] + place["length"] // 2] ^= 0x01
    (directory / manifest["file"]).write_bytes(bytes(damaged))
    with pytest.raises(SnapshotCorrupt, match="checksum mismatch in item 'big'"):
        durable.read_rank_shard(directory, 0)
    with pytest.raises(SnapshotCorrupt, match="checksum mismatch in item 'big'"):
        durable.decode_shard(manifest, damaged, "memory")
    # A shard cut short is named, not read past its end.
    (directory / manifest["file"]).write_bytes(data[: place["offset"] + 100])
    with pytest.raises(SnapshotCorrupt, match="'big'"):
        durable.read_rank_shard(directory, 0)
