"""The layout's way from the leader agent through a real store to workers, and the CLI."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from elasticft.addon.api import AddOnContext, GroupInfo, WorkerInfo
from elasticft.cli import main as cli_main
from elasticft.config import ConfigError, ElasticftConfig, PinnedLayout, PlanConfig
from elasticft.plan.api import Layout, Pins
from elasticft.plan.collaborator import (
    LayoutAddOn,
    LayoutCollaborator,
    PlanInputs,
)
from elasticft.plan.presets import HARDWARE, MODELS
from elasticft.plan.worker import layout, layout_env

REPO = Path(__file__).resolve().parents[2]


def _group(rank: int, nodes: int, round_: int = 3) -> GroupInfo:
    workers = tuple(WorkerInfo(i, rank * 8 + i, nodes * 8) for i in range(8))
    return GroupInfo(run_id="r", node_id=f"n{rank}", run_dir=Path("/tmp"), round=round_,
                     group_rank=rank, group_world_size=nodes, restart_count=0, workers=workers)


@pytest.mark.timeout(60)
def test_leader_publishes_and_every_agent_gives_workers_the_same_layout() -> None:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    inputs = PlanInputs(model=MODELS["gpt-7.5b"], hardware=HARDWARE["a100-80g"])
    agents = [LayoutCollaborator(inputs, wait_timeout=timedelta(seconds=30)) for _ in range(4)]
    # A follower that would plan differently must still follow the leader's answer.
    agents[3].inputs = PlanInputs(model=MODELS["gpt-1.7b"], hardware=HARDWARE["cpu"])

    def join(rank: int) -> None:
        client = dist.TCPStore("127.0.0.1", server.port, is_master=False)
        agents[rank].on_rendezvous(_group(rank, 4), dist.PrefixStore("round3", client))

    followers = [threading.Thread(target=join, args=(r,)) for r in (1, 2, 3)]
    for t in followers:
        t.start()  # followers wait for the leader's key
    join(0)
    for t in followers:
        t.join(30)
    layouts = {a.layout for a in agents}
    assert len(layouts) == 1 and None not in layouts
    chosen = layouts.pop()
    assert chosen.gpus_used <= 32
    assert chosen.dp * chosen.grad_accum * chosen.micro_batch == 512
    env = agents[2].worker_env(_group(2, 4), _group(2, 4).workers[0])
    assert env == {"ELASTICFT_TP": str(chosen.tp), "ELASTICFT_PP": str(chosen.pp),
                   "ELASTICFT_DP": str(chosen.dp), "ELASTICFT_GRAD_ACCUM": str(chosen.grad_accum)}
    assert layout(env) == dataclasses.replace(chosen, micro_batch=1)


@pytest.mark.timeout(30)
def test_no_fitting_layout_is_published_as_a_reason_and_workers_get_no_layout() -> None:
    store = dist.HashStore()
    agent = LayoutCollaborator(PlanInputs(MODELS["gpt-145.6b"], HARDWARE["a100-80g"]))
    agent.on_rendezvous(_group(0, 1), store)
    assert agent.layout is None
    assert json.loads(store.get("elasticft/plan/layout"))["reason"] == "does_not_fit"
    assert agent.worker_env(_group(0, 1), _group(0, 1).workers[0]) == {}


def test_leader_rule_is_injected() -> None:
    store = dist.HashStore()
    agent = LayoutCollaborator(PlanInputs(None, HARDWARE["cpu"], Pins(tp=2)),
                               is_leader=lambda g: g.node_id == "n1")
    agent.on_rendezvous(_group(1, 2), store)  # group rank 1, but the chosen leader
    assert agent.layout == Layout(tp=2, pp=1, dp=8, grad_accum=1)


def from_options(plan: PlanConfig) -> LayoutCollaborator | None:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    from elasticft.torch_compat import LaunchConfig

    # devnull: without a log dir torch makes a /tmp/torchelastic_* directory nobody removes.
    launch = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1,
                          logs_specs=DefaultLogsSpecs(log_dir=os.devnull))
    return LayoutAddOn().build(AddOnContext(ElasticftConfig(plan=plan), launch, {}), {})


def test_options_build_the_collaborator_or_fail_in_one_line(tmp_path: Path) -> None:
    assert from_options(PlanConfig()) is None
    built = from_options(PlanConfig(plan_model="gpt-1.7b", plan_gpu_memory_gib=40.0,
                                    layout=PinnedLayout(tp=2)))
    assert built is not None and built.inputs.hardware.memory_gib == 40.0
    assert built.inputs.pins == Pins(tp=2)
    with pytest.raises(ConfigError, match="neither a preset"):
        from_options(PlanConfig(plan_model=str(tmp_path / "missing.json")))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"layers": 2, "hidden": 8, "heads": 2, "seq_len": 4,
                               "global_batch": 4, "hiden": 3}))
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['hiden'\]"):
        from_options(PlanConfig(plan_model=str(bad)))


def test_worker_layout_defaults_to_data_parallel_and_rejects_garbage() -> None:
    assert layout({"WORLD_SIZE": "6"}) == Layout(1, 1, 6, 1)
    with pytest.raises(ValueError, match="ELASTICFT_DP='x'"):
        layout({"ELASTICFT_TP": "2", "ELASTICFT_PP": "1", "ELASTICFT_DP": "x",
                "ELASTICFT_GRAD_ACCUM": "1"})
    assert layout(layout_env(Layout(2, 4, 3, 5))) == Layout(2, 4, 3, 5)


def test_import_elasticft_layout_stays_light() -> None:
    code = ("import sys, elasticft; l = elasticft.layout(); "
            "print(l.dp, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"WORLD_SIZE": "3", "PATH": "/usr/bin"}, check=True).stdout
    assert out.split() == ["3", "False"]


def test_cli_prints_ranked_layouts(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["plan", "--nodes", "4", "--gpus-per-node", "8", "--model", "gpt-7.5b",
                     "--top", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "gpt-7.5b" in lines[0] and "planned in" in lines[0]
    assert lines[1].split()[:4] == ["#", "TP", "PP", "DP"]
    times = [float(line.split()[6]) for line in lines[2:]]
    assert len(times) == 3 and times == sorted(times)
    assert cli_main(["plan", "--nodes", "1", "--gpus-per-node", "8", "--model", "gpt-7.5b",
                     "--tp", "3"]) == 2
    assert "tp=3 does not divide" in capsys.readouterr().err
    assert cli_main(["plan", "--nodes", "2", "--gpus-per-node", "2", "--model",
                     str(REPO / "examples" / "train_3d_model.json"), "--hardware", "cpu",
                     "--tp", "2", "--pp", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["layouts"][0]["layout"] == {"tp": 2, "pp": 1, "dp": 2, "grad_accum": 1,
                                            "micro_batch": 4}
