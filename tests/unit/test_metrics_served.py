"""The run's metrics as a scrape gets them (view/metrics.py): prometheus-client's own text, from a real run record,
parsed back. What a slow rank costs: the job's pace now over before, 1 while no rank is named slow and left out
while not known; every goodput bucket, `slowed` among them. Each metric a scrape gives is in docs/metrics.md.
(A real Prometheus scrapes a real run in tests/integration/test_metrics.py.)"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from harness.node.proctable import start_ticks
from harness.record.index import create_run_dir
from harness.record.rundir import RunDir
from harness.record.schema import (
    GOODPUT_BUCKETS,
    ControllerId,
    LiveHealth,
    Progress,
    RankRow,
    RunState,
    RunStatus,
    Slowed,
)
from harness.view.metrics import RunMetrics

REPO = Path(__file__).resolve().parents[2]


def _running(tmp_path: Path, slowed: Slowed | None, started: float) -> RunDir:
    """A run this process controls (so it is running), its health.json as the health loop writes it."""
    run = create_run_dir(tmp_path, "train-1")
    me = ControllerId(os.getpid(), start_ticks(os.getpid()))
    run.write_state(RunState(run_id=run.run_id, name="train", mode="local", status=RunStatus.RUNNING,
                             started_at=started, nnodes=2, world_size=2, controller=me, hosts=["sim0", "sim1"]))
    run.write_health(LiveHealth(
        attempt=0, t=time.time(), slow={} if slowed is None else {slowed.rank: 48.0},
        ranks={rank: RankRow(f"node{rank}", f"sim{rank}", "computing", step=400) for rank in (0, 1)},
        started_at=started + 1, progress=Progress(1, started + 5, 400, time.time(), rate=19.9, total=2000),
        slowed=slowed))
    return run


def _scraped(run: RunDir) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Each sample a scrape gives, by name and labels (run_id left out)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RunMetrics(run))
    found: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "run_id"))
            found.setdefault(sample.name, {})[labels] = sample.value
    return found


def test_a_slow_rank_shows_as_the_jobs_pace_over_its_pace_before_and_as_the_slowed_bucket(tmp_path: Path) -> None:
    """Rank 1 slowed the job from 39.2 to 19.9 steps/s 30 s ago: the pace gauge says 0.51, and the slowed bucket
    has those 30 s times the share lost."""
    now = time.time()
    run = _running(tmp_path, Slowed(1, now - 30, 39.2, 19.9), started=now - 60)
    scraped = _scraped(run)
    assert scraped["harness_run_pace_ratio"] == {(): pytest.approx(19.9 / 39.2)}
    spent = {dict(labels)["bucket"]: value for labels, value in scraped["harness_run_time_seconds"].items()}
    assert list(spent) == list(GOODPUT_BUCKETS) and "slowed" in spent
    assert spent["slowed"] == pytest.approx((time.time() - (now - 30)) * (1 - 19.9 / 39.2), abs=0.5)
    assert scraped["harness_rank_slow_ratio"][(("host", "sim1"), ("node", "node1"), ("rank", "1"))] == 0.48


def test_the_pace_is_1_while_no_rank_is_slow_and_left_out_while_not_known(tmp_path: Path) -> None:
    now = time.time()
    scraped = _scraped(_running(tmp_path / "healthy", None, started=now - 60))
    assert scraped["harness_run_pace_ratio"] == {(): 1.0}
    assert scraped["harness_run_time_seconds"][(("bucket", "slowed"),)] == 0.0
    unknown = _scraped(_running(tmp_path / "named", Slowed(1, now - 3, None, None), started=now - 60))
    assert "harness_run_pace_ratio" not in unknown, "a value not known is left out, not 1 or 0"
    assert unknown["harness_run_step"] == {(): 400.0}


def test_every_metric_a_scrape_gives_is_in_docs_metrics_md(tmp_path: Path) -> None:
    now = time.time()
    documented = (REPO / "docs" / "metrics.md").read_text()
    families = {name.removesuffix("_total") for name in _scraped(_running(tmp_path, Slowed(1, now - 30, 39.2, 19.9),
                                                                          started=now - 60))}
    assert families and not [name for name in families if f"`{name}" not in documented]
