"""A real Prometheus (Debian's package, started here on loopback ports) scrapes a running 2-node x 2-rank job's
metrics (--metrics-port) and answers, through its HTTP API, every rank's step rate and the run's state as the
run really was; the same run's `harness status` tells the time left within 20% of what it was, and its
summary's buckets add up to its wall time. The job runs on the stand-in torch (testbed/standin): what is measured
is the harness's, from the ranks' lines; Prometheus is real. (Nothing listens unless asked: test_detach.py.)"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import textwrap
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from conftest import (
    REPO,
    STANDIN_ENV,
    Launch,
    assert_nothing_left,
    assert_only_the_jobs_lines,
    free_port,
    harness,
    listening_sockets,
)

STEP_S = 0.25
STEPS = 40  # per epoch, two epochs: 20 s of steps at the script's own pace
# Every rank paces its steps by the clock (not by work: a busy machine slows work, not a deadline), prints its
# progress as the payload does, and keeps in step with the others through a barrier. And lines that name a step
# without being one: where it resumed, a checkpoint of rank 0's after every tenth step, an exception's text.
SCRIPT = textwrap.dedent(f"""
    import time
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    print("resume: no checkpoint yet, from step 0", flush=True)
    pace = time.monotonic()
    for epoch in range(1, 3):
        for step in range(1, {STEPS} + 1):
            pace += {STEP_S}
            time.sleep(max(0.0, pace - time.monotonic()))
            dist.barrier()
            print(f"epoch {{epoch}}/2 step {{step}}/{STEPS} loss {{1 / (step + epoch):.4f}}", flush=True)
            if rank == 0 and step % 10 == 0:
                print(f"checkpoint: step {{(epoch - 1) * {STEPS} + step}} saved in 0.000 s", flush=True)
            if rank == 1 and step == 15:
                print("RuntimeError: a data loader hiccup at step 15, retried", flush=True)
    dist.destroy_process_group()
""")
SCRAPE = """\
global: {{scrape_interval: 1s, scrape_timeout: 1s}}
scrape_configs:
  - job_name: harness
    static_configs: [{{targets: ["127.0.0.1:{port}"]}}]
"""


class Prometheus:
    """prometheus on a loopback port with its own data directory, stopped at the end of the test."""

    def __init__(self, root: Path, scrape_port: int) -> None:
        root.mkdir()
        (root / "prometheus.yml").write_text(SCRAPE.format(port=scrape_port))
        self.port, self.log = free_port(), root / "prometheus.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [shutil.which("prometheus") or "prometheus", f"--config.file={root / 'prometheus.yml'}",
                 f"--storage.tsdb.path={root / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
        self._wait(lambda: self._get("/-/ready").startswith("Prometheus Server is Ready"), "ready")

    def _get(self, path: str) -> str:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as answer:
                return answer.read().decode()
        except OSError:
            return ""

    def query(self, promql: str) -> list[dict]:
        """The instant vector Prometheus answers for promql now."""
        text = self._get("/api/v1/query?" + urllib.parse.urlencode({"query": promql}))
        return json.loads(text)["data"]["result"] if text else []

    def refused(self, promql: str) -> str | None:
        """Why Prometheus refuses promql (None: it takes it)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/api/v1/query?"
                                        + urllib.parse.urlencode({"query": promql}), timeout=5):
                return None
        except urllib.error.HTTPError as refusal:
            return json.loads(refusal.read())["error"]

    def _wait(self, ready, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            assert self.proc.poll() is None, f"prometheus ended: {self.log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"prometheus never {what}: {self.log.read_text()[-2000:]}"
            time.sleep(0.2)

    def wait_for(self, promql: str, count: int, timeout: float = 60) -> list[dict]:
        """promql's answer once it has count series."""
        answer: list[dict] = []

        def enough() -> bool:
            nonlocal answer
            answer = self.query(promql)
            return len(answer) >= count

        self._wait(enough, f"answered {count} series for {promql}", timeout)
        return answer

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def prometheus(tmp_path):
    started: list[Prometheus] = []

    def start(scrape_port: int) -> Prometheus:
        started.append(Prometheus(tmp_path / "prometheus", scrape_port))
        return started[-1]

    yield start
    for each in started:
        each.stop()


def test_prometheus_scrapes_every_ranks_step_rate_and_the_runs_state(tmp_path, prometheus):
    (tmp_path / "train.py").write_text(SCRIPT)
    port = free_port()
    server = prometheus(port)
    run = Launch(tmp_path / "train.py", tmp_path / "runs", "--nnodes", "2", "--nproc-per-node", "2",
                 "--metrics-port", str(port), "--env", f"PYTHONPATH={STANDIN_ENV['PYTHONPATH']}", cwd=tmp_path)
    try:
        run.wait_for(r"^\[node0\] \[rank0\]: epoch 1/2 step 12/")
        run_id = run.run_id
        first = run.output.splitlines()[:2]
        assert first[0] == f"harness: run {run_id}: metrics on http://127.0.0.1:{port}/metrics", first
        assert listening_sockets(run.proc.pid) == {("127.0.0.1", port)}, "the metrics on loopback alone, unless asked"
        rates = server.wait_for(f'harness_rank_steps_per_second{{run_id="{run_id}"}} > 0', 4)
        running = server.query(f'harness_run_status{{run_id="{run_id}"}} == 1')
        losses = server.query(f'harness_rank_loss{{run_id="{run_id}"}}')
        documented = re.search(r"^Some queries.*?```text\n(.*?)```", (REPO / "docs" / "metrics.md").read_text(),
                               re.S | re.M)
        assert documented, "docs/metrics.md's queries"
        refused = {query: why for query in documented.group(1).splitlines() if (why := server.refused(query))}
        assert not refused, refused
        run.wait_for(r"^\[node0\] \[rank0\]: checkpoint: step 20 saved")
        asked = time.time()
        status = harness("status", run_id, "--runs-dir", str(tmp_path / "runs")).stdout
        answered = time.time()
        assert run.finish(timeout=240) == 0, run.output
    finally:
        run.cleanup()
    assert_only_the_jobs_lines(run.output)
    assert_nothing_left(run_id)

    summary = json.loads((tmp_path / "runs" / run_id / "summary.json").read_text())
    progress = summary["attempts"][-1]["progress"]
    assert (progress["last_step"], progress["total"]) == (2 * STEPS, 2 * STEPS), progress
    real_rate = (progress["last_step"] - progress["first_step"]) / (progress["last_at"] - progress["first_at"])
    assert real_rate == pytest.approx(1 / STEP_S, rel=0.2), "the script's own pace"
    assert sorted(int(series["metric"]["rank"]) for series in rates) == [0, 1, 2, 3], rates
    for series in rates:
        assert float(series["value"][1]) == pytest.approx(real_rate, rel=0.3), series
        node = f"node{int(series['metric']['rank']) // 2}"
        assert (series["metric"]["node"], series["metric"]["host"]) == (node, f"sim{node[-1]}"), series
    assert [series["metric"]["status"] for series in running] == ["running"], running
    assert len(losses) == 4 and all(0 < float(series["value"][1]) < 0.5 for series in losses), losses

    # status, 20 of 80 steps in (rank 0's checkpoint line right after): step/total, the rate, the time left -- within
    # 20% of what was left when it looked, some moment between asked and answered (a busy machine takes seconds to
    # start the command).
    shown = re.search(r"^  progress: step (\d+)/80 \(\d+%\), ([\d.]+) steps/s, about (\d+) s left$", status, re.M)
    assert shown, status
    assert f"\n  metrics: http://127.0.0.1:{port}/metrics\n" in status, status
    most, least = progress["last_at"] - asked, progress["last_at"] - answered
    assert 0.8 * least <= int(shown.group(3)) <= 1.2 * most, (shown.group(0), f"{least:.1f} to {most:.1f} s were left")

    spent = summary["goodput"]["seconds"]
    assert sum(spent.values()) == pytest.approx(summary["duration_s"], rel=0.01), spent
    assert spent["training"] == pytest.approx(progress["last_at"] - progress["first_at"], abs=1.5), spent
    assert {bucket for bucket, seconds in spent.items() if seconds} == {"start-up", "training", "ending"}, spent
    status = harness("status", run_id, "--runs-dir", str(tmp_path / "runs")).stdout
    assert "  progress: step 80/80 (100%)\n" in status and \
        f"  time: {summary['duration_s']:.1f} s, goodput {100 * summary['goodput']['goodput']:.0f}%" in status, status
    ending = re.search(r"^  ending: ([\d.]+) s the job after its last step line \(its last save, evaluation, exit\), "
                       r"([\d.]+) s the harness \(the sweep of what was left, the record\)$", status, re.M)
    assert ending and float(ending[1]) + float(ending[2]) == pytest.approx(spent["ending"], abs=0.1), (status, spent)
