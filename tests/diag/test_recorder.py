"""The Python recorder and the bootstrap in real interpreters."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from elasticft.diag.ring import Op, RingReader, ring_path
from elasticft.diag.workerenv import bootstrap_dir


@pytest.mark.timeout(120)
def test_bootstrap_records_gloo_collectives_and_steps_and_chains_site_customize(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os\nos.environ['SITE_RAN'] = 'yes'\n")
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import os, torch, torch.distributed as dist
        assert os.environ.get("SITE_RAN") == "yes", "the shadowed sitecustomize did not run"
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
        # no global module hook (torch.compile warns at every call while one exists)
        from torch.nn.modules.module import _has_any_global_hook
        assert not _has_any_global_hook(), "a global module hook"
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
        dist.all_reduce(torch.ones(10))
        dist.barrier()
    """))
    env = {"PATH": "/usr/bin:/bin", "RANK": "0", "ELASTICFT_DIAG_RING_DIR": str(tmp_path),
           "PYTHONPATH": f"{bootstrap_dir()}:{site}"}
    subprocess.run([sys.executable, str(script)], env=env, check=True, timeout=100)
    header, records = RingReader(ring_path(tmp_path, 0, "py")).poll()
    assert header is not None and header.heartbeat_ns > 0 and header.step == 3
    ops = [Op(r.op) for r in records]
    assert ops.count(Op.STEP) == 3
    assert ops.count(Op.DDP_BUCKET) >= 3  # one bucket per step at least
    assert Op.ALL_REDUCE in ops and Op.BARRIER in ops
    reduce = next(r for r in records if r.op == Op.ALL_REDUCE)
    assert reduce.nbytes == 40 and reduce.complete_ns >= reduce.enqueue_ns > 0
    assert all(not r.in_flight for r in records)


@pytest.mark.timeout(120)
def test_timed_ddp_hook_gives_the_same_gradients(tmp_path):
    script = textwrap.dedent("""
        import sys, torch, torch.distributed as dist
        from pathlib import Path
        from elasticft.diag.recorder import Recorder
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        torch.manual_seed(0)
        base = torch.nn.Linear(16, 4)
        grads = []
        for hooked in (False, True):
            m = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 4))
            m.module.load_state_dict(base.state_dict())
            if hooked:
                Recorder.open(Path(sys.argv[1]) / "rank-0.py.ring", 0).attach_ddp(m)
            torch.manual_seed(1)
            m(torch.randn(8, 16)).pow(2).sum().backward()
            grads.append([p.grad.clone() for p in m.parameters()])
        assert all(torch.equal(a, b) for a, b in zip(*grads))
    """)
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], check=True, timeout=100,
                   cwd=Path(__file__).resolve().parents[2])


@pytest.mark.timeout(120)
def test_the_recorder_keeps_no_process_group_alive_after_destroy(tmp_path):
    """A group the recorder still held was destroyed at interpreter exit, where gloo can abort
    a worker whose training ended well."""
    script = textwrap.dedent("""
        import gc, sys, weakref, torch, torch.distributed as dist
        from pathlib import Path
        from elasticft.diag.recorder import install
        recorder = install(Path(sys.argv[1]) / "rank-0.py.ring", 0)
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        side = dist.new_group([0], backend="gloo")
        dist.all_reduce(torch.ones(4))
        dist.all_reduce(torch.ones(4), group=side)
        assert not recorder.on_nccl(None) and not recorder.on_nccl(side)  # as an NCCL check asks
        groups = [weakref.ref(dist.group.WORLD), weakref.ref(side)]
        del side
        dist.destroy_process_group()
        gc.collect()
        assert [g() for g in groups] == [None, None], "a process group outlived destroy"
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        dist.all_reduce(torch.ones(4))  # a new world group is timed under its own key
        dist.destroy_process_group()
    """)
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], check=True, timeout=100,
                   cwd=Path(__file__).resolve().parents[2])
    _header, records = RingReader(ring_path(tmp_path, 0, "py")).poll()
    reduces = [r for r in records if r.op == Op.ALL_REDUCE]
    assert len(reduces) == 3 and all(r.comm != 0 for r in reduces)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_timed_ddp_hook_sums_as_ddp_does_with_three_ranks(tmp_path):
    """Each rank's gradients under the timed hook equal DDP's own path bit for bit with 3 gloo
    ranks: a world size that is no power of two, where dividing each bucket by it and
    multiplying each gradient by its inverse (DDP's reducer) differ in the last bit. A job whose
    DDPs mix the two (a DDP re-made after an in-process recovery beside a new rank's) summed
    differently from the run before its failure."""
    script = textwrap.dedent("""
        import socket, sys, torch, torch.distributed as dist, torch.multiprocessing as mp
        from pathlib import Path
        from elasticft.diag.recorder import Recorder

        def rank_main(rank, port, ring_dir):
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                    world_size=3)
            torch.manual_seed(0)
            base = torch.nn.Linear(64, 32)
            grads = []
            for hooked in (False, True):
                m = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 32))
                m.module.load_state_dict(base.state_dict())
                if hooked:
                    Recorder.open(Path(ring_dir) / f"rank-{rank}.py.ring", rank).attach_ddp(m)
                torch.manual_seed(1 + rank)
                m(torch.randn(8, 64)).pow(2).sum().backward()
                grads.append([p.grad.clone() for p in m.parameters()])
            differ = sum(int((a != b).sum()) for a, b in zip(*grads))
            assert differ == 0, f"rank {rank}: {differ} gradient elements differ"
            dist.destroy_process_group()

        if __name__ == "__main__":
            probe = socket.socket()
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
            probe.close()
            mp.spawn(rank_main, args=(port, sys.argv[1]), nprocs=3)
    """)
    (tmp_path / "three.py").write_text(script)
    subprocess.run([sys.executable, str(tmp_path / "three.py"), str(tmp_path)], check=True,
                   timeout=280, cwd=Path(__file__).resolve().parents[2])
