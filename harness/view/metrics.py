"""The run's metrics for Prometheus, served over HTTP by the process that runs its controller while it runs
(health.metrics_port, --metrics-port; off by default). Each scrape reads the run's record as it is then --
state.json, attempts.json and health.json, which the controller's health loop rewrites twice a second -- so
serving adds no work to the run between scrapes, and what Prometheus sees is what `harness status` says.
The text format is prometheus-client's; docs/metrics.md lists the metrics and has a scrape config."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from harness.errors import UsageError
from harness.health.slowdown import Slowdown
from harness.record.goodput import goodput_of
from harness.record.liveness import live_status
from harness.record.rundir import RunDir
from harness.record.schema import GOODPUT_BUCKETS, Goodput, LiveHealth, RankRow, RecordError, RunStatus

RANK_LABELS = ["run_id", "rank", "node", "host"]
# Where the metrics are served where health.metrics_address says nothing: for this machine's own Prometheus; in a
# Kubernetes controller pod, on its own address (the NetworkPolicy says who may scrape it).
LOOPBACK, EVERY_INTERFACE = "127.0.0.1", "0.0.0.0"


class RunMetrics(Collector):
    """The metrics of one run, from its record at each scrape; before its record exists, none."""

    def __init__(self, run: RunDir) -> None:
        self.run = run

    def collect(self) -> Iterator[Metric]:
        try:
            state = self.run.read_state()
            health = self.run.read_health(state.attempt)
            goodput = goodput_of(self.run, state, None, time.time(), health)
        except (RecordError, FileNotFoundError):
            return
        run_id, now = state.run_id, time.time()
        status = live_status(state, self.run)
        info = GaugeMetricFamily("harness_run_info", "The run: 1, labelled with its name and target.",
                                 labels=["run_id", "name", "target"])
        info.add_metric([run_id, state.name, state.mode], 1)
        yield info
        states = GaugeMetricFamily("harness_run_status", "1 for the run's status, 0 for the others.",
                                   labels=["run_id", "status"])
        for each in RunStatus:
            states.add_metric([run_id, each.value], float(each is status))
        yield states
        yield _gauge("harness_run_attempt", "The running attempt's number (0: the first).", run_id, state.attempt)
        restarts = CounterMetricFamily("harness_run_restarts", "Attempts restarted after a failure.", labels=["run_id"])
        restarts.add_metric([run_id], state.attempt)
        yield restarts
        yield _gauge("harness_run_world_size", "Ranks of the running attempt.", run_id, state.world_size)
        yield from _time_spent(run_id, goodput)
        if health is not None:
            yield from _progress(run_id, health)
            yield from _pace(run_id, health)
            yield from _ranks(run_id, health.slow, self.run.read_rank_rows(health), now)


def _gauge(name: str, text: str, run_id: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, text, labels=["run_id"])
    family.add_metric([run_id], value)
    return family


def _time_spent(run_id: str, goodput: Goodput) -> Iterator[Metric]:
    yield _gauge("harness_run_goodput_ratio", "The share of the wall time spent in training steps not done again.",
                 run_id, goodput.goodput)
    spent = GaugeMetricFamily("harness_run_time_seconds", "Seconds of the run by where they went (docs/metrics.md).",
                              labels=["run_id", "bucket"])
    for bucket in GOODPUT_BUCKETS:
        spent.add_metric([run_id, bucket], goodput.seconds[bucket])
    yield spent


def _progress(run_id: str, health: LiveHealth) -> Iterator[Metric]:
    """The running attempt's furthest step, the run's last step and the time left, where the job's lines say."""
    progress = health.progress
    if progress is None:
        return
    yield _gauge("harness_run_step", "The furthest step any rank reported (health.progress).", run_id,
                 progress.last_step)
    if progress.total is not None:
        yield _gauge("harness_run_planned_steps", "The steps the run has in all, where its progress lines say "
                     "(`step 12/97`).", run_id, progress.total)
    if progress.rate is not None:
        yield _gauge("harness_run_steps_per_second", "The furthest rank's recent step rate.", run_id, progress.rate)
    if (left := progress.left_s()) is not None:
        yield _gauge("harness_run_eta_seconds", "Seconds to the run's last step at the recent step rate.", run_id,
                     round(left, 1))


def _pace(run_id: str, health: LiveHealth) -> Iterator[Metric]:
    """The job's pace now as a share of its pace before a rank named slow began to slow it (health/slowdown.py): 1
    while none is named slow; left out while the paces are not known (too few step lines)."""
    slowed = health.slowed
    ratio = 1.0 if slowed is None else Slowdown(slowed.since, slowed.pace_before, slowed.pace_now).ratio
    if ratio is not None:
        yield _gauge("harness_run_pace_ratio", "The job's step rate now over its rate before a rank named slow began "
                     "to slow it (1: no rank is named slow).", run_id, ratio)


def _ranks(run_id: str, slow: dict[int, float], rows: dict[int, RankRow], now: float) -> Iterator[Metric]:
    """Every rank's row (RunDir.read_rank_rows: past schema.SUMMED_PAST ranks, as of health-ranks.json but for the
    odd ranks); a value not known (no step printed, no GPU) is left out, not 0."""
    families = {
        "step": ("harness_rank_step", "The rank's step (health.progress)."),
        "step_rate": ("harness_rank_steps_per_second", "The rank's steps per second over the last minute."),
        "cpu": ("harness_rank_cpu_ratio", "CPUs the rank and its children used (1.0: one CPU all the time)."),
        "busy": ("harness_rank_busy_ratio", "The share of the time the rank's main thread ran (the rest it waited)."),
        "output_age": ("harness_rank_output_age_seconds", "Seconds since the rank's last line of output."),
        "step_age": ("harness_rank_step_age_seconds", "Seconds since the rank's last step line."),
        "idle": ("harness_rank_stalled_seconds", "Seconds the rank has made no progress (no CPU time or I/O)."),
        "slow": ("harness_rank_slow_ratio", "The share of the time its peers wait for it, for a rank named slow "
                                            "(0: not slow)."),
        "gpu_util": ("harness_rank_gpu_utilization_ratio", "The share of the SMs' time the rank ran kernels (NVML)."),
        "gpu_memory": ("harness_rank_gpu_memory_bytes", "GPU memory the rank holds (NVML)."),
        "loss": ("harness_rank_loss", "The loss the rank's last progress line said (health.progress)."),
        "throughput": ("harness_rank_throughput", "Items per second the rank's last progress line said "
                                                  "(the payload's img/s)."),
    }
    out = {key: GaugeMetricFamily(name, text, labels=RANK_LABELS) for key, (name, text) in families.items()}
    for rank, row in sorted(rows.items()):
        values = {
            "step": row.step, "step_rate": row.step_rate, "cpu": row.cpu, "busy": row.busy,
            "output_age": None if row.last_line_at is None else max(0.0, now - row.last_line_at),
            "step_age": None if row.step_at is None else max(0.0, now - row.step_at), "idle": row.idle,
            "slow": slow.get(rank, 0.0) / 100, "gpu_util": None if row.gpu_util is None else row.gpu_util / 100,
            "gpu_memory": row.gpu_memory, "loss": row.loss, "throughput": row.throughput,
        }
        for key, value in values.items():
            if value is not None:
                out[key].add_metric([run_id, str(rank), row.node, row.host], value)
    yield from out.values()


def metrics_url(address: str, port: int) -> str:
    """Where Prometheus finds the metrics: on every interface, at this machine's name."""
    host = socket.gethostname() if address in (EVERY_INTERFACE, "::") else address
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"


@contextmanager
def serving_metrics(run: RunDir, port: int | None, address: str) -> Iterator[str | None]:
    """The run's metrics on http://ADDRESS:PORT/metrics until the context ends, that URL given to the context (None:
    nothing listens). A port that cannot be had is an error before anything starts."""
    if port is None:
        yield None
        return
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RunMetrics(run))
    try:
        server, thread = start_http_server(port, address, registry)
    except OSError as exc:
        raise UsageError(f"health.metrics_port {port}: cannot serve the metrics on {address}: {exc.strerror or exc}") \
            from None
    try:
        yield metrics_url(address, port)
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
