"""Prometheus metrics of the diagnostics monitor: the series, the token, and a real scrape."""

from __future__ import annotations

import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from elasticft.diag.metrics import DiagMetrics, quantile
from tests.conftest import BIN, EXAMPLES, free_port


def _scrape(url: str, token: str | None = None) -> dict[str, list[tuple[dict[str, str], float]]]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as r:
        text = r.read().decode()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def test_quantile_is_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert quantile(values, 0.5) == 50.0
    assert quantile(values, 0.99) == 99.0
    assert quantile(values, 1.0) == 100.0
    assert quantile([3.0], 0.9) == 3.0
    assert quantile([], 0.5) != quantile([], 0.5)  # NaN


@pytest.mark.timeout(30)
def test_series_are_served_from_the_agents_own_registry_and_need_the_token():
    first, second = DiagMetrics(), DiagMetrics()
    first.recent_collectives = lambda: [0.004, 0.001, 0.002, 0.003]
    first.step(1, 7, 0.25)
    first.collective(0.003)
    first.detection("slow_rank")
    first.group(restarts=2, round_=3, workers=2)
    host, port = first.serve("127.0.0.1", 0, token="s3cret")
    try:
        assert host == "127.0.0.1"
        with pytest.raises(urllib.error.HTTPError) as denied:
            _scrape(f"http://{host}:{port}/metrics", token="wrong")
        assert denied.value.code == 401
        samples = _scrape(f"http://{host}:{port}/metrics", token="s3cret")
    finally:
        first.close()
    assert samples["elasticft_last_step"] == [({"rank": "1"}, 7.0)]
    assert ({"rank": "1"}, 1.0) in samples["elasticft_step_seconds_count"]
    assert samples["elasticft_collective_seconds_count"] == [({}, 1.0)]
    assert samples["elasticft_detections_total"] == [({"detector": "slow_rank"}, 1.0)]
    assert samples["elasticft_worker_restarts"] == [({}, 2.0)]
    latency = {labels["quantile"]: v
               for labels, v in samples["elasticft_collective_latency_seconds"]}
    assert latency == {"0.5": 0.002, "0.9": 0.004, "0.99": 0.004}
    # The second agent's registry saw none of it.
    assert "elasticft_last_step" not in {m.name for m in second.registry.collect()
                                         if any(True for _ in m.samples)}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_running_job_serves_real_step_and_collective_metrics(tmp_path: Path, job_env):
    port = free_port()
    log = tmp_path / "out.log"
    cmd = [str(BIN / "elasticft-run"), "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "0", "--monitor-interval", "0.1", "--run-dir", str(tmp_path / "run"),
           "--diag-metrics", str(port), str(EXAMPLES / "train_plain.py"), "--steps", "400",
           "--step-time", "0.05", "--ckpt-every", "1000", "--ckpt-dir", str(tmp_path / "ckpt")]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=job_env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/metrics"
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                samples = _scrape(url)
            except OSError:
                samples = {}
            steps = {labels["rank"]: v for labels, v in samples.get("elasticft_last_step", [])}
            if len(steps) == 2 and min(steps.values()) >= 20:
                break
            time.sleep(1.0)
        else:
            pytest.fail(f"no metrics with 20 steps per rank; last scrape {samples}\n"
                        f"{log.read_text()[-3000:]}")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    step_counts = {labels["rank"]: v for labels, v in samples["elasticft_step_seconds_count"]}
    step_sums = {labels["rank"]: v for labels, v in samples["elasticft_step_seconds_sum"]}
    assert set(step_counts) == {"0", "1"}
    for rank in ("0", "1"):
        # --step-time 0.05 sleeps in every step: the mean step is at least that long. Steps
        # before the monitor's first look at a ring count for the last step only.
        assert step_counts[rank] >= 10
        assert step_sums[rank] / step_counts[rank] >= 0.05
    assert samples["elasticft_collective_seconds_count"][0][1] >= 20
    latency = {labels["quantile"]: v
               for labels, v in samples["elasticft_collective_latency_seconds"]}
    assert 0 < latency["0.5"] <= latency["0.99"] < 10
    assert samples["elasticft_workers"] == [({}, 2.0)]
    assert samples["elasticft_worker_restarts"] == [({}, 0.0)]
