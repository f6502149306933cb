"""Bring your own script: scripts written the way public DDP examples are, through `harness launch` for real. Where
what is tested is the harness's part (the arguments it gives, the directories) rather than torch's, the job runs on the
stand-in torch (conftest.STANDIN_ENV)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from harness.control.worker_output import NO_CUDA_HINT

from conftest import REPO, STANDIN_ENV, assert_nothing_left, free_port, harness

SCRIPTS = REPO / "tests" / "scripts"
STANDIN = f"env: {{PYTHONPATH: '{STANDIN_ENV['PYTHONPATH']}'}}\n"  # a job's line that puts it on the stand-in torch


def own_job(write_yaml, script: str, *, nproc: int = 1, extra: str = "", standin: bool = False) -> Path:
    return write_yaml(f"name: byo\nnnodes: 2\nnproc_per_node: {nproc}\nbackend: gloo\nmaster_port: {free_port()}\n"
                      f"entrypoint:\n  script: {SCRIPTS / script}\n{extra}{STANDIN if standin else ''}")


def test_a_script_that_hard_codes_nccl_fails_with_the_hint_on_a_cpu_machine(write_yaml, launch):
    run = launch(own_job(write_yaml, "byo_hardcoded_nccl.py"))
    assert run.finish() == 1, run.output
    failure = run.summary()["first_failure"]
    assert failure["error"] == "RuntimeError: nccl2 requires at least one CUDA device", failure
    assert failure["error_at"] == f"{SCRIPTS / 'byo_hardcoded_nccl.py'}:12, in main"
    assert failure["error_source"] == 'dist.init_process_group(backend="nccl")'
    assert failure["hint"] == NO_CUDA_HINT
    assert f"harness: hint: {NO_CUDA_HINT}" in run.output
    assert run.output.count("Traceback (most recent call last):") == 1, "both ranks fail alike: one traceback shown"
    assert_nothing_left(run.run_id)


def test_exiting_0_without_a_process_group_is_no_distributed_success(write_yaml, launch):
    run = launch(own_job(write_yaml, "byo_not_enough_gpus.py"))
    assert run.finish() == 0, run.output
    assert "Unable to locate sufficient 2 gpus to run this example. Exiting." in run.output
    warning = ("it did not run distributed: none of its 2 ranks joined a process group (no init_process_group "
               "reached the rendezvous store at MASTER_ADDR:MASTER_PORT)")
    summary = run.summary()
    assert summary["warnings"] == [warning] and summary["attempts"][0]["joined_ranks"] == []
    assert re.search(rf"harness: run {run.run_id} succeeded in \S+ s, but {re.escape(warning)}; logs in", run.output)
    status = harness("status", run.run_id, "--runs-dir", str(run.runs_dir)).stdout
    assert f"  warning: {warning}\n" in status, status


def test_a_distributed_run_is_seen_joining_and_torchs_info_log_stays_out_of_the_stream(write_yaml, launch):
    """DDP logs at INFO after joining too, then with torch's own rank prefix: none of it in the stream."""
    run = launch(own_job(write_yaml, "ddp_sum.py", extra="  args: [--tag, x]\n"))
    assert run.finish() == 0, run.output
    summary = run.summary()
    assert summary["warnings"] == [] and summary["attempts"][0]["joined_ranks"] == [0, 1]
    assert "[c10d]" not in run.output and "[I1" not in run.output and "Reducer" not in run.output, run.output
    log = (run.runs_dir / run.run_id / "node0.log").read_text()
    assert "The client socket has connected" in log and "[rank0]: [I" in log and "Reducer" in log


def test_local_rank_arg_gives_every_worker_its_own_local_rank(write_yaml, launch):
    """2 nodes x 2 processes: each worker gets --local_rank=<its LOCAL_RANK> before the job's args. On the stand-in
    torch: the argument is the harness's, and the stand-in torchrun fills in its ${local_rank} as torchrun does
    (string.Template)."""
    job = own_job(write_yaml, "byo_local_rank_arg.py", nproc=2,
                  extra="  local_rank_arg: --local_rank\n  args: [--epochs, 3]\n", standin=True)
    run = launch(job)
    assert run.finish() == 0, run.output
    got = sorted(re.findall(r"\[rank(\d)\]: rank \1 got --local_rank (\d) epochs 3", run.output))
    assert got == [("0", "0"), ("1", "1"), ("2", "0"), ("3", "1")], run.output
    assert_nothing_left(run.run_id)


def test_a_deep_traceback_is_reported_by_the_users_own_frame(write_yaml, launch):
    run = launch(own_job(write_yaml, "byo_deep_traceback.py"))
    assert run.finish() == 1, run.output
    failure = run.summary()["first_failure"]
    script = SCRIPTS / "byo_deep_traceback.py"
    assert failure["error"].startswith("RuntimeError: addmm: mat1 and mat2 shapes cannot be multiplied"), failure
    assert failure["error_at"] == f"{script}:13, in train_step"
    assert failure["error_source"].startswith("loss = model(batch).sum()")
    assert not any(str(script) in line for line in failure["last_lines"][-10:]), "the tail alone would lose it"
    report = run.output[run.output.index(f"harness: run {run.run_id} FAILED:"):].splitlines()
    assert report[:4] == [
        f"harness: run {run.run_id} FAILED: {failure['error']}",
        f"    at {script}:13, in train_step",
        f"        {failure['error_source']}",
        f"harness: first failure on node {failure['node_rank']} (sim{failure['node_rank']}, global rank {failure['rank']}): "
        f"exit code 1 after {failure['after_s']} s (program)",
    ], report
    status = harness("status", run.run_id, "--runs-dir", str(run.runs_dir)).stdout
    assert f"  error: {failure['error']} at {script}:13, in train_step\n" in status, status
    assert "ChildFailedError" not in run.output and "Root Cause" not in run.output
    log = (run.runs_dir / run.run_id / f"node{failure['node_rank']}.log").read_text()
    assert "ChildFailedError" in log and "Root Cause (first observed failure)" in log, "torchrun's report: log only"
    assert not re.search(r"\[rank\d\]: \[rank\d\]: ", run.output + log), "one rank prefix per line"
    assert_nothing_left(run.run_id)


def test_simulated_nodes_can_each_have_a_working_directory(write_yaml, launch, tmp_path):
    """Both nodes write out/node.txt by the same relative name; with own workdirs the files stay apart (the script
    imports no torch, and torchrun is the stand-in's)."""
    script = tmp_path / "write_own.py"
    script.write_text("import os, pathlib\npathlib.Path('out').mkdir(exist_ok=True)\n"
                      "pathlib.Path('out/node.txt').write_text(os.environ['NODE_RANK'] + ' ' + os.getcwd())\n")
    job = write_yaml(f"name: own-dirs\nnnodes: 2\nbackend: gloo\nmaster_port: {free_port()}\n"
                     f"entrypoint: {{script: write_own.py}}\nsimulated: {{workdir: 'nodes/n{{node_rank}}'}}\n{STANDIN}")
    rendered = json.loads(harness("render", str(job), "--format", "json", cwd=tmp_path).stdout)
    assert [n["workdir"] for n in rendered["nodes"]] == [str(tmp_path / "nodes/n0"), str(tmp_path / "nodes/n1")]
    assert all(str(script) in n["argv"] for n in rendered["nodes"]), "the script stays the launch directory's"
    run = launch(job, cwd=tmp_path)
    assert run.finish() == 0, run.output
    for rank in (0, 1):
        written = (tmp_path / f"nodes/n{rank}/out/node.txt").read_text()
        assert written == f"{rank} {tmp_path / f'nodes/n{rank}'}"
    plan = json.loads((run.runs_dir / run.run_id / "plan.json").read_text())
    assert [n["workdir"] for n in plan["nodes"]] == [str(tmp_path / "nodes/n0"), str(tmp_path / "nodes/n1")]
    shared = json.loads(harness("render", str(write_yaml("name: shared\nnnodes: 2\nentrypoint: {script: x.py}\n",
                                                         "shared.yaml")), "--format", "json", cwd=tmp_path).stdout)
    assert [n["workdir"] for n in shared["nodes"]] == [str(tmp_path)] * 2, "no more workdir: null"
