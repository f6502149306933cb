"""The harness from Python, used as its users use it: examples/ddp-notebook.ipynb run top to bottom by a real Jupyter
kernel (nbclient), then the kernel's interrupt stopping a job and a launch after it in the same kernel; a script of its
own driving a detached function run (status, logs, stop, report, as `harness status` tells them); a function on SSH
hosts in network namespaces. Each launch here is a function launch: its call and results travel through real
agents."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import nbformat
from jupyter_core.utils import run_sync
from nbclient import NotebookClient

from harness.api.function import launched_dir, prune_launched
from testbed.cluster import Cluster

from conftest import REPO, assert_nothing_left, harness

NOTEBOOK = REPO / "examples" / "ddp-notebook.ipynb"
KERNEL_SECONDS = 300  # for any one cell: a launch on a busy machine


def _outputs(cell: nbformat.NotebookNode) -> str:
    """A cell's output as its reader sees it: streams, results, and an error's name, value and traceback."""
    parts = []
    for output in cell.outputs:
        if output.output_type == "stream":
            parts.append(output.text)
        elif output.output_type == "execute_result":
            parts.append(output.data.get("text/plain", ""))
        elif output.output_type == "error":
            parts.append(f"{output.ename}: {output.evalue}")
    return "".join(parts)


def _iopub_until(client: NotebookClient, msg_id: str, seen: re.Pattern[str]) -> str:
    """The cell's output, read until seen appears in it."""
    text = ""
    while not seen.search(text):
        msg = run_sync(client.kc.get_iopub_msg)(timeout=KERNEL_SECONDS)
        if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream":
            text += msg["content"]["text"]
    return text


def _reply(client: NotebookClient, msg_id: str) -> dict:
    while True:
        msg = run_sync(client.kc.get_shell_msg)(timeout=KERNEL_SECONDS)
        if msg["parent_header"].get("msg_id") == msg_id:
            return msg["content"]


def test_the_notebook_in_a_real_kernel_and_an_interrupt_that_stops_its_job(tmp_path):
    """The shipped notebook, cell by cell: the ranks' lines stream into the launch's cell, the ranks' results come
    back, a rank's exception is raised in the notebook with the rank's traceback (its cell's own source line), and
    nothing of either run is left. Then, in the same kernel, the interrupt button stops a running job (the run
    recorded interrupted, KeyboardInterrupt in the cell, no process left), and the next launch runs."""
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(notebook, timeout=KERNEL_SECONDS, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}})
    with client.setup_kernel():
        for index, cell in enumerate(notebook.cells):
            client.execute_cell(cell, index)
        code = [cell for cell in notebook.cells if cell.cell_type == "code"]
        launch = next(cell for cell in code if "harness.launch(main, args=(2," in cell.source)
        shown = _outputs(launch)
        for rank in (0, 1):
            assert re.search(rf"^\[node{rank}\] \[rank{rank}\]: epoch 2/2 step 32/32 \| rank {rank} \| loss \d",
                             shown, re.M), shown
        assert re.search(r"^harness: run main-\S+ succeeded in", shown, re.M), shown
        losses = _outputs(code[code.index(launch) + 1])
        assert re.fullmatch(r"\[\d\.\d+, \d\.\d+\]", losses), losses
        assert "succeeded step 64/64" in _outputs(code[code.index(launch) + 2])
        failed = _outputs(code[-1])
        assert re.search(r"^RankError: rank [01] raised ValueError; its traceback:", failed, re.M), failed
        error = next(output for output in code[-1].outputs if output.output_type == "error")
        assert "batch_size should be a positive integer value" in error.evalue
        # The rank's frame in the notebook's cell, with the cell's own line (its source went with the call).
        assert re.search(r'File "[^"]+", line 4, in main\n +loader = DataLoader\(', error.evalue), error.evalue
        run_ids = re.findall(r"^harness: run (main-\S+):", "".join(_outputs(cell) for cell in code), re.M)
        assert len(set(run_ids)) == 2, run_ids

        spin = client.kc.execute(textwrap.dedent("""\
            import time

            def spin():
                print("spinning", flush=True)
                while True:
                    time.sleep(0.1)

            harness.launch(spin, nnodes=2)"""))
        said = _iopub_until(client, spin, re.compile(r"\[rank1\]: spinning[\s\S]*\[rank0\]: spinning|"
                                                     r"\[rank0\]: spinning[\s\S]*\[rank1\]: spinning"))
        run_sync(client.km.interrupt_kernel)()
        reply = _reply(client, spin)
        assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt", reply
        spun = re.search(r"harness: run (spin-\S+):", said)
        assert spun, said
        assert_nothing_left(spun[1])
        record = json.loads((tmp_path / "runs" / spun[1] / "state.json").read_text())
        assert record["status"] == "interrupted"

        again = client.kc.execute("harness.launch(lambda: 7, nnodes=1).result()")
        assert _reply(client, again)["status"] == "ok"
        result = ""
        while "7" not in result:
            msg = run_sync(client.kc.get_iopub_msg)(timeout=KERNEL_SECONDS)
            if msg["parent_header"].get("msg_id") == again and msg["msg_type"] == "execute_result":
                result = msg["content"]["data"]["text/plain"]
    for run_id in [*run_ids, spun[1]]:
        assert_nothing_left(run_id)
        assert not (launched_dir() / run_id).exists()  # the call's folder goes once its launch has returned


VERBS = """\
import sys, time
from pathlib import Path
import harness

def count(go):
    import os
    for step in range(1, 4):
        print(f"step {step}/6", flush=True)
    while not Path(go).exists():
        time.sleep(0.05)
    return int(os.environ["RANK"])

run = harness.launch(count, args=(sys.argv[1],), nnodes=2, detach=True, runs_dir=sys.argv[2])
seen = harness.run(run.id[:len(run.id) - 2], runs_dir=sys.argv[2])
assert seen.id == run.id and run.id in [r.id for r in harness.runs(runs_dir=sys.argv[2])]
lines = seen.logs(rank=1, follow=True)
while "step 3/6" not in next(lines):
    pass
while (status := seen.status()).progress is None or status.progress.last_step < 3:  # health.json: twice a second
    time.sleep(0.1)
print("API", run.id, status.state, status.world_size, status.progress.last_step, status.progress.total,
      sorted(status.ranks), flush=True)
sys.stdin.readline()  # the test has asked `harness status` meanwhile
stopped = seen.stop()
print("STOPPED", stopped.state, stopped.exit_code, flush=True)
try:
    seen.result()
except harness.RunFailed as exc:
    print("RESULT", type(exc).__name__, exc, flush=True)
print("REPORT", seen.report(Path(sys.argv[2]) / "page.html"), flush=True)
"""


def test_a_detached_function_run_through_the_api_as_harness_status_tells_it(tmp_path):
    """The API's verbs on one real run, from a script of its own as a user writes one: launch(detach=True) returns
    once the run has started; run(prefix) and runs() find it; logs(follow=True) streams a rank's lines as they come;
    status() says what `harness status RUN` says (running, the step and its total, every rank); stop(), then
    result() raises RunFailed for the stopped run; report() writes the page. Nothing is left, and the launch's
    folder of the function's bytes is gone once the run has ended and the next launch prunes it."""
    script = tmp_path / "verbs.py"
    script.write_text(VERBS)
    runs = tmp_path / "runs"
    user = subprocess.Popen([sys.executable, str(script), str(tmp_path / "go"), str(runs)], cwd=tmp_path,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert user.stdout is not None and user.stdin is not None
    said = ""
    while not (api := re.search(r"^API (\S+) (\S+) (\d+) (\d+) (\d+) \[(.*)\]$", said, re.M)):
        line = user.stdout.readline()
        assert line, said
        said += line
    run_id, state, world, step, total, ranks = api.groups()
    assert (state, world, step, total, ranks) == ("running", "2", "3", "6", "0, 1"), said
    cli = harness("status", run_id, "--runs-dir", str(runs))
    assert cli.returncode == 0, cli.stderr
    assert re.search(rf"^run {run_id}: running \(local, 2 node\(s\), world size 2\)", cli.stdout, re.M), cli.stdout
    assert "progress: step 3/6 (50%)" in cli.stdout, cli.stdout
    user.stdin.write("\n")
    user.stdin.flush()
    rest, _ = user.communicate(timeout=120)
    said += rest
    assert user.returncode == 0, said
    assert re.search(r"^STOPPED stopped 130$", said, re.M), said
    assert re.search(rf"^RESULT RunFailed run {run_id} stopped$", said, re.M), said
    assert f"harness report: {run_id}" in (runs / "page.html").read_text()
    assert_nothing_left(run_id)
    kept = launched_dir() / run_id  # a detached run's, kept while it may need it (a restart, `harness attach`)
    call = (kept / "call.0").read_bytes()
    assert oct(kept.stat().st_mode & 0o777) == "0o700" and oct((kept / "call.0").stat().st_mode & 0o777) == "0o600"
    assert not [path for path in (runs / run_id).rglob("*") if path.is_file() and call[:64] in path.read_bytes()]
    prune_launched()
    assert not kept.exists()


SSH = """\
import socket, sys
import harness

def where(scale):
    import os
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    dist.destroy_process_group()
    carried = [name for name in os.environ if name.startswith("HARNESS_CALL_")]  # taken out before the call
    return socket.gethostname(), int(os.environ["RANK"]), total.item() * scale, carried

run = harness.launch(where, args=(10,), nnodes=2, hosts=sys.argv[1], known_hosts=sys.argv[2], runs_dir=sys.argv[3])
print("RESULTS", run.result(rank=None))
"""


def test_a_function_runs_on_two_ssh_hosts(cluster2: Cluster, tmp_path):
    """Each host's rank calls the function (its all_reduce across the hosts over gloo) and its return value comes
    back through its agent's SSH channel."""
    script = tmp_path / "ssh_call.py"
    script.write_text(SSH)
    hosts = cluster2.write_inventory(tmp_path / "hosts.yaml")
    done = subprocess.run([sys.executable, str(script), str(hosts), str(cluster2.known_hosts), str(tmp_path / "runs")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "RESULTS [('h1', 0, 30.0, []), ('h2', 1, 30.0, [])]" in done.stdout, done.stdout
    run_id = re.search(r"harness: run (where-\S+):", done.stdout)
    assert run_id, done.stdout
    assert_nothing_left(run_id[1])
    state = json.loads((tmp_path / "runs" / run_id[1] / "state.json").read_text())
    assert state["mode"] == "ssh" and state["status"] == "succeeded"
    results = tmp_path / "runs" / run_id[1] / "results"
    assert {oct(path.stat().st_mode & 0o777) for path in [results, *results.rglob("*")]} == {"0o700", "0o600"}
    assert sorted(path.name for path in results.rglob("*") if path.is_file()) == ["0", "1"]
    assert not (launched_dir() / run_id[1]).exists()  # a blocking launch's folder goes at its end
