"""The agent releases what in-process recovery holds when it shuts down: its in-process
directory (the workers' records, the generation) and the generations' stores, however the run
ends."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

from elasticft import torch_compat
from elasticft.agent.agent import ElasticftAgent
from elasticft.config import ElasticftConfig
from elasticft.events import EventLog
from elasticft.inprocess.protocol import Generation, worker_file
from elasticft.jsonfile import write_json


def _agent(tmp_path: Path) -> ElasticftAgent:
    spec = torch_compat.worker_spec(role="r", local_world_size=1, entrypoint=sys.executable,
                                    args=(), rdzv_handler=None)
    return ElasticftAgent(
        spec, DefaultLogsSpecs(log_dir=str(tmp_path / "logs")), options=ElasticftConfig(),
        events=EventLog(tmp_path, "n"), node_id="n", run_dir=tmp_path)


@pytest.mark.parametrize("ending", ["returned", "raised"])
@pytest.mark.timeout(60)
def test_the_agent_closes_the_in_process_coordinator_when_it_shuts_down(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ending: str) -> None:
    agent = _agent(tmp_path)
    directory = agent.in_process.coordinator.directory
    closed: list[Path] = []
    close = agent.in_process.coordinator.close

    def close_and_note() -> None:
        closed.append(directory)
        close()

    monkeypatch.setattr(agent.in_process.coordinator, "close", close_and_note)

    def invoke_run(role: str = "default") -> torch_compat.RunResult:
        # What a run leaves there: a worker's record and the agent's generation.
        write_json(worker_file(directory, "armed", 0), {"pid": 1})
        Generation(1, "127.0.0.1", 1, 1).write(directory)
        assert not closed, "closed while the run was still going"
        if ending == "raised":
            raise RuntimeError("the run failed")
        return torch_compat.RunResult(state=torch_compat.WorkerState.FAILED)

    monkeypatch.setattr(agent, "_invoke_run", invoke_run)
    # torch's record of the workers' events asks the rendezvous for its id; there is none here.
    monkeypatch.setattr(agent, "_record_worker_events", lambda result: None)
    if ending == "raised":
        with pytest.raises(RuntimeError, match="the run failed"):
            agent.run()
    else:
        assert agent.run().state == torch_compat.WorkerState.FAILED
    assert closed == [directory]
    assert not directory.exists()
