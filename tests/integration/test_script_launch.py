"""A user's own script launched as with torchrun, without a job spec: on simulated nodes and on SSH hosts,
saved as a spec that launches the same job, two jobs on one port in networks of their own, and a held port
refused before anything starts where the job shares this machine's network. What these launches show is the harness's, so they run on the stand-in
torch (testbed/standin, its shim first on the nodes' PYTHONPATH by --env), all but the one whose point is torch's
own output (its c10d rendezvous, its worker server's lines)."""

from __future__ import annotations

import hashlib
import json
import re
import socket
import sys
import textwrap
import time
from pathlib import Path

from harness.node.store_port import ephemeral_start
from harness.spec.job import load_job
from testbed.cluster import Cluster

from conftest import (
    STANDIN_ENV,
    Launch,
    Streamed,
    assert_nothing_left,
    assert_only_the_jobs_lines,
    attack_store,
    harness,
    secret_looking_env,
)

# A user's script: it knows nothing of the harness. Each rank says its rank once every rank has joined the
# process group (a barrier: gloo's, or the stand-in's). Given a --meet file, rank 0 waits there until every
# job that shares the file has come up (two jobs side by side prove they ran at once). --until-hook keeps it
# up until the harness's rank hook has started its worker server in this rank (its socket exists: a test
# waits for the event, not for a time); it ends with destroy_process_group() as the README's example does,
# unless --no-destroy. --show-env NAME,...: each rank says the sha256 of each variable's value.
SCRIPT = textwrap.dedent("""
    import argparse, hashlib, os, sys, time
    import torch.distributed as dist

    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--meet")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--until-hook", action="store_true")
    parser.add_argument("--no-destroy", action="store_true")
    parser.add_argument("--show-env", default="")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    dist.barrier()
    for name in filter(None, args.show_env.split(",")):
        digest = hashlib.sha256(os.environ[name].encode()).hexdigest()[:16]
        print(f"rank {dist.get_rank()}: {name} sha256 {digest}", flush=True)
    print(f"rank {dist.get_rank()}/{dist.get_world_size()} lr {args.lr} port {os.environ['MASTER_PORT']}", flush=True)
    if args.meet and dist.get_rank() == 0:
        with open(args.meet, "a") as handle:
            handle.write(os.environ["MASTER_PORT"] + "\\n")
        deadline = time.monotonic() + 240
        while len(open(args.meet).read().split()) < args.jobs and time.monotonic() < deadline:
            time.sleep(0.2)
        print(f"met {open(args.meet).read().split()}", flush=True)
    hook = os.path.join(os.environ.get("HARNESS_AGENT_DIR", "/nowhere"), os.environ["RANK"] + ".sock")
    deadline = time.monotonic() + 120
    while args.until_hook and not os.path.exists(hook) and time.monotonic() < deadline:
        time.sleep(0.05)
    dist.barrier()
    if not args.no_destroy:
        dist.destroy_process_group()
""")


STANDIN = ["--env", f"PYTHONPATH={STANDIN_ENV['PYTHONPATH']}"]  # a script launch's words for the stand-in


def _script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


def _plan(run: Launch) -> dict:
    return json.loads((run.runs_dir / run.run_id / "plan.json").read_text())


def test_a_script_runs_on_two_simulated_nodes_with_one_command(tmp_path: Path) -> None:
    """The stream holds the script's lines and the harness's own, nothing else (torch's own lines kept out, its
    worker server's among them: the c10d test below, on real torch). With values that look secret given by --env
    (conftest.SECRET_LOOKING): every rank has them, and under strace, which sees every program the launch starts
    with its whole command line however briefly it lives, no command line ever held one (the node's line, `sh -c`
    and its `exec env K=V`, holds the others); the run's spec.yaml, its `# Made by:` header and its plans show ***,
    and launch says once of each that it looks like a secret. The render that saves the job (--save-job) holds none
    either."""
    script, env = _script(tmp_path), secret_looking_env()
    given = [*STANDIN, *(f"--env={name}={value}" for name, value in env.items())]
    execs = tmp_path / "execve.log"
    run = Launch(script, tmp_path / "runs", "--nnodes", "2", "--nproc-per-node", "2", *given, "--", "--lr", "0.1",
                 "--show-env", ",".join(env), cwd=tmp_path,
                 traced_by=["strace", "-f", "-qq", "--seccomp-bpf", "-e", "trace=execve", "-e", "signal=none",
                            "-s", "1000000", "-o", str(execs)])
    try:
        assert run.finish() == 0, run.output
    finally:
        run.cleanup()
    assert_only_the_jobs_lines(run.output)
    ranks = sorted(re.findall(r"\[rank(\d)\]: rank \1/4 lr 0.1 port (\d+)", run.output))
    assert [r for r, _ in ranks] == ["0", "1", "2", "3"], run.output
    typed, *started = execs.read_text().splitlines()  # the user's own command line, then every one the launch ran
    assert "harness.cli" in typed and all(value in typed for value in env.values())
    traced = "\n".join(started)
    assert "harness-agent" in traced and f'"PYTHONPATH={STANDIN_ENV["PYTHONPATH"]}"' in traced  # the nodes' lines ran
    assert not [name for name, value in env.items() if value in traced], "a value was on a command line"
    run_dir = run.runs_dir / run.run_id
    for name, value in env.items():
        digest = hashlib.sha256(value.encode()).hexdigest()[:16]
        assert sum(f"[rank{rank}]: rank {rank}: {name} sha256 {digest}" in run.output for rank in range(4)) == 4
        assert run.output.count(f"harness: env.{name} looks like a secret: the harness shows it as *** and puts it on "
                                f"no command line, but this command line (and so your shell's history) holds it in "
                                f"clear") == 1
        assert f"--env={name}=***" in (run_dir / "spec.yaml").read_text().splitlines()[0]
    assert not [p for p in run_dir.rglob("*") if p.is_file() and any(v.encode() in p.read_bytes() for v in env.values())]
    plan = _plan(run)
    assert {port for _, port in ranks} == {str(plan["master_port"])}
    assert 20000 <= plan["master_port"] < ephemeral_start()  # auto: picked below the ephemeral range
    kept = load_job(run_dir / "spec.yaml")  # the spec the flags made, kept with the run
    assert (kept.name, kept.nnodes, kept.nproc_per_node, kept.entrypoint.script, kept.entrypoint.args) == \
        ("train", 2, 2, str(script), ["--lr", "0.1", "--show-env", ",".join(env)])
    # The run's plan.txt is exactly what render prints for that run: the commands that ran.
    rendered = harness("render", str(script), "--nnodes", "2", "--nproc-per-node", "2", *given, "--runs-dir",
                       str(run.runs_dir), "--run-id", run.run_id, "--master-port", str(plan["master_port"]),
                       "--save-job", str(tmp_path / "job.yaml"), "--", "--lr", "0.1", "--show-env", ",".join(env),
                       cwd=tmp_path)
    assert rendered.returncode == 0, rendered.stderr
    assert rendered.stdout == (run_dir / "plan.txt").read_text()
    saved = (tmp_path / "job.yaml").read_text()
    assert not [name for name, value in env.items() if value in saved + rendered.stderr]
    assert list(load_job(tmp_path / "job.yaml").secrets) == list(env)
    assert_nothing_left(run.run_id)


def test_save_job_writes_a_spec_that_launches_the_same_job(tmp_path: Path) -> None:
    """`render --save-job` (the README's way) writes the spec the flags make; launching it runs exactly the plan
    render showed, the script's arguments as typed."""
    script = _script(tmp_path)
    saved = tmp_path / "job.yaml"
    rendered = harness("render", str(script), "--nnodes", "2", "--name", "mine", "--env", "MY_FLAG=1", *STANDIN,
                       "--save-job", str(saved), "--format", "json", "--runs-dir", str(tmp_path / "runs"), "--run-id",
                       "rendered", "--", "--lr", "1.10", cwd=tmp_path)
    assert rendered.returncode == 0, rendered.stderr
    assert f"harness launch {saved}" in rendered.stderr
    spec = load_job(saved)
    assert (spec.name, spec.nnodes, spec.env, spec.entrypoint.script, spec.entrypoint.args) == \
        ("mine", 2, {"MY_FLAG": "1"} | STANDIN_ENV, str(script), ["--lr", "1.10"])
    run = Launch(saved, tmp_path / "runs", cwd=tmp_path)
    try:
        assert run.finish() == 0, run.output
    finally:
        run.cleanup()
    assert len(re.findall(r"rank \d/2 lr 1.1 port", run.output)) == 2, run.output
    plan, shown = _plan(run), json.loads(rendered.stdout)

    def same(text: str, run_id: str, port: int) -> str:
        return text.replace(run_id, "RUN").replace(str(port), "PORT")

    assert same(json.dumps(plan), run.run_id, plan["master_port"]) == same(json.dumps(shown), "rendered",
                                                                          shown["master_port"])
    again = harness("launch", str(script), "--save-job", str(saved), "--", "--lr", "1", cwd=tmp_path)
    assert again.returncode == 2 and "the file exists" in again.stderr  # never overwritten


def test_a_module_runs_with_dash_m_and_c10d_rendezvous(tmp_path: Path) -> None:
    """On real torch. With c10d, torchrun's own store logs an INFO line and a C++ exception dump (its IPv6 bind fails
    on the port it tries first): the node log keeps them, the stream does not show them. A script that never
    destroys its process group: the stream holds its lines and the harness's, nothing else (torch's worker server,
    which the rank hook started, says at its end that it exited: in the node log only). While rank 0 waits for a
    second job (--meet), another local user tries the c10d store the way issue 67 did, to have torchrun load a
    pickle of its own: the simulated nodes' own network keeps it out."""
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "train.py").write_text(SCRIPT)
    meet = tmp_path / "meet"
    run = Streamed([sys.executable, "-m", "harness.cli", "launch", "-m", "mypkg.train", "--nnodes", "2",
                    "--rdzv-backend", "c10d", "--runs-dir", str(tmp_path / "runs"), "--", "--lr", "3", "--until-hook",
                    "--no-destroy", "--meet", str(meet), "--jobs", "2"], cwd=tmp_path)
    try:
        run_id = run.wait_for(r"harness: run (\S+): ").group(1)
        run.wait_for(r"\[rank0\]: rank 0/2 lr 3.0 port")
        while not meet.exists() or not meet.read_text():
            time.sleep(0.05)
        assert attack_store(tmp_path / "runs" / run_id, tmp_path / "pwned").startswith("refused 127.0.0.1:")
        with meet.open("a") as handle:
            handle.write("the other job\n")
        assert run.finish(timeout=300) == 0, run.output
    finally:
        run.kill_group()
    assert not (tmp_path / "pwned").exists()
    output = run.output
    assert_only_the_jobs_lines(output)
    run_dir = next((tmp_path / "runs").iterdir())
    assert "[c10d] Server exited" in (run_dir / "node0.log").read_text(), "the rank hook's server was up"
    assert len(re.findall(r"rank \d/2 lr 3.0 port", output)) == 2, output
    assert re.search(r"run train-\S+ succeeded", output)
    assert "frame #" not in output and "Exception raised from" not in output, output


def test_two_jobs_on_one_port_that_this_machine_holds_run_side_by_side(tmp_path: Path) -> None:
    """Simulated nodes run in a network of their launch's own (targets/local/private_net.py): a port something
    holds on this machine is free there, and two jobs on the same port run at once."""
    script = _script(tmp_path)
    meet = tmp_path / "meet"
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = str(held.getsockname()[1])
        runs = [Launch(script, tmp_path / "runs", "--nnodes", "2", "--master-port", port, *STANDIN, "--", "--lr", "1",
                       "--meet", str(meet), "--jobs", "2", cwd=tmp_path) for _ in range(2)]
        try:
            assert [run.finish(timeout=300) for run in runs] == [0, 0], [run.output for run in runs]
        finally:
            for run in runs:
                run.cleanup()
    assert {_plan(run)["master_port"] for run in runs} == {int(port)}
    assert all(f"met ['{port}', '{port}']" in run.output for run in runs)  # both were up at once


def test_a_held_port_is_refused_before_any_node_starts_where_the_job_shares_this_machines_network(
        tmp_path: Path) -> None:
    """simulated.network: host, for a job that reaches other hosts while it runs: the store is open to this
    machine's users (said), a port held here is refused at once, and c10d (its store holds pickles) is refused."""
    _script(tmp_path)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        started = time.monotonic()
        job = tmp_path / "job.yaml"
        job.write_text(f"name: shared\nnnodes: 2\nmaster_port: {port}\nentrypoint: {{script: train.py, args: "
                       f"[--lr, '1']}}\nsimulated: {{network: host}}\n")
        result = harness("launch", str(job), "--runs-dir", str(tmp_path / "runs"), cwd=tmp_path)
        took = time.monotonic() - started
        job.write_text(job.read_text() + "rdzv: c10d\n")
        c10d = harness("launch", str(job), "--runs-dir", str(tmp_path / "runs"), cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"master_port {port} is in use on this machine" in result.stderr
    assert "leave master_port out" in result.stderr and "Traceback" not in result.stdout + result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert took < 60  # guard: refused at once, not after the nodes' rendezvous timed out (900 s)
    assert c10d.returncode == 1 and "rdzv: c10d needs the job's own network, and simulated.network is host" in \
        c10d.stderr, c10d.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())  # no run was made


def test_bad_flags_name_the_flag(tmp_path: Path) -> None:
    script = _script(tmp_path)
    for flags, expected in [
        (["--nnodes", "0"], "--nnodes: expected an integer from 1 to 4096, got 0"),
        (["--master-port", "80"], "--master-port: expected a port from 1024 to 65535, or auto"),
        (["--env", "RANK=3"], "--env: RANK is set by the harness/torchrun"),
        (["--env", "novalue"], "--env: expected KEY=VALUE, got 'novalue'"),
    ]:
        result = harness("launch", str(script), *flags, "--runs-dir", str(tmp_path / "runs"), cwd=tmp_path)
        assert result.returncode == 2 and expected in result.stderr, (flags, result.stderr)
    mixed = harness("launch", "jobs/smoke.yaml", "--nnodes", "3")
    assert mixed.returncode == 2 and "--nnodes is for a script launch" in mixed.stderr
    assert not (tmp_path / "runs").exists()


def test_a_script_runs_on_ssh_hosts_with_one_more_flag(cluster2: Cluster, tmp_path: Path) -> None:
    script = _script(tmp_path)
    hosts = cluster2.write_inventory(tmp_path / "hosts.yaml")
    run = Launch(script, tmp_path / "runs", "--nnodes", "2", "--hosts", str(hosts), "--known-hosts",
                 str(cluster2.known_hosts), *STANDIN, "--", "--lr", "0.5", cwd=tmp_path)
    try:
        assert run.finish(timeout=180) == 0, run.output
    finally:
        run.cleanup()
    plan = _plan(run)
    assert plan["master_addr"] == cluster2.hosts[0].address
    assert 20000 <= plan["master_port"] < ephemeral_start()  # picked on the master host
    assert len(re.findall(rf"rank \d/2 lr 0.5 port {plan['master_port']}", run.output)) == 2, run.output
    assert_nothing_left(run.run_id)
