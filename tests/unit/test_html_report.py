"""`harness report`: a run's record and timeline as one HTML page that parses, fetches nothing, escapes the
record's strings, and shows the attempts, the health verdicts, the first failure and a chart per plot; also
for a run still running and for a run recorded before timeline.jsonl. A short run's course is drawn from its
start (the agent and the timeline sample every second while an attempt is young); a hang's page says its
verdict once, scales its flat step rate, and shows the stacks kept; the header says when the first step came."""

from __future__ import annotations

import http.server
import os
import re
import socketserver
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import replace
from html import escape
from html.parser import HTMLParser
from itertools import pairwise
from pathlib import Path

import pytest

from harness import cli
from harness.control import health_loop
from harness.control.health_loop import HealthLoop
from harness.control.live import LiveNode, RankActivity, StepMark
from harness.control.stack_capture import keep
from harness.health.judge import HealthJudge
from harness.health.rank_stack import Collective, Frame, RankStack, StackThread
from harness.node import observer
from harness.node.observer import RankObserver
from harness.node.proctable import start_ticks
from harness.node.protocol import HealthSamples, Kind, RankSample, parse_health
from harness.plan.planner import Node
from harness.record.index import create_run_dir
from harness.record.rundir import RunDir
from harness.record.schema import (
    Attempt,
    ControllerId,
    Failure,
    FailureKind,
    HealthEvent,
    HealthEventKind,
    LiveHealth,
    Progress,
    RankRow,
    RecordedNode,
    RunState,
    RunStatus,
    RunSummary,
    Slowed,
)
from harness.record.timeline import RankPoint, Sample, append_sample, read_drawn, read_timeline, sample_line
from harness.view import report
from harness.view.charts import TimeAxis, color
from harness.view.report import _spread_of, html_report

T0 = 1_700_000_000.0
HOSTILE = "RuntimeError: <script>alert('x')</script> & \"quoted\""
VOID = {"meta", "br", "hr", "img", "input", "link"}


class Balanced(HTMLParser):
    """Every element the page opens is closed, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.open: list[str] = []
        self.tags: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        if tag not in VOID:
            self.open.append(tag)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)

    def handle_endtag(self, tag: str) -> None:
        assert self.open and self.open[-1] == tag, f"</{tag}> closes <{self.open[-1] if self.open else None}>"
        self.open.pop()


def parsed(page: str) -> Balanced:
    parser = Balanced()
    parser.feed(page)
    parser.close()
    assert parser.open == [], f"never closed: {parser.open}"
    assert parser.tags[:2] == ["html", "head"]
    return parser


def fetches_nothing(page: str) -> None:
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, re.I)
    assert "http://" not in page and "https://" not in page and "url(" not in page and "@import" not in page


def _state(run_id: str, status: RunStatus, controller: ControllerId, attempt: int = 0) -> RunState:
    return RunState(run_id=run_id, name="train", mode="local", status=status, started_at=T0, nnodes=3, world_size=6,
                    controller=controller, hosts=["sim0", "sim1"], attempt=attempt)


def _node(run: RunDir, node_rank: int, ranks: list[int], attempt: int, exit_code: int | None) -> RecordedNode:
    return RecordedNode(node_rank=node_rank, host=f"sim{node_rank}", ranks=ranks, exit_code=exit_code,
                        signal=None if exit_code is not None else "SIGTERM", error=None, duration_s=9.5,
                        log=str(run.log_file(node_rank, attempt)))


def _summary(run: RunDir) -> RunSummary:
    """Attempt 0 on three nodes loses sim2 (a rank named slow, then recovered, before); attempt 1 goes on with
    two and fails in the program, the health watch having called a hang."""
    lost = Failure(node_rank=2, host="sim2", ranks=[4, 5], rank=None, rank_exit_code=None, exit_code=None,
                   description="lost its node agent", after_s=9.0, last_lines=[], kind=FailureKind.INFRA,
                   evidence="the agent's connection closed", host_down=True)
    first = Attempt(attempt=0, hosts=["sim0", "sim1", "sim2"], status=RunStatus.FAILED, started_at=T0 + 1,
                    ended_at=T0 + 11, nodes=[_node(run, 0, [0, 1], 0, None), _node(run, 1, [2, 3], 0, None),
                                             _node(run, 2, [4, 5], 0, None)],
                    failures=[lost], kind=FailureKind.INFRA, down=["sim2"], preflight_s=0.5, teardown_s=0.4,
                    backoff_s=2.0, nnodes=3, world_size=6,
                    health=[HealthEvent(at=T0 + 4, kind=HealthEventKind.SLOW, rank=3, waited=68.0,
                                        text="slow: rank 3 (node1 on sim1): its peers wait for it 68% of the time"),
                            HealthEvent(at=T0 + 7, kind=HealthEventKind.RECOVERED, rank=3,
                                        text="rank 3 (node1 on sim1) is no longer slow")])
    crash = Failure(node_rank=1, host="sim1", ranks=[2, 3], rank=3, rank_exit_code=3, exit_code=1,
                    description="exit code 3", after_s=6.0, last_lines=["[rank3]: step 40", f"[rank3]: {HOSTILE}"],
                    kind=FailureKind.PROGRAM, evidence="rank 3 exit code 3", error=HOSTILE,
                    error_at="train.py:13, in train_step", error_source="loss = model(x) / 0", hint="look at step 40")
    second = Attempt(attempt=1, hosts=["sim0", "sim1"], status=RunStatus.FAILED, started_at=T0 + 14, ended_at=T0 + 21,
                     nodes=[_node(run, 0, [0, 1], 1, None), _node(run, 1, [2, 3], 1, 1)], failures=[crash],
                     kind=FailureKind.PROGRAM, down=[], preflight_s=0.6, teardown_s=0.3, recover_s=4.9, nnodes=2,
                     world_size=4,
                     health=[HealthEvent(at=T0 + 19, kind=HealthEventKind.HANG,
                                         text="hang: rank 1 waits in all_reduce <b>while</b> rank 3 does not")])
    return RunSummary(run_id=run.run_id, name="train", status=RunStatus.FAILED, exit_code=1, started_at=T0,
                      ended_at=T0 + 21, duration_s=21.0, nodes=second.nodes, first_failure=crash,
                      attempts=[first, second], reason="a program failure is not restarted", error=HOSTILE)


def _timeline(run: RunDir, attempts: dict[int, tuple[float, int]]) -> None:
    """One sample a second per attempt (start, world size): CPU, busy and steps that move."""
    for attempt, (start, world) in attempts.items():
        for second in range(6):
            append_sample(run.timeline, Sample(start + second, attempt, {
                rank: RankPoint(cpu=0.9 + rank / 10, busy=0.5 if rank == 3 else 0.95, step=10 * second + rank)
                for rank in range(world)}))


def _ended(tmp_path: Path, timeline: bool = True) -> RunDir:
    run = create_run_dir(tmp_path, "train-1")
    run.write_state(_state(run.run_id, RunStatus.FAILED, ControllerId(1, None), attempt=1))
    run.write_summary(_summary(run))
    if timeline:
        _timeline(run, {0: (T0 + 2, 6), 1: (T0 + 15, 4)})
    return run


def test_past_drawn_ranks_a_chart_draws_the_ranks_spread_and_the_named_ones_and_the_page_stays_small(
        tmp_path: Path) -> None:
    """At 40 and at 400 ranks (rank 3 named slow, then failed): each chart draws the ranks' least, median and most at
    each sample and rank 3's own line, not a line a rank: the page is as large at 400 ranks as at 40 (it was 10x)."""
    pages = {}
    for world in (40, 400):
        run = create_run_dir(tmp_path / str(world), "train-1")
        run.write_state(_state(run.run_id, RunStatus.FAILED, ControllerId(1, None), attempt=1))
        run.write_summary(_summary(run))
        _timeline(run, {0: (T0 + 2, world), 1: (T0 + 15, world)})
        pages[world] = page = html_report(run)
        parsed(page)
        for chart in ("cpu", "waiting", "step-rate"):
            part = page[page.index(f'<div id="{chart}">'):]
            part = part[:part.index("</div>")]
            assert f"least of the {world} ranks" in part and "their median" in part and "rank 3<" in part, part[-600:]
            assert part.count("<polyline") == 4 * 2, "the spread's three lines and rank 3's, in each attempt"
    assert len(pages[400]) < 1.05 * len(pages[40]), {world: len(page) for world, page in pages.items()}
    assert _spread_of([[(1.0, [3.0, 1.0, 2.0]), (2.0, [5.0, 4.0])], []]) == [
        [[(1.0, 1.0), (2.0, 4.0)]], [[(1.0, 2.0), (2.0, 4.5)]], [[(1.0, 3.0), (2.0, 5.0)]]]


def test_a_large_jobs_spread_is_drawn_from_the_samples_of_every_rank_and_a_named_ranks_line_from_all(
        tmp_path: Path) -> None:
    """Past SUMMED_PAST ranks the timeline holds every rank every TABLE_SECONDS and the odd ranks alone between: the
    spread is drawn from the samples of every rank (a sample of rank 3 alone is no median of 400), rank 3's own line
    from every sample that has it; thinned, a long run keeps samples of every rank."""
    run = create_run_dir(tmp_path, "train-1")
    run.write_state(_state(run.run_id, RunStatus.FAILED, ControllerId(1, None), attempt=1))
    run.write_summary(_summary(run))
    for second in range(6):
        every = second in (0, 3)
        append_sample(run.timeline, Sample(T0 + 15 + second, 1, {
            rank: RankPoint(cpu=0.9 + rank / 1000 + second / 10, busy=0.95, step=10 * second)
            for rank in (range(400) if every else [3])}, every))
    page = html_report(run)
    part = page[page.index('<div id="cpu">'):]
    part = part[:part.index("</div>")]
    drawn = [len(points.split()) for points in re.findall(r'<polyline [^>]*points="([^"]*)"', part)]
    assert drawn == [2, 2, 2, 6], "the least, median and most at the two samples of every rank; rank 3 at all six"
    assert [sample.every for sample in read_timeline(run.timeline)] == [True, False, False, True, False, False]
    long = tmp_path / "long.jsonl"
    with long.open("w") as file:
        file.writelines(sample_line(Sample(T0 + second, 0, {}, second % 10 == 0)) for second in range(60))
    drawn = read_drawn(long, 6, report.MAX_POINTS)
    assert drawn.total == 60 and sum(sample.every for sample in drawn.samples) == 6 and len(drawn.samples) <= 12
    assert [sample.t for sample in drawn.samples] == sorted(sample.t for sample in drawn.samples)


def test_a_long_run_of_many_ranks_is_drawn_from_as_many_of_its_samples_as_the_points_allow(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A report reads at most MAX_POINTS ranks' points of the samples of every rank, evenly spread, and the samples
    of the odd ranks between up to MAX_SAMPLES: a day's timeline of 16,384 ranks is gigabytes, and the memory it
    took grew with the run. The page says how many of them it drew."""
    run = create_run_dir(tmp_path, "train-1")
    run.write_state(_state(run.run_id, RunStatus.FAILED, ControllerId(1, None), attempt=0))
    with run.timeline.open("w") as file:
        for second in range(200):
            every = second % 2 == 0
            file.write(sample_line(Sample(T0 + second, 0, {rank: RankPoint(cpu=0.5, busy=0.9, step=second)
                                                             for rank in (range(400) if every else [3])}, every)))
    drawn = read_drawn(run.timeline, 600, 4_000)
    assert drawn.total == 200 and sum(sample.every for sample in drawn.samples) == 10, "4,000 points of 400 ranks"
    assert sum(not sample.every for sample in drawn.samples) == 100
    assert drawn.samples[0].t == T0 and drawn.samples[-1].t == T0 + 199
    monkeypatch.setattr(report, "MAX_POINTS", 4_000)
    assert "110 of 200 samples drawn, evenly spread" in html_report(run)


def test_the_page_of_a_failed_restarted_run(tmp_path: Path) -> None:
    page = html_report(_ended(tmp_path))
    tags = parsed(page).tags
    fetches_nothing(page)
    assert tags.count("svg") == 4, "the timeline, CPU use, waiting, step rate"
    assert "attempt 0" in page and "attempt 1" in page
    assert "6 → 4" in page, "the world size, as it changed"
    assert "sim0, sim1, sim2" in page and "lost sim2" in page
    assert "slow: rank 3 (node1 on sim1): its peers wait for it 68% of the time" in page
    assert "rank 3 (node1 on sim1) is no longer slow" in page
    assert "train.py:13, in train_step" in page and "loss = model(x) / 0" in page and "look at step 40" in page
    assert "a program failure is not restarted" in page
    assert "failed: rank 3 exit code 3" in page, "each node's end, worded as `harness status` does"
    assert str(run_log := tmp_path / "train-1" / "node1.attempt1.log") in page, run_log


def test_every_string_of_the_record_is_escaped(tmp_path: Path) -> None:
    page = html_report(_ended(tmp_path))
    assert "<script" not in page and "<b>" not in page
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; &amp; &quot;quoted&quot;" in page
    assert "&lt;b&gt;while&lt;/b&gt;" in page


def test_a_run_recorded_before_timelines_gets_its_page_without_plots(tmp_path: Path) -> None:
    page = html_report(_ended(tmp_path, timeline=False))
    assert parsed(page).tags.count("svg") == 1, "the timeline of attempts only"
    assert "No plots: this run has no timeline.jsonl" in page
    assert "train.py:13, in train_step" in page


def test_a_running_run_gets_what_is_known_so_far(tmp_path: Path) -> None:
    run = create_run_dir(tmp_path, "train-2")
    me = ControllerId(os.getpid(), start_ticks(os.getpid()))  # a live controller: the run is running
    run.write_state(_state(run.run_id, RunStatus.RUNNING, me))
    run.health_file.write_text('{"attempt": 0, "slow": {"1": 72.5}, "hang": null}')
    append_sample(run.timeline, Sample(T0 + 2, 0, {0: RankPoint(0.5), 1: RankPoint(0.7)}))
    append_sample(run.timeline, Sample(T0 + 3, 0, {0: RankPoint(0.6), 1: RankPoint(0.8)}))
    page = html_report(run)
    tags = parsed(page).tags
    fetches_nothing(page)
    assert "Still running (attempt 0): this is what is known so far" in page
    assert "slow: rank 1: its peers wait for it 72.5% of the time" in page
    assert "node1" in page and "running" in page
    assert tags.count("svg") == 1, "CPU use; busy and steps were not measured"
    assert "No plot of waiting" in page and "No plot of the step rate" in page


def test_the_verb_writes_the_page_whole_where_asked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _ended(tmp_path)
    runs = ["--runs-dir", str(tmp_path)]
    assert cli.main(["report", run.run_id, *runs]) == 0
    assert capsys.readouterr().out == f"{run.html_report}\n"
    assert "train.py:13, in train_step" in run.html_report.read_text()
    assert cli.main(["report", run.run_id, *runs, "-o", str(tmp_path / "mine.html")]) == 0
    assert capsys.readouterr().out == f"{tmp_path / 'mine.html'}\n"
    assert "train.py:13, in train_step" in (tmp_path / "mine.html").read_text()
    assert cli.main(["report", run.run_id, *runs, "-o", "-"]) == 0
    assert capsys.readouterr().out.startswith("<!doctype html>")
    assert cli.main(["report", run.run_id, *runs, "-o", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert cli.main(["report", "train-404", *runs]) == 2
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")], "no temporary file left"


# --- a short run's course, from its start -------------------------------------------------------------


class Clock:
    """The clock a module reads (its `time`), moved on by the test."""

    def __init__(self, now: float) -> None:
        self.now = now

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now

    def time_ns(self) -> int:
        return int(self.now * 1e9)


def test_the_agent_samples_every_second_while_the_attempt_is_young(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its first sample within a second of the ranks, so a short run is seen from its start; then every WATCH
    seconds (5 by default)."""
    clock, waits = Clock(0.0), []

    class Minute:
        """The agent's wait between samples, on the test's clock: the attempt ends after a minute."""

        def wait(self, seconds: float) -> bool:
            waits.append(seconds)
            clock.now += seconds
            return clock.now > 60

    monkeypatch.setattr(observer, "time", clock)
    RankObserver("no-such-run", None, "not hooked", lambda kind, body: None).sample_every(5.0, Minute())
    assert waits[:30] == [1.0] * 30 and set(waits[30:]) == {5.0}, waits


def test_a_ranks_cpu_use_is_over_the_time_between_its_cpu_readings_however_long_its_recorder_takes(
        tmp_path: Path) -> None:
    """The agent reads each rank's CPU time, then its Flight Recorder, which a loaded rank takes up to READ_SECONDS to
    answer: a sample is dated when the CPU times were read. Dated after the recorder answered, a rank whose answers
    took 1 s, then none, alternately, used 6x a CPU over one interval and a sixth over the next (a loaded machine's
    report scaled its CPU chart to such a peak, and drew the rest on the zero line). Here one spinning rank."""
    answers = 0

    class Recorder(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            nonlocal answers
            answers += 1
            if answers % 4 == 1:  # the first of a sample's two handlers, every other sample
                time.sleep(1.0)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"entries": []}')

        def log_message(self, *args: object) -> None:
            pass

    server = socketserver.ThreadingUnixStreamServer(str(tmp_path / "0.sock"), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                               env={**os.environ, "HARNESS_RUN_ID": "cpu-readings", "RANK": "0"})
    said: list[HealthSamples] = []
    ended = threading.Event()

    def say(kind: Kind, body: str) -> None:
        if kind is Kind.HEALTH:
            said.append(parse_health(body))
            if len(said) == 7:
                ended.set()

    try:
        RankObserver("cpu-readings", str(tmp_path), "", say).sample_every(0.2, ended)
    finally:
        spinner.kill()
        spinner.wait()
        server.shutdown()
        server.server_close()
    rates = [(after.samples[0].cpu - before.samples[0].cpu) / (after.t - before.t)
             for before, after in pairwise(said[1:])]
    assert max(rates) <= 1.2 and max(rates) / min(rates) < 4, rates


def test_the_timeline_has_a_sample_as_soon_as_a_rank_is_known_then_one_a_second_while_young(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The health loop ticks twice a second; the agent samples every second from 2 s, so the judge sees each rank's
    CPU use from 3 s; rank 0 printed its first step at 1.5 s. Its CPU use is not known then: left out, not 0."""
    run = create_run_dir(tmp_path, "train-3")
    node = Node(host="sim0", address="127.0.0.1", node_rank=0, nproc=2)
    live = LiveNode(node, started=T0)
    judge, clock = HealthJudge(stall=300, slow=0), Clock(T0)
    monkeypatch.setattr(health_loop, "time", clock)
    loop = HealthLoop(judge, run, 0, [live], None, None, None)  # stacks, output, stopper: not used to write health
    for tick in range(1, 121):
        clock.now = T0 + tick / 2
        if tick == 3:
            live.activity[0] = RankActivity("step 0", clock.now, deque([StepMark(clock.now, 0)]))
        if tick % 2 == 0 and tick >= 4:
            judge.observe(node, clock.now, {rank: RankSample(100 + rank, "R", 0.9 * tick / 2, 0.8 * tick / 2, tick)
                                            for rank in node.ranks})
        loop._write_health()
    samples = read_timeline(run.timeline)
    assert [s.t - T0 for s in samples] == [1.5 + i for i in range(29)] + [34.5, 39.5, 44.5, 49.5, 54.5, 59.5]
    assert [s.ranks[0].cpu for s in samples[:3]] == [None, None, pytest.approx(0.9)]
    assert set(samples[0].ranks) == {0} and set(samples[2].ranks) == {0, 1}


def _chart(page: str, key: str) -> str:
    """The chart of one plot (its element id), or "" where the page has none."""
    found = re.search(rf'<div id="{key}">(.*?)</div>', page, re.S)
    return found.group(1) if found else ""


def test_one_sample_is_a_dot_to_be_seen_and_two_are_a_line(tmp_path: Path) -> None:
    """A rank's CPU use not measured yet is no point (not a 0): one measured sample is a dot, two a line."""
    run = create_run_dir(tmp_path, "train-4")
    run.write_state(_state(run.run_id, RunStatus.FAILED, ControllerId(1, None)))
    append_sample(run.timeline, Sample(T0 + 1, 0, {0: RankPoint(None, step=1)}))
    append_sample(run.timeline, Sample(T0 + 2, 0, {0: RankPoint(0.9, 0.5, step=3)}))
    cpu, steps = _chart(html_report(run), "cpu"), _chart(html_report(run), "step-rate")
    assert cpu.count("<circle") == 1 and "<polyline" not in cpu, cpu
    assert f'<circle fill="{color(0)}" r="3"' in cpu and f'<circle fill="{color(0)}" r="3"' in steps
    append_sample(run.timeline, Sample(T0 + 3, 0, {0: RankPoint(1.0, 0.5, step=5)}))
    cpu = _chart(html_report(run), "cpu")
    assert "<circle" not in cpu and cpu.count(f'<polyline fill="none" stroke="{color(0)}"') == 1, cpu


# --- a hang ------------------------------------------------------------------------------------------

VERDICT = ("no progress for 300 s: ranks 0,2,3 wait in all_reduce #1043 at train.py:55 in step; rank 1 (node0 on "
           "sim0) has not reached #1043, at train.py:42 in load_batch: time.sleep(60)")
SITE = "/venv/lib/python3.11/site-packages"
IN_ALL_REDUCE = (Frame("all_reduce", f"{SITE}/torch/distributed/distributed_c10d.py", 2950),
                 Frame("step", "train.py", 55, "dist.all_reduce(loss)"), Frame("<module>", "train.py", 80))
IN_SLEEP = (Frame("load_batch", "train.py", 42, "time.sleep(60)"), Frame("<module>", "train.py", 80))


def _hung(tmp_path: Path) -> RunDir:
    """A run of 2 nodes (ranks 0,1 and 2,3) that hung 14 s in, its stacks kept: ranks 0, 2 and 3 in all_reduce
    #1043, rank 1 asleep in its data loading; the job printed step 7 at 3 s and none after."""
    run = create_run_dir(tmp_path, "train-5")
    run.write_state(replace(_state(run.run_id, RunStatus.FAILED, ControllerId(1, None)), nnodes=2, world_size=4))
    nodes = [Node(host=f"sim{n}", address="127.0.0.1", node_rank=n, nproc=2) for n in (0, 1)]
    hang = Failure(node_rank=0, host="sim0", ranks=[0, 1], rank=1, rank_exit_code=None, exit_code=None,
                   description="hung", after_s=14.0, last_lines=["[rank1]: loading"], kind=FailureKind.HANG,
                   evidence=VERDICT)
    attempt = Attempt(attempt=0, hosts=["sim0", "sim1"], status=RunStatus.FAILED, started_at=T0 + 0.2,
                      ended_at=T0 + 16, nodes=[_node(run, 0, [0, 1], 0, None), _node(run, 1, [2, 3], 0, None)],
                      failures=[hang], kind=FailureKind.HANG, down=[], preflight_s=0.2, nnodes=2, world_size=4,
                      health=[HealthEvent(at=T0 + 14.2, kind=HealthEventKind.HANG, rank=1, text=f"hang: {VERDICT}")])
    run.write_summary(RunSummary(run_id=run.run_id, name="train", status=RunStatus.FAILED, exit_code=1, started_at=T0,
                                 ended_at=T0 + 16, duration_s=16.0, nodes=attempt.nodes, first_failure=hang,
                                 attempts=[attempt], reason="a hang is not restarted", error=VERDICT))
    for second in range(2, 15):
        append_sample(run.timeline, Sample(T0 + second, 0, {
            rank: RankPoint(0.01, 0.0, step=7 if second >= 3 else None) for rank in range(4)}))
    waiting = (Collective("0", 1042, "gloo:all_reduce", True, [[100]]),
               Collective("0", 1043, "gloo:all_reduce", False, [[100]]))
    stacks = {rank: RankStack(rank, nodes[rank // 2], 100 + rank, "S",
                              (StackThread("MainThread", 100 + rank, IN_SLEEP if rank == 1 else IN_ALL_REDUCE),),
                              collectives=waiting[:1] if rank == 1 else waiting) for rank in range(4)}
    keep(run, run.hang_stacks(0), stacks)
    return run


def test_a_hangs_verdict_is_said_once_and_pointed_at_elsewhere(tmp_path: Path) -> None:
    page = html_report(_hung(tmp_path))
    parsed(page)
    assert page.count(escape(VERDICT)) == 1, "said once, in full"
    assert re.search(r"<dt>hang</dt><dd>" + re.escape(escape(VERDICT)) + "</dd>", page), "at the top"
    assert "hung after 14.0 s (hang: the verdict above)" in page, "the first failure, the attempt's cause"
    assert "<td>hung: the verdict above</td>" in page and "<td>the verdict above</td>" in page, "the events"
    assert "failed: rank 1 hung" in page, "node0's end"


def test_a_step_rate_of_zeros_gets_a_scale_of_at_least_one_step_a_second(tmp_path: Path) -> None:
    steps = _chart(html_report(_hung(tmp_path)), "step-rate")
    ticks = re.findall(r'<text class="tick" x="\d+" y="[\d.]+" text-anchor="end">([^<]*)</text>', steps)
    assert ticks == ["0", "0.5", "1"], ticks


def test_a_hangs_stacks_are_on_its_page_alike_ranks_once_folded(tmp_path: Path) -> None:
    run = _hung(tmp_path)
    page = html_report(run)
    parsed(page)
    folded = re.search(r"<details><summary>(.*?)</summary>(.*?)</details>", page, re.S)
    assert folded, "the stacks, folded"
    assert folded.group(1) == f"attempt 0: 4 rank(s), 2 different stack(s), read when the hang was found (kept in " \
                              f"{run.hang_stacks(0)}/)"
    stacks = folded.group(2)
    assert "<h3>ranks 0,2,3: 0 (node0 on sim0, pid 100, sleeping, waiting in all_reduce #1043), 2 (node1 on sim1, " \
           "pid 102, sleeping, waiting in all_reduce #1043), 3 (node1 on sim1, pid 103, sleeping, waiting in " \
           "all_reduce #1043)</h3>" in stacks, stacks
    assert "<h3>rank 1: 1 (node0 on sim0, pid 101, sleeping)</h3>" in stacks, stacks
    assert stacks.count("all_reduce (torch/distributed/distributed_c10d.py:2950)") == 1
    assert stacks.count("time.sleep(60)") == 1


def test_a_damaged_kept_stack_is_said_so(tmp_path: Path) -> None:
    run = _hung(tmp_path)
    (run.hang_stacks(0) / "stacks.json").write_text("{")
    page = html_report(run)
    assert f"attempt 0: the stacks kept in <code>{run.hang_stacks(0)}</code> cannot be read (" in page


def with_progress(run: RunDir, *steps: tuple[float, int, float, int]) -> RunDir:
    """run's attempts with the steps their lines said, as the controller records them: (first_at, first_step, last_at,
    last_step) each, from T0; and no timeline, as after a gap of the record that lasted their whole training."""
    summary = run.read_summary()
    assert summary is not None
    attempts = [replace(a, progress=Progress(first, T0 + at, last, T0 + last_at))
                for a, (at, first, last_at, last) in zip(summary.attempts, steps, strict=True)]
    run.write_summary(replace(summary, attempts=attempts))
    run.timeline.unlink()
    return run


def test_the_header_says_when_the_first_step_came_and_the_step_rate_is_drawn_without_a_timeline(
        tmp_path: Path) -> None:
    """Where `harness status` reads them: the attempts' steps, 3 s after the start; a later attempt's after its own
    start. The timeline lost every step of them (a gap of the record), so each attempt's mean rate is drawn."""
    assert "<dt>first step</dt><dd>3.0 s after the run started</dd>" in \
        html_report(with_progress(_hung(tmp_path), (3, 7, 3, 7)))
    page = html_report(with_progress(_ended(tmp_path / "restarted"), (2, 0, 7, 50), (15, 10, 20, 30)))
    assert "<dt>first step</dt><dd>2.0 s after the run started; attempt 1: 1.0 s after it started</dd>" in page
    assert "no rank's step is known" not in page
    chart = _chart(page, "step-rate")
    assert "each attempt&#x27;s mean" in chart, chart
    assert len(re.findall(r"<polyline ", chart)) == 2, "a line of 10 steps/s, then one of 4 steps/s"


# --- where the time went, and the lines' loss and throughput --------------------------------------------------


def test_the_page_has_the_runs_time_as_one_bar_and_the_loss_and_throughput_over_steps(tmp_path: Path) -> None:
    """The restarted run's buckets as one bar, widths by their seconds; the loss and throughput rank 0 printed,
    over the steps, a new segment where attempt 1 resumed below the step attempt 0 reached."""
    run = _ended(tmp_path)
    for attempt, start, steps in ((0, T0 + 2, (10, 20, 30)), (1, T0 + 15, (20, 30, 40, 50))):
        for second, step in enumerate(steps):
            append_sample(run.timeline, Sample(start + 6 + second, attempt, {0: RankPoint(
                0.9, 0.9, step=step, loss=2.0 / step, throughput=1000.0 + step)}))
    page = html_report(run)
    parsed(page)
    spent = re.search(r'<div class="spent">(.*?)</div>', page, re.S)
    assert spent, page
    widths = dict(re.findall(r'<span class="b-([a-z-]+)" style="width:([\d.]+)%"', spent.group(1)))
    # no progress recorded: nothing trained; attempt 1 hung from its start to its verdict
    assert list(widths) == ["start-up", "hung", "restarting", "ending"], widths
    assert sum(map(float, widths.values())) == pytest.approx(100, abs=0.05)
    assert "goodput 0%: the share of 21.0 s" in page
    loss, throughput = _chart(page, "loss"), _chart(page, "throughput")
    assert loss.count("<polyline") == 2 and throughput.count("<polyline") == 2, loss  # one line per attempt
    assert ">step 0</text>" in loss and ">50</text>" in loss, "an axis of steps"
    assert "No plot" not in page.split('id="loss"')[1].split("</section>")[0]


# --- a slow node ---------------------------------------------------------------------------------------------

SUM = ("slow: rank 1 (node1 on sim1) for 20 s: the slowness costs 12 s by the job's end (1024 steps left at 5 instead "
       "of 6.67 steps/s); a restart without it 8 s (recovery 6.4 s + 0 steps redone): a restart without it costs less; "
       "stopping the job to restart without sim1 (restarts.on: slow)")


def _slowed(tmp_path: Path) -> RunDir:
    """3 nodes at 10 steps/s; rank 1 (sim1) slows the job to 5 from 20 s (its onset; named at 25 s), weighed at 40 s
    and acted on: the harness stops the job; attempt 1 runs on sim0 and sim2 from 45 s, at 10 steps/s again."""
    run = create_run_dir(tmp_path, "train-6")
    run.write_state(replace(_state(run.run_id, RunStatus.SUCCEEDED, ControllerId(1, None), attempt=1),
                            hosts=["sim0", "sim2"], nnodes=2, world_size=2))
    nodes = [_node(run, n, [n], 0, None) for n in range(3)]
    slow = Failure(node_rank=1, host="sim1", ranks=[1], rank=1, rank_exit_code=None, exit_code=None,
                   description="slow", after_s=39.0, last_lines=[], kind=FailureKind.SLOW,
                   evidence=SUM.removeprefix("slow: "), host_down=True)
    first = Attempt(attempt=0, hosts=["sim0", "sim1", "sim2"], status=RunStatus.FAILED, started_at=T0 + 1,
                    ended_at=T0 + 42, nodes=nodes, failures=[slow], kind=FailureKind.SLOW, down=["sim1"],
                    preflight_s=0.2, backoff_s=0.0, nnodes=3, world_size=3, progress=Progress(30, T0 + 3, 305, T0 + 41),
                    health=[HealthEvent(T0 + 25, HealthEventKind.SLOW, "slow: rank 1 (node1 on sim1): its peers wait "
                                        "for it 48% of the time", 1, 48.0, T0 + 20, 10.0, 5.0),
                            HealthEvent(T0 + 40, HealthEventKind.WEIGHED, SUM, 1, None, T0 + 20, 10.0, 5.0,
                                        acted=True)])
    second = Attempt(attempt=1, hosts=["sim0", "sim2"], status=RunStatus.SUCCEEDED, started_at=T0 + 42,
                     ended_at=T0 + 60, nodes=[_node(run, 0, [0], 1, 0), replace(_node(run, 1, [1], 1, 0), host="sim2")],
                     failures=[], kind=None, down=[], preflight_s=0.2, nnodes=2, world_size=2,
                     progress=Progress(300, T0 + 45, 440, T0 + 59, T0 + 46))
    run.write_summary(RunSummary(run_id=run.run_id, name="train", status=RunStatus.SUCCEEDED, exit_code=0,
                                 started_at=T0, ended_at=T0 + 60, duration_s=60.0, nodes=second.nodes,
                                 first_failure=None, attempts=[first, second]))
    for at in range(3, 42):
        step = 10 * at if at <= 20 else 200 + 5 * (at - 20)
        append_sample(run.timeline, Sample(T0 + at, 0, {rank: RankPoint(0.9, 0.9, step=step) for rank in range(3)}))
    for at in range(45, 60):
        append_sample(run.timeline, Sample(T0 + at, 1, {rank: RankPoint(0.9, 0.9, step=300 + 10 * (at - 45))
                                                        for rank in range(2)}))
    return run


def test_the_step_rate_shows_a_slowness_from_its_onset_to_the_harnesss_stop_and_the_stop_itself(
        tmp_path: Path) -> None:
    """Shaded from 20 s (the onset, not the 25 s it was named at) to 40 s (the stop), a red line at the stop named by
    the host the restart went without, both in the legend; the weighing a dot on the attempts' timeline, its sum in
    the events; the time the slowness cost a bucket of the bar."""
    page = html_report(_slowed(tmp_path))
    parsed(page)
    fetches_nothing(page)
    axis = TimeAxis(60.0)
    steps = _chart(page, "step-rate")
    band = re.findall(r'<rect class="slowed" x="([\d.]+)" y="[\d.]+" width="([\d.]+)" height="[\d.]+"><title>(.*?)'
                      r"</title></rect>", steps)
    assert len(band) == 1, steps
    x, width, title = band[0]
    assert float(x) == pytest.approx(axis.x(20), abs=0.1) and float(x) + float(width) == pytest.approx(axis.x(40),
                                                                                                       abs=0.2)
    assert title == "rank 1 (node1 on sim1) slow from +20.0 s to +40.0 s: the job at 0.50x its pace before", title
    act = re.search(r'<line class="act" x1="([\d.]+)"[^>]*/><text class="act" [^>]*text-anchor="end">(.*?)</text>',
                    steps)
    assert act and float(act[1]) == pytest.approx(axis.x(40), abs=0.1) and act[2] == "restart without sim1", steps
    assert "shaded: a rank named slow, from the onset of its slowness to its recovery" in steps
    assert "red line: the harness stopped the job to restart it without the slow host (restarts.on: slow" in steps
    assert re.search(r'<g class="weighed"><circle[^>]*/><title>\+40\.0 s weighed: ' + re.escape(escape(SUM)), page)
    assert '<span class="weighed">● slowness weighed against a restart</span>' in page
    assert re.search(r'<span class="b-slowed" style="width:[\d.]+%" title="slowed 10.0 s">', page), \
        "20 s at half the pace"
    assert "<td>node1</td><td>sim1</td><td>1</td><td>stopped for its slowness: rank 1 slowed the job (restarts.on: " \
           "slow)</td>" in page, "its node's end"
    assert f"(slow: {escape(SUM.removeprefix('slow: '))}); took sim1 out</td>" in page, "the attempt's cause"


def test_a_slowness_that_recovered_or_goes_on_is_shaded_without_a_stop(tmp_path: Path) -> None:
    """Recovered at 30 s: shaded to 30 s, no red line, no word of one. A running run's slowness (health.json's
    slowed) is shaded from its onset to now."""
    run = _slowed(tmp_path / "recovered")
    summary = run.read_summary()
    assert summary is not None
    first = summary.attempts[0]
    recovered = replace(first, failures=[], kind=None, down=[], status=RunStatus.SUCCEEDED, health=[
        first.health[0], HealthEvent(T0 + 30, HealthEventKind.RECOVERED, "rank 1 (node1 on sim1) is no longer slow",
                                     1)])
    run.write_summary(replace(summary, attempts=[recovered, summary.attempts[1]]))
    steps = _chart(html_report(run), "step-rate")
    band = re.search(r'<rect class="slowed" x="([\d.]+)" y="[\d.]+" width="([\d.]+)"', steps)
    axis = TimeAxis(60.0)
    assert band and float(band[1]) + float(band[2]) == pytest.approx(axis.x(30), abs=0.2), steps
    assert 'class="act"' not in steps and "red line" not in steps

    running = create_run_dir(tmp_path, "train-7")
    me = ControllerId(os.getpid(), start_ticks(os.getpid()))
    running.write_state(replace(_state(running.run_id, RunStatus.RUNNING, me), started_at=T0))
    running.write_health(LiveHealth(attempt=0, t=T0 + 30, slow={1: 48.0}, started_at=T0 + 1,
                                    ranks={1: RankRow("node1", "sim1", "computing")},
                                    slowed=Slowed(1, T0 + 20, 10.0, 5.0)))
    for second in range(3, 31):
        append_sample(running.timeline, Sample(T0 + second, 0, {1: RankPoint(0.9, 0.9, step=10 * second)}))
    page = html_report(running)
    parsed(page)
    steps = _chart(page, "step-rate")
    assert "rank 1 (node1 on sim1) slow from +20.0 s to +" in steps and "red line" not in steps, steps
