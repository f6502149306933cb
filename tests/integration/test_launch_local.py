"""Local multi-node launch: torchrun agents over gloo on 127.0.0.1, supervised; where torch's own behaviour is not
what a test is about, on the stand-in torch of testbed/standin (ddp_job(standin=True))."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

from harness.node.link import control_socket
from harness.node.proctable import command_line, run_processes
from harness.node.protocol import Kind, message_line
from harness.record.timeline import read_timeline
from harness.view.charts import LEFT, RIGHT, WIDTH, TimeAxis, color

from conftest import (
    REPO,
    SCRIPT,
    Streamed,
    agent_pid,
    assert_nothing_left,
    assert_only_the_jobs_lines,
    assert_secret_kept,
    attack_store,
    harness,
    leftover,
    secret_looking_env,
    stragglers_s,
    with_secret,
    worker_pid,
)
from conftest import ddp_job as job
from resume_job import assert_same_weights, final_weights, payload_job

CHROMIUM = "chromium-headless-shell"  # the Makefile's TEST_APT_PACKAGES installs it


def test_two_nodes_train_over_gloo(write_yaml, launch, tmp_path):
    """With a secret from a file of the user's, which every rank has and nothing the harness writes or runs shows;
    and values that look secret written in env (one of each kind of name, conftest.SECRET_LOOKING), which every rank
    has too, in no command line while it runs, and which the run's spec and plans show as ***: launch says once of
    each that it looks like a secret. Every rank waits for the rank hook's worker server (torch's own) to serve in
    it: the stream holds the job's lines and the harness's, none of torch's."""
    env = secret_looking_env()
    spec, secret = with_secret(job(write_yaml, nproc=2, STEPS="12", SPIN_SECONDS="0.25", AWAIT_RANK_HOOK="1",
                                   SHOW_DIGEST=",".join(env), **env), f"{{file: {tmp_path / 'hf-token'}}}")
    (tmp_path / "hf-token").write_text(secret + "\n")
    run = launch(spec)
    assert run.finish() == 0, run.output
    assert_only_the_jobs_lines(run.output)
    assert_secret_kept(secret, run.output, 4, run.runs_dir)
    for name, value in env.items():
        assert_secret_kept(value, run.output, 4, run.runs_dir, name=name)
        assert run.output.count(f"harness: env.{name} looks like a secret: the harness shows it as *** and puts it on "
                                f"no command line, but {spec} holds it in clear; secrets: takes it from") == 1
    shown = [(run.runs_dir / run.run_id / name).read_text() for name in ("spec.yaml", "plan.txt", "plan.json")]
    assert all(text.count("***") >= len(env) for text in shown), shown
    weights = set(re.findall(r"\[node(\d)\] \[rank(\d)\]: rank \2 final loss \S+ weights (\[.*\])", run.output))
    assert {(n, r) for n, r, _ in weights} == {("0", "0"), ("0", "1"), ("1", "2"), ("1", "3")}, run.output
    assert len({w for _, _, w in weights}) == 1, "DDP replicas diverged"
    assert "; args=['--tag', 'two words', '$$', '${local_rank}', '$(x)']" in run.output
    run_dir = run.runs_dir / run.run_id
    assert {p.name for p in run_dir.iterdir()} >= {"spec.yaml", "plan.json", "node0.log", "node1.log", "summary.json"}
    node1 = (run_dir / "node1.log").read_text()
    assert "[rank3]: rank 3 final loss" in node1
    assert "[c10d] Server listening to UNIX " in node1, "the server was up: its line in the node's log, not the stream"
    summary = run.summary()
    assert (summary["status"], summary["exit_code"], summary["first_failure"]) == ("succeeded", 0, None)
    assert [n["exit_code"] for n in summary["nodes"]] == [0, 0]
    assert_nothing_left(run.run_id)
    assert harness("report", run.run_id, "--runs-dir", str(run.runs_dir)).returncode == 0
    _a_short_runs_cpu_chart_has_lines_from_its_first_sample(run_dir, summary, tmp_path)


def _a_short_runs_cpu_chart_has_lines_from_its_first_sample(run_dir: Path, summary: dict, tmp_path: Path) -> None:
    """The report of this short run (3 s of steps, its nodes' imports done while it was checked), as a browser draws
    it: its CPU chart has lines of the ranks' colors, above 0, from the x of the ranks' first sample on. The health
    watch sampled every 5 s once: no rank's CPU use was known before 10 s (two samples), and the chart of a run this
    short was empty. Judged on what was sampled, not on wall time, which a busy machine's sampling delays: the ranks
    are sampled every second from their start, so their first sample knows their CPU use, however busy the machine
    (rank 0's step lines, its steps alone, may come before it)."""
    samples = read_timeline(run_dir / "timeline.jsonl")
    known = [s for s in samples if any(p.cpu is not None for p in s.ranks.values())]
    assert known and all(s.ranks.keys() <= {0} for s in samples[:samples.index(known[0])]), \
        f"the first sample of the ranks knew no CPU use: {samples[:3]}"  # before it, rank 0's step lines alone
    axis = TimeAxis(max(summary["ended_at"] - summary["started_at"], 1.0))  # the axis of report.html_report
    first, last = (axis.x(s.t - summary["started_at"]) for s in (known[0], known[-1]))
    rows = _cpu_chart_pixels(run_dir / "report.html", tmp_path)
    top, bottom = 18, 220 - 24  # the plot's area in charts.line_chart, less the line at 0
    colors = [tuple(int(color(i)[at:at + 2], 16) for at in (1, 3, 5)) for i in range(4)]
    drawn = sorted({x for y in range(top, bottom - 4) for x in range(LEFT, WIDTH - RIGHT + 1)
                    if any(all(abs(rows[y][3 * x + c] - rgb[c]) <= 48 for c in range(3)) for rgb in colors)})
    assert drawn and abs(drawn[0] - first) <= 4, f"the lines start at x {drawn[:1]}, the first sample at {first:.0f}"
    assert len(drawn) >= max(30, 0.8 * (last - first)), \
        f"{len(drawn)} column(s) of the ranks' lines between the first and last samples' x {first:.0f} and {last:.0f}"


def _cpu_chart_pixels(page: Path, tmp_path: Path) -> list[bytes]:
    """The top of the report page as headless Chromium draws it, its CPU chart's SVG pinned to the top left corner
    over the rest (CSS added to a copy of the page) so that the chart's pixels are where charts.py put them: the
    chart's rows, RGB."""
    assert shutil.which(CHROMIUM), f"{CHROMIUM} is missing: `make test` installs it (TEST_APT_PACKAGES)"
    pinned, png = tmp_path / "pinned.html", tmp_path / "page.png"
    pinned.write_text(page.read_text().replace("</style>", "#cpu svg{position:absolute;top:0;left:0;background:#fff}</style>", 1))
    chromium = subprocess.Popen([CHROMIUM, "--headless", "--no-sandbox", "--hide-scrollbars", f"--screenshot={png}",
                                 "--window-size=1000,2400", f"--user-data-dir={tmp_path / 'chromium'}",
                                 pinned.as_uri()], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        assert chromium.wait(timeout=60) == 0, "chromium failed"
    finally:
        if chromium.poll() is None:
            os.killpg(chromium.pid, signal.SIGKILL)
            chromium.wait()
    return _png_rows(png, 220)


def _png_rows(path: Path, count: int) -> list[bytes]:
    """The first count rows of an 8-bit RGB or RGBA PNG without interlacing (as Chromium writes them), unfiltered,
    as RGB."""
    data, at, packed = path.read_bytes(), 8, b""
    while at < len(data):
        length, kind = struct.unpack(">I4s", data[at:at + 8])
        if kind == b"IHDR":
            width, _, depth, mode, _, _, interlace = struct.unpack(">IIBBBBB", data[at + 8:at + 21])
        elif kind == b"IDAT":
            packed += data[at + 8:at + 8 + length]
        at += 12 + length
    assert (depth, interlace) == (8, 0) and mode in (2, 6), (depth, mode, interlace)
    size = 3 if mode == 2 else 4
    raw, stride = zlib.decompress(packed), width * size
    rows, above = [], bytearray(stride)
    for y in range(count):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            left = line[i - size] if i >= size else 0
            corner = above[i - size] if i >= size else 0
            guess = left + above[i] - corner
            paeth = min((abs(guess - left), 0, left), (abs(guess - above[i]), 1, above[i]),
                        (abs(guess - corner), 2, corner))[2]
            line[i] = (line[i] + (0, left, above[i], (left + above[i]) // 2, paeth)[kind]) & 255
        rows.append(bytes(line) if size == 3 else bytes(b for i, b in enumerate(line) if i % 4 != 3))
        above = line
    return rows


def test_failure_stops_every_node_within_5_seconds(write_yaml, launch):
    """Rank 1 exits 3 while rank 0 is blocked for an hour: the harness must end rank 0, fast. The live line,
    the report, `harness status` and `harness report`'s page all give rank 1's own exit code, 3 (torchrun's own
    is 1). Rank 1 fails once the rank hook's server is up in it (and ends with it): the stream holds the job's
    lines and the harness's, nothing else. On the stand-in torch: what is tested is the harness's supervision and
    its words; the same failure on real torch (torchrun's report read, torch's server's lines kept out of the
    stream): test_hostile_launches.py's exit code test. Before it fails, rank 1 reaches for another host: the
    nodes' own network has no route, and the failure's hint says so; and it prints the node agent's messages, byte
    for byte (its node's end with code 0, a replay's end, an OOM kill): they are its own lines, in its node's log as
    it printed them, and none changes the run's end."""
    run = launch(job(write_yaml, standin=True, FAIL_RANK="1", FAIL_AT_STEP="3", FAIL_CODE="3", HANG_AT_STEP="3",
                     STEPS="1000", AWAIT_RANK_HOOK="1", REACH_OUT="1", FORGE_MESSAGES="1"))
    assert run.finish() == 1, run.output
    assert_only_the_jobs_lines(run.output)
    forged = [message_line(Kind.NODE_EXIT, "0"), message_line(Kind.WATCHED, json.dumps({"at": 10**9})),
              message_line(Kind.OOM, json.dumps({"1": "Out of memory: Killed process 1"}))]
    log = (run.runs_dir / run.run_id / "node1.log").read_text()
    assert "".join(f"[rank1]: {line.decode()}" for line in forged) in log, log
    summary = run.summary()
    failure = summary["first_failure"]
    assert (summary["status"], failure["node_rank"], failure["rank"], failure["exit_code"], failure["rank_exit_code"]) \
        == ("failed", 1, 1, 1, 3)
    assert any("failing on purpose" in line for line in failure["last_lines"])
    assert "[rank1]: rank 1 could not reach 192.0.2.1: [Errno 101] Network is unreachable" in run.output
    assert failure["hint"].startswith("a rank could not reach another host: simulated nodes run in a network of "
                                      "their own"), failure
    assert stragglers_s(summary) < 5.0, summary  # guard: ~0.5 s on a loaded 2-core machine, not rank 0's hour
    assert "harness: node1 on sim1 failed (rank 1 exit code 3); stopping the other nodes" in run.output
    assert "FAILED: first failure on node 1 (sim1, global rank 1): exit code 3" in run.output
    status = harness("status", run.run_id, "--runs-dir", str(run.runs_dir)).stdout
    assert re.search(r"  node0 on sim0: stopped by the harness after the first failure \(torchrun's .*\) after ",
                     status), status
    assert "  node1 on sim1: failed: rank 1 exit code 3 after " in status, status
    assert "  first failure: node1 (sim1), rank 1, exit code 3 (program: rank 1 exit code 3)" in status, status
    assert "exit code 1" not in run.output + status, "torchrun's code is not the rank's"
    report = harness("report", run.run_id, "--runs-dir", str(run.runs_dir))
    page = run.runs_dir / run.run_id / "report.html"
    assert report.returncode == 0 and report.stdout == f"{page}\n", report.stdout + report.stderr
    assert "node 1 (sim1, global rank 1): exit code 3 after " in page.read_text()
    assert "failing on purpose" in page.read_text()
    assert_nothing_left(run.run_id)


def test_stop_and_status_from_another_terminal(write_yaml, launch):
    """`harness stop` (SIGTERM to the controller), the one stop path that Ctrl-C shares (unit/test_stop_signals.py:
    both signals; unit/test_runs.py: what status says of each). Meanwhile another local user cannot reach a rank's
    hook, whose socket is in its agent's private directory (docs/security.md)."""
    run = launch(job(write_yaml, standin=True, STEPS="100000", STEP_SECONDS="0.05", AWAIT_RANK_HOOK="1"))
    hook = run.wait_for(r"\[rank0\]: rank 0: rank hook at (\S+)").group(1)
    run.wait_for(r"\[rank0\]: step 5 ")
    reach = f"import socket; socket.socket(socket.AF_UNIX).connect({hook!r})"
    assert subprocess.run([sys.executable, "-c", reach], timeout=30).returncode == 0, "the job's own user reaches it"
    other = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", reach],
                           capture_output=True, text=True, timeout=30)
    assert other.returncode != 0 and "PermissionError" in other.stderr, other.stderr
    assert len(leftover(run.run_id)) >= 4  # two agents, two workers
    runs = ["--runs-dir", str(run.runs_dir)]
    listing = harness("status", *runs)
    assert re.search(rf"{run.run_id}\s+running\s+2", listing.stdout), listing.stdout
    stopped = harness("stop", run.run_id, *runs)
    assert stopped.returncode == 0, stopped.stderr
    assert run.finish(timeout=15) == 130
    assert_nothing_left(run.run_id)
    detail = harness("status", run.run_id, *runs)
    assert f"run {run.run_id}: stopped" in detail.stdout
    for node in (0, 1):
        assert f"  node{node} on sim{node}: stopped by `harness stop` (" in detail.stdout, detail.stdout
    assert "running" not in detail.stdout, detail.stdout
    assert harness("stop", run.run_id, *runs).stdout.strip() == f"run {run.run_id} already ended: stopped"
    assert harness("stop", "no-such-run", *runs).returncode == 2


def test_a_killed_controllers_nodes_train_on_unwatched_and_attach_takes_them_back(uninterrupted, launch, tmp_path):
    """The payload job's controller SIGKILLed at step 10: each agent holds its node (supervision.grace), which trains
    on while no controller watches, and `harness status` says so; `harness attach` takes the run back and it ends as
    if nothing had happened: one attempt, the final weights bitwise equal to the uninterrupted run's, every step line
    of rank 0 in the logs once (those in flight at the kill sent again), the time unwatched in the record. Meanwhile
    another local user reaches neither the job's store nor its agent's socket (docs/security.md)."""
    run = launch(payload_job(tmp_path / "job"))
    run.wait_for(r"\[rank0\]: epoch 1/2 step 10/32 ")
    assert f"should this controller be lost, the nodes run on for 300 s (supervision.grace): `harness attach " \
           f"{run.run_id}` takes them back" in run.output, run.output
    health = run.runs_dir / run.run_id / "health.json"
    # The controller has seen steps and their rate (its second sample with a step: the projection below needs it).
    while not re.search(r'"progress": \{[^}]*"rate": \d', health.read_text() if health.exists() else ""):
        time.sleep(0.05)
    # Stopped first, so that what rank 0 says next is in flight (in the pipe, unread) when it is killed.
    lost_at = time.time()  # the controller's last sight of the run: its health watch ticks no more
    os.kill(run.proc.pid, signal.SIGSTOP)
    agent = control_socket(run.run_id, "0", "0", tempfile.gettempdir())
    assert agent is not None
    assert not (run.runs_dir / run.run_id / "torchrun").exists(), "the ranks' output went to the run's record"
    assert list((Path(agent).parent / "torchrun").glob("*/attempt_0/0/stdout.log")), "torchrun's copy: the agent's"
    # How far the nodes are, from their checkpoints (every 4 steps): torchrun's copy of the output is no witness, the
    # agent gives back what torchrun has read of it (a hole, where the test may not have looked yet).
    ckpt = tmp_path / "job" / "ckpt"

    def saved_step() -> int:
        return max((int(path.stem.removeprefix("ckpt-")) for path in ckpt.glob("ckpt-*.pt")
                    if path.stem.removeprefix("ckpt-").isdigit()), default=0)  # not the stop's .jit.pt

    while saved_step() < 12:
        time.sleep(0.05)
    os.kill(run.proc.pid, signal.SIGKILL)
    run.finish()
    # The job's own network outlives its controller: another local user still cannot reach the job's store.
    assert attack_store(run.runs_dir / run.run_id, tmp_path / "pwned").startswith("refused 127.0.0.1:")
    runs = ["--runs-dir", str(run.runs_dir)]
    for later in (12, 16):  # the seconds since the loss, counted as the nodes train on (not since their last line)
        while saved_step() < later:
            time.sleep(0.05)
        asked = time.time()
        status = harness("status", run.run_id, *runs).stdout
        unwatched = re.match(rf"run {run.run_id}: running, unwatched for (\d+) s ", status)
        assert unwatched and asked - lost_at - 2 <= int(unwatched[1]) <= time.time() - lost_at + 2, (status, lost_at)
        # where the record last saw it, and where that rate puts it now
        assert re.search(r"^  progress: step \d+/64 \(\d+%\) when last watched \d+ s ago; at [\d.]+ steps/s about "
                         r"step \d+ now, about \d+ s left$", status, re.M), status
    assert f"held up to 300 s: `harness attach {run.run_id}`)" in status, status
    for node in (0, 1):
        assert f"  node{node} on sim{node}: running, held by its node agent until a controller takes it back" in status
    assert re.search(rf"{run.run_id}\s+unwatched\s+2 ", harness("status", *runs).stdout)
    # Who may take a node back: the job's user naming the run; another user cannot reach the socket, and a
    # connection that names another run is closed without a word.
    control = control_socket(run.run_id, "1", "0", tempfile.gettempdir())
    assert control is not None
    reach = f"import socket; socket.socket(socket.AF_UNIX).connect({control!r})"
    other = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", reach],
                           capture_output=True, text=True, timeout=30)
    assert other.returncode != 0 and "PermissionError" in other.stderr, other.stderr
    with socket.socket(socket.AF_UNIX) as wrong:
        wrong.settimeout(30)
        wrong.connect(control)
        wrong.sendall(b"ATTACH another-run\n")
        assert wrong.recv(100) == b""
    attached = Streamed([sys.executable, "-m", "harness.cli", "attach", run.run_id, *runs])
    try:
        assert attached.finish(timeout=240) == 0, attached.output
    finally:
        attached.kill_group()
    said = attached.output
    assert said.startswith(f"harness: run {run.run_id}: taking back 2 node(s) x 1 process(es) on sim0, sim1"), said
    assert re.search(rf"harness: run {run.run_id}: taken back by {attached.proc.pid}@\S+; its controller was lost "
                     rf"[\d.]+ s before; the \d+ line\(s\) its nodes said meanwhile are in its logs", said), said
    assert f"harness: run {run.run_id} succeeded" in said, said
    assert_same_weights(uninterrupted, final_weights(tmp_path / "job"))
    summary = json.loads((run.runs_dir / run.run_id / "summary.json").read_text())
    (attempt,) = summary["attempts"]
    (unwatched,) = attempt["unwatched"]
    assert attempt["status"] == "succeeded" and unwatched["lost_at"] < unwatched["attached_at"], attempt
    assert summary["goodput"]["seconds"]["unwatched"] > 0, summary["goodput"]
    # Every one, once, in order, in the record and the node's own log: those in flight at the kill sent again.
    every = [f"{epoch}/2 step {step}/32" for epoch in (1, 2) for step in range(1, 33)]
    logs = harness("logs", run.run_id, *runs).stdout
    assert re.findall(r"\[node0\] \[rank0\]: epoch (\d/2 step \d+/32) ", logs) == every, logs
    node_log = (run.runs_dir / run.run_id / "node0.log").read_text()
    assert re.findall(r"\[rank0\]: epoch (\d/2 step \d+/32) ", node_log) == every, node_log
    assert_nothing_left(run.run_id)
    assert "running" not in harness("status", run.run_id, *runs).stdout


def test_a_killed_node_agent_fails_the_run_and_leaves_nothing(write_yaml, launch):
    """An agent killed by hand cannot stop its node; the controller sees it end unreported and sweeps. Here a warm
    node's (attempt 1, after a rank was killed), whose processes the standby started carry its identity
    (`standby-sim1`), not the node's: its rank, stopped so that only the sweep can end it, is swept too. On the
    stand-in torch: the agent and the sweep are the harness's."""
    text = job(write_yaml, standin=True, STEPS="100000", STEP_SECONDS="0.05").read_text()
    run = launch(write_yaml(text + "restarts: {max: 1, backoff: 0, standby: 0}\n", "warm.yaml"))
    run.wait_for(r"\[rank0\]: step 5 ")
    deadline = time.monotonic() + 60
    while len([pid for pid in run_processes(run.run_id, attempt="1") if "harness-agent" in command_line(pid)]) < 2 \
            and time.monotonic() < deadline:  # the standbys of attempt 1
        time.sleep(0.1)
    os.kill(worker_pid(run.run_id, 1), signal.SIGKILL)
    run.wait_for(r"^harness: sim0, sim1 started warm: ")
    run.wait_for(r"^\[node0\] \[rank0\]: step 5 ", after=run.wait_for(r"^harness: run \S+ attempt 1"))
    os.kill(worker_pid(run.run_id, 1), signal.SIGSTOP)
    agent = agent_pid(run.run_id, "standby-sim1")
    os.kill(agent, signal.SIGKILL)
    assert run.finish(timeout=30) == 1, run.output
    failure = run.summary()["attempts"][1]["failures"][0]
    assert failure["node_rank"] == 1
    assert failure["description"] == (f"node agent (pid {agent}) ended with killed by SIGKILL without reporting "
                                      f"the node's end")
    assert_nothing_left(run.run_id)


def test_a_node_frozen_before_a_static_rendezvous_is_named_at_the_deadline_and_fails_the_attempt(write_yaml, launch):
    """node1's torchrun stopped while it imports (an agent stuck on a hung file system): torch's static rendezvous
    would wait its own 600 s. The harness's deadline is timeouts.rendezvous, whatever the rendezvous kind: the node
    is named with what its torchrun is doing, the attempt fails as infra, nothing is left."""
    deadline = 30
    text = job(write_yaml).read_text() + f"rdzv: static\ntimeouts: {{rendezvous: {deadline}}}\n"
    run = launch(write_yaml(text, "frozen.yaml"))
    torchrun = None
    while torchrun is None and run.proc.poll() is None:  # in its imports: torch's library mapped, its modules to come
        torchrun = next((pid for pid in run_processes(run.run_id, "1") if "standby.py" in command_line(pid)
                         and "libtorch" in Path(f"/proc/{pid}/maps").read_text()), None)  # its standby: torchrun
        time.sleep(0.01)
    assert torchrun is not None, run.output
    os.kill(torchrun, signal.SIGSTOP)
    status, guard = "", time.monotonic() + deadline  # guard: the row is there from the first health.json on
    while time.monotonic() < guard and not re.search(r"\n +1 node1 +sim1 +starting ", status):
        status = harness("status", run.run_id, "--runs-dir", str(run.runs_dir)).stdout
    assert re.search(r"\n +1 node1 +sim1 +starting ", status), status
    assert run.finish(timeout=deadline + 60) == 1, run.output
    said = run.wait_for(r"^harness: rendezvous: the rendezvous did not complete within 30 s \(timeouts.rendezvous\): "
                        r"node1 on sim1 never joined: its torchrun \(pid (\d+)\) is stopped \(SIGSTOP\), in an import at "
                        r"\S+:\d+(; node0 waiting for it in the rendezvous)?$")
    assert int(said.group(1)) == torchrun
    failure = run.summary()["first_failure"]
    assert (failure["node_rank"], failure["kind"], failure["host_down"], failure["description"]) == (
        1, "infra", True, "did not join the rendezvous"), failure
    # guard: torch's static rendezvous waits 600 s; the deadline is 30 s, then the stop's grace and a capture
    assert failure["after_s"] < deadline + 20, failure
    assert_nothing_left(run.run_id)


def test_a_missing_script_fails_before_anything_starts(write_yaml, tmp_path):
    path = write_yaml("name: x\nnnodes: 1\nentrypoint: {script: nope.py}\n")
    result = harness("launch", str(path), "--runs-dir", str(tmp_path / "runs"))
    assert result.returncode == 1
    assert f"entrypoint nope.py: {REPO / 'nope.py'} does not exist" in result.stderr
    assert not (tmp_path / "runs").exists()


def test_a_script_that_does_not_compile_or_is_misspelt_is_refused_before_any_node_starts(tmp_path):
    """The first attempt's standbys start while the check runs (strace sees their agents); the check's failure ends
    them: no process of the run and no agent's directory is left."""
    (tmp_path / "train.py").write_text("import torch\nfor step in range(3)\n    print(step)\n")
    (tmp_path / "tmp").mkdir()
    execs = tmp_path / "execve.log"
    result = subprocess.run(["strace", "-f", "-qq", "--seccomp-bpf", "-e", "trace=execve", "-e", "signal=none", "-o",
                             str(execs), sys.executable, "-m", "harness.cli", "launch", "train.py", "--nnodes", "2",
                             "--runs-dir", str(tmp_path / "runs")], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120, env=os.environ | {"TMPDIR": str(tmp_path / "tmp")})
    assert result.returncode == 1, result.stdout
    assert (f"fingerprint  FAIL    entrypoint train.py does not compile: {tmp_path / 'train.py'}:2: expected ':' "
            f"(SyntaxError)") in result.stderr, result.stderr
    assert "nothing was started" in result.stderr and not (tmp_path / "runs").exists()
    agents = re.findall(r'"harness-agent", "([^"]+)", "node", "(\d)"', execs.read_text())  # none starts cold before
    assert sorted(node for _, node in agents) == ["0", "1"], execs.read_text()[-3000:]
    assert leftover(agents[0][0]) == [] and list((tmp_path / "tmp").iterdir()) == []
    typo = harness("launch", "trian.py", "--nnodes", "2", "--runs-dir", str(tmp_path / "runs"), cwd=tmp_path)
    assert typo.returncode == 1 and f"{tmp_path / 'trian.py'} does not exist (did you mean train.py?)" in typo.stderr


def test_the_smoke_job_detached_outlives_the_launch(tmp_path):
    """jobs/smoke.yaml as shipped (the real payload on synthetic data, 2 simulated nodes, offline), as the README
    launches it in the background. (A detached run stopped: test_runs_anywhere.py.)"""
    runs = ["--runs-dir", str(tmp_path / "runs")]
    done = harness("launch", str(REPO / "jobs" / "smoke.yaml"), "--detach", *runs)
    assert done.returncode == 0, done.stderr
    run_id = re.search(r"run (\S+) started in the background", done.stdout).group(1)
    summary = tmp_path / "runs" / run_id / "summary.json"
    deadline = time.monotonic() + 90
    while not summary.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    status = harness("status", run_id, *runs).stdout
    assert status.startswith(f"run {run_id}: succeeded"), status
    assert "  node0 on sim0: succeeded (exit 0)" in status and "  node1 on sim1: succeeded (exit 0)" in status
    streamed = (tmp_path / "runs" / run_id / "controller.log").read_text()
    assert re.search(r"\[node0\] \[rank0\]: done: test_acc=\S+ global_step=8 world_size=2", streamed), streamed
    assert not re.search(r"\[node1\] \[rank1\]: (train|epoch|done)", streamed), "only rank 0 prints progress"
    assert_nothing_left(run_id)


def test_an_nccl_job_on_a_machine_without_gpus_is_refused_before_anything_starts(tmp_path):
    """`make launch JOB=jobs/cifar.yaml` as a new user types it on a CPU machine: one line, exit 2."""
    result = harness("launch", str(REPO / "jobs" / "cifar.yaml"), "--runs-dir", str(tmp_path / "runs"))
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr == ("harness: error: backend nccl needs CUDA GPUs and this machine has none: set "
                             "`backend: gloo` (or auto) to run the simulated nodes on CPU, or launch on GPU hosts "
                             "with --hosts\n")
    assert result.stdout == "" and not (tmp_path / "runs").exists()


def test_a_missing_module_or_data_path_fails_with_the_preflight_rows(write_yaml, tmp_path):
    """The SSH backend's fast checks, on this machine: the same rows, before any node starts."""
    text = job(write_yaml).read_text().replace(f"script: {SCRIPT}", "module: no_such_trainer")
    text += "data_paths: [data/cifar10]\n"
    result = harness("launch", str(write_yaml(text, "bad.yaml")), "--runs-dir", str(tmp_path / "runs"),
                     cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.startswith("harness: error: preflight failed, nothing was started:")
    assert re.search(rf"localhost\s+fingerprint\s+FAIL\s+entrypoint no_such_trainer: module no_such_trainer is "
                     rf"not importable from {tmp_path}", result.stderr), result.stderr
    assert re.search(rf"localhost\s+data\s+FAIL\s+data/cifar10 is missing in {tmp_path}", result.stderr)
    assert "`harness prepare --data-dir data/cifar10`" in result.stderr
    assert not (tmp_path / "runs").exists()
