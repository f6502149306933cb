"""A disk that fills up or turns read-only, as real clusters' do (testbed/disk.py: a tmpfs of its own): the runs
directory's before a launch (refused in one line, nothing made), during a run (the job runs on, every line of a chatty
one on the terminal, the record marked incomplete, `harness status` names the run's real end), when an attempt starts
(it runs as on any disk), and a checkpoint folder's (the failure says which folder and
how much space was left, whatever words torch used)."""

from __future__ import annotations

import re
from pathlib import Path

from harness.payload.checkpoint import PREFIX
from testbed.disk import small_disk

from conftest import assert_nothing_left, free_port, harness

CHATTY_LINES = 5_000  # each rank's, of 100 bytes: 0.5 MB a rank, written twice by the record (node log, stream): 4x what the disk has left
CHATTY = "step {:05d}/" + f"{CHATTY_LINES} " + "x" * 83  # a step line: the record's progress, which the report reads
SCRIPT = f'''
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist

dist.init_process_group("gloo")
marks = Path(sys.argv[1])
rank = dist.get_rank()


def wait_for(name):
    while not (marks / name).exists():
        time.sleep(0.05)


if os.environ["HARNESS_ATTEMPT"] == "0":  # megabytes on a disk with a little room, then a failure
    print("ready", flush=True)
    for i in range({CHATTY_LINES}):
        print({CHATTY!r}.format(i + 1), flush=True)
    wait_for("full")
    sys.exit(3 if rank == 1 else 0)
print("on a full disk", flush=True)  # attempt 1, started on a disk that was full
dist.barrier()
wait_for("room")
while not (marks / "written-again").exists():  # each line a write the harness tries: it looks at the disk again
    print("waiting for the record", flush=True)
    time.sleep(0.5)
print("after the disk had room", flush=True)
dist.barrier()
dist.destroy_process_group()
'''


def test_a_full_runs_directory_refuses_the_launch_and_one_that_fills_during_a_run_keeps_the_job(
        tmp_path: Path, launch) -> None:
    """Nothing of the job writes to the runs directory's disk: a run started with its reserve and a little more,
    whose ranks print megabytes, loses none of their lines; its next attempt starts on the full disk."""
    marks = tmp_path / "marks"
    marks.mkdir()
    (tmp_path / "disk.py").write_text(SCRIPT)
    job = tmp_path / "job.yaml"
    job.write_text(f"name: disk\nnnodes: 2\nbackend: gloo\nmaster_port: {free_port()}\n"
                   f"restarts: {{max: 1, on: any, backoff: 0}}\n"
                   f"entrypoint: {{script: {tmp_path / 'disk.py'}, args: ['{marks}']}}\n")
    runs = tmp_path / "runs"
    with small_disk(runs, "16m") as disk:
        disk.fill()
        refused = launch(job)
        assert refused.finish() == 1, refused.output
        assert re.fullmatch(rf"harness: error: cannot create the run's record in {runs}/: No space left on device "
                            rf"\(\d+ (B|KiB) free of 16\.0 MiB; a run needs 4\.0 MiB there to start\)",
                            refused.output), refused.output
        disk.empty()
        disk.read_only()
        refused = launch(job)
        assert refused.finish() == 1 and "Read-only file system (read-only, " in refused.output, refused.output
        disk.read_only(False)
        assert [p.name for p in runs.iterdir()] == [], "a refused launch left its run's directory"

        disk.fill(leave=(4 << 20) + (512 << 10))  # the run's reserve, and half a MiB
        run = launch(job)
        said = run.wait_for(r"^harness: cannot write .* in (\S+): No space left on device \((\d+ (B|KiB)) free of "
                            r"16\.0 MiB\); the job runs on, its lines on this terminal only until the disk has room, "
                            r"and the run's record is incomplete$")
        run_dir = runs / run.run_id
        assert said.group(1) == str(run_dir)
        for rank in (0, 1):
            run.wait_for(rf"^\[node{rank}\] \[rank{rank}\]: {re.escape(CHATTY.format(CHATTY_LINES))}")
        disk.fill()
        (marks / "full").touch()
        run.wait_for(r"^\[node1\] \[rank1\]: on a full disk$")
        disk.empty()
        (marks / "room").touch()
        run.wait_for(rf"^harness: the run's record is written again in {run_dir} \(\d+\.\d MiB free of 16\.0 MiB\); "
                     rf"what came between \d\d:\d\d:\d\d and \d\d:\d\d:\d\d is on the terminal only$")
        (marks / "written-again").touch()
        assert run.finish() == 0, run.output
        assert "Traceback" not in run.output and "Errno 28" not in run.output, run.output
        for rank in (0, 1):  # every one, in order (torchrun's tee may echo a line it read before its end was written
            # in two parts, each with its prefix: `...xxx[rank0]: `)
            said_lines = [line for line in run.lines if line.startswith(f"[node{rank}] [rank{rank}]: step ")]
            assert len(said_lines) == CHATTY_LINES and all(
                line.startswith(f"[node{rank}] [rank{rank}]: " + CHATTY.format(i))
                for i, line in enumerate(said_lines, 1)), said_lines
        for log in (run_dir / "node1.attempt1.log", run_dir / "logs" / "attempt1" / "node1.log"):
            assert "after the disk had room" in log.read_text(), f"{log} was not written again"
        status = harness("status", run.run_id, "--runs-dir", str(runs)).stdout
        assert status.startswith(f"run {run.run_id}: succeeded "), status
        assert "attempt 1 on sim0, sim1" in status, status
        assert re.search(rf"warning: its record and logs in {run_dir} could not be written from \d\d:\d\d:\d\d to "
                         rf"\d\d:\d\d:\d\d \(No space left on device; \d+ (B|KiB) free of 16\.0 MiB\)", status), status
        assert not list(run_dir.glob(".reserve*")), "the run's reserve outlived it"
        # The steps of the gap, where status reads them: the report draws them too.
        assert f"  progress: step {CHATTY_LINES}/{CHATTY_LINES} (100%)\n" in status, status
        assert harness("report", run.run_id, "--runs-dir", str(runs)).returncode == 0
        page = (run_dir / "report.html").read_text()
        assert '<div id="step-rate">' in page and "no rank's step is known" not in page, page
        assert "<dt>first step</dt><dd>" in page, page
    assert_nothing_left(run.run_id)


def test_a_checkpoint_folder_that_fills_up_names_the_folder_and_the_space_left(tmp_path: Path, launch) -> None:
    """torch's own words for a short write are `unexpected pos 1664 vs 1568`; the payload's and the harness's
    name the folder, the space left and what the checkpoint takes, and nothing half-written is left there."""
    ckpt = tmp_path / "ckpt"
    job = tmp_path / "job.yaml"
    job.write_text(f"name: ckpt\nnnodes: 1\nbackend: gloo\nmaster_port: {free_port()}\nentrypoint:\n"
                   f"  module: harness.payload.train\n"
                   f"  args: [--data, synthetic, --subset, '256', --model, small, --epochs, '1', --max-steps, '4', "
                   f"--batch-size, '32', --log-every, '1', --ckpt-every, '2', --ckpt-dir, '{ckpt}']\n")
    with small_disk(ckpt, "1m") as disk:
        disk.fill()
        run = launch(job)
        assert run.finish() == 1, run.output
        left = [p.name for p in ckpt.iterdir() if p.name.startswith((PREFIX, f".{PREFIX}"))]
    failure = run.summary()["first_failure"]
    said = rf"checkpoint: cannot save step 2 in {ckpt}: its file system is full \(\d+ (?:B|KiB) free of 1\.0 MiB; the " \
           rf"checkpoint takes \d+ KiB\)"
    assert failure["kind"] == "infra" and re.search(f"a disk it writes to is full or read-only: .*{said}",
                                                    failure["evidence"]), failure
    assert failure["hint"].startswith("free space on that disk"), failure
    assert re.search(said, run.output), run.output
    assert left == [], f"a failed save left {left}"
    assert_nothing_left(run.run_id)
