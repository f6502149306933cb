"""Each rank's GPU use as the NVIDIA driver reports it (harness.node.gpu, read by the node agent): shown by
`harness status` while the job runs, served to Prometheus (health.metrics_port), kept in timeline.jsonl and
drawn by `harness report`; and an NCCL job's stream that holds its lines and the harness's, nothing else."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import assert_nothing_left, assert_only_the_jobs_lines, free_port, harness

pytestmark = pytest.mark.usefixtures("cuda")

SCRIPT = '''
import time

import torch
import torch.distributed as dist

dist.init_process_group("nccl")
torch.cuda.set_device(0)
a = torch.randn(4096, 4096, device="cuda")
end, step = time.monotonic() + 25, 0
while time.monotonic() < end:
    for _ in range(20):
        a = torch.tanh(a @ a)
    dist.all_reduce(a)
    torch.cuda.synchronize()
    step += 1
    if step % 10 == 0:
        print(f"step {step}", flush=True)
dist.destroy_process_group()
'''
ROW = re.compile(r"^ +0 node0 +sim0 +.+? +\d+% +(\d+)% +([\d.]+)GiB ", re.MULTILINE)


def test_a_ranks_gpu_use_is_shown_kept_and_drawn_and_its_stream_is_the_jobs_own(tmp_path: Path, launch) -> None:
    (tmp_path / "busy.py").write_text(SCRIPT)
    job, metrics_port = tmp_path / "job.yaml", free_port()
    job.write_text(f"name: busy\nnnodes: 1\nnproc_per_node: 1\nbackend: nccl\nmaster_port: {free_port()}\n"
                   f"entrypoint: {{script: busy.py}}\nhealth: {{stall: 60, metrics_port: {metrics_port}}}\n")
    run = launch(job, cwd=tmp_path)
    run.wait_for(r"\[rank0\]: step 10$", timeout=300)
    runs = str(tmp_path / "runs")
    # The first sample also covers the rank's start (context, NCCL's init), before its kernels ran back to back;
    # a later one covers only them. The deadline is a guard: the script runs its kernels for 25 s.
    deadline, rows, found = time.monotonic() + 20, [], None
    while time.monotonic() < deadline and not (found and int(found.group(1)) >= 20):
        found = ROW.search(status := harness("status", run.run_id, "--runs-dir", runs).stdout)
        rows += [found.group(0)] if found else []
        time.sleep(1)
    assert found and int(found.group(1)) >= 20, (rows, status)
    assert float(found.group(2)) >= 0.1, status  # a 64 MiB matrix
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as answer:
        served = {sample.name: sample for family in text_string_to_metric_families(answer.read().decode())
                  for sample in family.samples if sample.labels.get("rank") == "0"}
    assert served["harness_rank_gpu_utilization_ratio"].value >= 0.2, served
    assert served["harness_rank_gpu_memory_bytes"].value >= 0.1 * 2**30, served
    assert run.finish(timeout=120) == 0, run.output[-3000:]
    assert_only_the_jobs_lines(run.output)
    timeline = [json.loads(line) for line in (tmp_path / "runs" / run.run_id / "timeline.jsonl").read_text().splitlines()]
    assert any(sample["ranks"]["0"].get("gpu", 0) >= 20 for sample in timeline), timeline
    assert harness("report", run.run_id, "--runs-dir", runs).returncode == 0
    assert "GPU use (% of the SMs" in (tmp_path / "runs" / run.run_id / "report.html").read_text()
    assert_nothing_left(run.run_id)
