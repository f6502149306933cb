"""Kubernetes manifests as a working job: both pods run as processes exactly as rendered, with only the
kubelet's substitutions, the user's code from the ConfigMap alone (the manifests: tests/unit/test_k8s.py)."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

import yaml

from harness.targets.k8s.manifests import COMPLETION_INDEX, RESTART_ATTEMPT
from harness.targets.k8s.supervised import INFRA_EXIT, PROGRAM_EXIT
from testbed.kubelet import (
    SupervisedPods,
    job_spec,
    jobs_by_name,
    pod_dns,
    pod_process,
    run_pods,
    wait_for_line,
)
from testbed.throttle import throttled

from conftest import (
    REPO,
    SECRET_NAME,
    STANDIN_ENV,
    assert_nothing_left,
    assert_secret_kept,
    free_port,
    harness,
    with_secret,
    worker_pid,
)
from k8s_jobs import SMALL, USER_FILES, USER_JOB, docs, render_in, write_files
from resume_job import KILL_AT, assert_same_weights, final_weights, payload_job


def test_pods_run_as_rendered_form_a_working_ddp_job(write_yaml, tmp_path):
    """Both pods' command, args and env exactly as written; only the kubelet's substitutions applied. The
    job's setup runs once on the volume they share (here: one directory). The JobSet's pods differ only in
    what their env reads from the restart attempt, checked without running them. A secret comes from the
    namespace's Secret (Secret <job>-secrets by default): every rank has it, no manifest holds it."""
    script = REPO / "tests/scripts/ddp_sum.py"
    setup = f"setup:\n  - python -c \"import sys; print('set up by', sys.executable, '{tmp_path}')\"\n"
    job, secret = with_secret(write_yaml(SMALL.format(name="sim", port=free_port(), script=script) + setup))
    namespace = {("sim-secrets", SECRET_NAME): secret}
    for flavor, attempt in (("core", "0"), ("jobset", "1")):
        rendered = docs(job, flavor)
        assert secret not in json.dumps(rendered)
        container = job_spec(rendered)["template"]["spec"]["containers"][0]
        _, env = pod_process(container, {COMPLETION_INDEX: "1", RESTART_ATTEMPT: "1"}, pod_dns(rendered, 0), {},
                             namespace)
        assert env["HARNESS_ATTEMPT"] == attempt, flavor
    objects = docs(job, "core")
    path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"  # `python` is the image's interpreter
    worker, master = run_pods(objects, {RESTART_ATTEMPT: "1"}, tmp_path / "root", tmp_path, path, namespace)
    assert_secret_kept(secret, master + worker, 2, tmp_path)
    assert "waiting for the master's rendezvous port" in worker
    assert f"set up by {sys.executable} {tmp_path}\n" in master and "harness setup: done before" in worker
    assert "; args=['--tag', 'two words', '$(not-a-var)', '$$', '${local_rank}']" in master
    finals = re.findall(r"\[rank(\d)\]: rank \1 final loss \S+ weights (\[.*\])", master + worker)
    assert sorted(r for r, _ in finals) == ["0", "1"] and len({w for _, w in finals}) == 1


def plain_python(directory: Path) -> Path:
    """`python` as a plain Python image with torch installed has it: a venv of this interpreter whose
    site-packages reaches this one's packages by a path-only .pth line, so that no .pth file there runs
    (the editable install's finder of the harness is one). Returns its bin directory."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(directory)], check=True, timeout=60)
    site = Path(sysconfig.get_paths(vars={"base": str(directory)})["purelib"])
    (site / "torch-here.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return directory / "bin"


def test_a_user_script_shipped_by_the_renderer_runs_in_an_image_without_the_harness(tmp_path):
    """The user's directory -> `harness render` there -> what the kubelet makes of the ConfigMap -> both pods,
    run with an interpreter that has torch but cannot import the harness, on a workspace that starts empty."""
    project, workspace = tmp_path / "project", tmp_path / "workspace"
    write_files(project, USER_FILES | {"job.yaml": USER_JOB.format(port=free_port()).encode()})
    workspace.mkdir()
    rendered = render_in(project, "job.yaml", "--target", "k8s", "--out", "k8s", "--unsupervised")
    assert rendered.returncode == 0, rendered.stderr
    objects = list(yaml.safe_load_all((project / "k8s/own.yaml").read_text()))
    image = plain_python(tmp_path / "image")
    control = subprocess.run([image / "python", "-c", "import torch, harness"], cwd=workspace, capture_output=True,
                             text=True, timeout=120)
    assert "No module named 'harness'" in control.stderr and "torch" not in control.stderr, control.stderr
    worker, master = run_pods(objects, {}, tmp_path / "root", workspace, f"{image}:{os.environ['PATH']}")
    assert "waiting for the master's rendezvous port" in worker
    code = tmp_path / "root/etc/harness/code"
    for rank, output in (("1", worker), ("0", master)):
        assert f"rank {rank}: harness importable: False; cwd {workspace}; PYTHONPATH {code}:/opt/site; " \
               f"args ['--tag', 'two words']" in output, output
    finals = re.findall(r"\[rank(\d)\]: rank \1 final loss \S+ weights (\[.*\])", master + worker)
    assert sorted(r for r, _ in finals) == ["0", "1"] and len({w for _, w in finals}) == 1
    assert list(workspace.iterdir()) == []  # the volume got no code: it came from the ConfigMap


# Supervised (the default render): the controller pod runs `harness k8s-controller` in the project's image, the
# worker pods node/pod.py from the ConfigMap; every pod a process here, as SupervisedPods runs them.
PROJECT_IMAGE = Path(sys.executable).parent  # `python` and `harness` of the project's image


def supervised_job(root: Path, flavor: str, **k8s: object) -> tuple[list[dict], Path]:
    """The payload job (resume_job.py) as a supervised Kubernetes job: its manifests, and the workspace."""
    spec = yaml.safe_load(payload_job(root).read_text())
    spec |= {"image": "registry.example/harness:0.1.0", "k8s": {"port": free_port(), **k8s}}
    spec["restarts"] = {"max": 3, "on": "any", "backoff": 0}
    path = root / "job.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    workspace = root / "workspace"
    workspace.mkdir()
    return docs(path, flavor, supervised=True), workspace


ROGUE_WORKER = """
import json, socket, sys
link = socket.create_connection((sys.argv[1], int(sys.argv[2])))
link.sendall(b'HARNESS-POD ' + json.dumps({"pod": sys.argv[3], "index": 0, "machine": "kube-node-0",
                                           "python": "python", "workdir": "/workspace", "nonce": "n"}).encode() + b"\\n")
first = link.recv(65536)
link.sendall(b'HARNESS-POD-PROOF {"proof": "' + b"0" * 64 + b'"}\\n')
link.settimeout(30)
rest = b"".join(iter(lambda: link.recv(65536), b""))
print(json.dumps({"first": first.decode(), "rest": rest.decode()}))
"""


KEY_HOLDER = """
import json, socket, sys
from harness.node.pod import CONTROLLER_PROOF, HELLO, POD_PROOF, Handshake, message, read_line
host, port, key_path, pod = sys.argv[1:]
link = socket.create_connection((host, int(port)))
said = (HELLO + json.dumps({"pod": pod, "index": 0, "machine": "kube-node-2", "python": "python",
                            "workdir": "/workspace", "nonce": "n"})).encode()
link.sendall(said + b"\\n")
answer = message(read_line(link, 30)[0], CONTROLLER_PROOF)
handshake = Handshake(open(key_path, "rb").read(), said, answer["nonce"], answer["run"])
link.sendall((POD_PROOF + json.dumps({"proof": handshake.proof("pod")}) + "\\n").encode())
print(json.dumps([m.decode() for m in iter(handshake.channel(link, "pod", print).recv, b"")]))
"""


def impostor_controller(planted: Path) -> tuple[socket.socket, threading.Thread]:
    """A controller without the run's key, where a pod dials: it answers with a false proof, then an order."""
    server = socket.create_server(("0.0.0.0", 0))

    def answer() -> None:
        peer, _ = server.accept()
        peer.recv(65536)
        peer.sendall(b'HARNESS-CONTROLLER {"nonce": "m", "proof": "' + b"1" * 64 + b'"}\n' +
                     json.dumps({"run": ["touch", str(planted)], "env": {}}).encode() + b"\n")
        peer.close()

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    return server, thread


def test_supervised_pods_restart_in_place_and_a_spare_takes_a_deleted_pods_place(uninterrupted, cluster3,
                                                                                   tmp_path):
    """Rank 1's process killed: the ranks restart in the same pods (none replaced); then pod 1 deleted: the
    Job recreates it under a new name (a spare then), and the spare pod (index 2) takes its place at once; then the
    controller's pod lost with its node: the Job's next controller pod takes the same run back, its ranks never
    stopped. The run ends bitwise equal to the unbroken one; `kubectl exec` into the controller answers status and logs.
    Beside them, rogues on the pods' network: a process on h3 dialing the controller as pod 0 is refused and
    sent nothing; one there that holds the run's key and says it is a pod of index 0 is refused (its address is pod
    2's); a pod whose Service name leads to a controller without the run's key runs nothing it sends."""
    objects, workspace = supervised_job(tmp_path, "core", spares=1)
    planted = tmp_path / "planted"
    with SupervisedPods(objects, tmp_path / "root", workspace, PROJECT_IMAGE, PROJECT_IMAGE, cluster3) as pods:
        pods.controller()
        workers = [pods.worker(index) for index in range(3)]
        started = wait_for_line(pods, "controller", r"^harness: run (\S+): 2 node\(s\) .* master (\S+):", 240)
        run_id = started.group(1)
        assert started.group(2) == cluster3.hosts[0].address  # pod 0's own address: each pod is a host of its own
        port = str(next(o for o in objects if o["kind"] == "Service")["spec"]["ports"][0]["port"])  # the link's
        rogue = subprocess.run(cluster3.login(cluster3.hosts[2], [sys.executable, "-c", ROGUE_WORKER,
                                                                  cluster3.gateway, port, workers[0]]),
                               capture_output=True, text=True, timeout=60)
        heard = json.loads(rogue.stdout)
        assert heard["first"].startswith("HARNESS-CONTROLLER ") and heard["first"].count("\n") == 1 and \
            heard["rest"] == "", heard  # the controller's proof, then nothing: no command, no env
        wait_for_line(pods, "controller", rf"^harness: refused a worker pod's connection from "
                                          rf"{cluster3.hosts[2].address} \(it says it is pod {workers[0]}, index 0\)", 60)
        # A process of pod 2 (its setup's dependency, say) that holds the run's key and says it is a pod of index 0:
        # the key is not who it is; its address is pod 2's.
        holder = f"{pods.worker_prefix}-0-rogue"
        wait_for_line(pods, workers[2], rf"^harness pod: serving run {run_id}'s controller at ", 60)
        told = subprocess.run(cluster3.login(cluster3.hosts[2], [sys.executable, "-c", KEY_HOLDER, cluster3.gateway,
                                                                 port, str(workspace / ".harness/link-key"), holder]),
                              capture_output=True, text=True, timeout=60)
        why = f"{cluster3.hosts[2].address} is pod {workers[2]}'s address, and that pod is connected"
        assert json.loads(told.stdout) == [json.dumps({"refused": f"it holds the run's key, but {why}"})], told
        wait_for_line(pods, "controller", rf"^harness: refused a worker pod's connection from "
                                          rf"{cluster3.hosts[2].address} \(it says it is pod {holder}, index 0\): it "
                                          rf"holds the run's key, but {re.escape(why)}; it was sent nothing else$", 60)
        impostor, answered = impostor_controller(planted)
        fooled = pods.worker(1, dials=(cluster3.gateway, impostor.getsockname()[1]))
        wait_for_line(pods, fooled, r"^harness pod: refused the controller at \S+ \(\S+\): its proof of the run's "
                                    r"key did not match; nothing it sends is run$", 60)
        answered.join(timeout=30)
        impostor.close()
        assert pods.delete(fooled) == 143 and not planted.exists()
        wait_for_line(pods, "controller", KILL_AT, 240)
        os.kill(worker_pid(run_id, 1), signal.SIGKILL)
        wait_for_line(pods, "controller", rf"^harness: run {run_id} attempt 1, 2 node\(s\) x 1 process\(es\) on "
                                          rf"{workers[0]}, {workers[1]},", 120)
        wait_for_line(pods, "controller", r"\[rank0\]: epoch 1/2 step 20/32 ", 240)
        assert pods.delete(workers[1]) == 143
        wait_for_line(pods, "controller", rf"^harness: run {run_id} attempt 2, 2 node\(s\) x 1 process\(es\) on "
                                          rf"{workers[0]}, {workers[2]},", 120)
        replaced = pods.worker(1)  # the Job controller's replacement, a new pod: scheduled, started, a spare now
        attempt2 = workspace / ".harness/runs" / run_id / "logs/attempt2/node0.log"
        while not (attempt2.exists() and "[rank0]: epoch" in attempt2.read_text()):  # its first step, 40 to come
            assert pods.processes["controller"].poll() is None, pods.output("controller")
            time.sleep(0.1)
        assert pods.lose("controller") == -9
        later = pods.controller("controller-2")  # the Job's next controller pod: the same command, the same volume
        wait_for_line(pods, "controller-2", rf"^harness: run {run_id}: taken back by \d+@\S+; its controller was lost "
                                            rf"[\d.]+ s before; the \d+ line\(s\)", 120)
        assert later.wait(timeout=300) == 0, pods.output("controller-2")
        assert [pods.processes[name].wait(timeout=60) for name in (workers[0], workers[2], replaced)] == [0, 0, 0]
    assert_same_weights(uninterrupted, final_weights(tmp_path))
    runs = workspace / ".harness/runs"
    assert "harness: refused a worker pod's connection from" in (runs / run_id / "logs" / "harness.log").read_text()
    assert oct((workspace / ".harness/link-key").stat().st_mode & 0o777) == "0o600", "the run's key is the pods' user's"
    summary = json.loads((runs / run_id / "summary.json").read_text())
    assert [a["hosts"] for a in summary["attempts"]] == [workers[:2], workers[:2], [workers[0], workers[2]]]
    assert [a["kind"] for a in summary["attempts"]] == ["infra", "infra", None], summary["attempts"]
    assert summary["attempts"][1]["failures"][0]["host"] == workers[1]
    (unwatched,) = summary["attempts"][2]["unwatched"]  # attempt 2 ran on, untouched, while no controller watched
    assert unwatched["lost_at"] < unwatched["attached_at"], unwatched
    assert_nothing_left(run_id)
    cluster3.assert_only_sshd_left(within=15)
    exec_env = {"HARNESS_RUNS_DIR": str(runs), "PATH": os.environ["PATH"]}  # the controller container's own
    status = harness("status", "latest", env=exec_env, cwd=workspace)
    assert status.returncode == 0 and f"run {run_id}" in status.stdout and "succeeded" in status.stdout, status
    logs = harness("logs", "latest", "--rank", "0", env=exec_env, cwd=workspace)
    assert logs.returncode == 0 and "[rank0]: done: test_acc=" in logs.stdout, logs


STALL = 10
DETECT_WITHIN = STALL + 15  # seconds from the fault to the verdict, on a busy 2-core machine
HEALTH_STEPS = REPO / "tests/scripts/health_steps.py"


def user_job(project: Path, flavor: str, script: Path, restarts: str, secret: str | None = None,
             args: str | None = None, spares: int = 0, slow_for: float | None = None, **env: str) -> list[dict]:
    """The user's script (shipped from project, the directory `harness render` runs in) as a supervised job; with
    secret SECRET_NAME from Secret `hf`, key `token`, which its ranks show (conftest.with_secret). args: the
    script's (a YAML list); spares: k8s.spares; slow_for: health.slow_for (None: its default)."""
    project.mkdir(parents=True)
    (project / "train.py").write_bytes(script.read_bytes())
    lines = "".join(f"  {key}: '{value}'\n" for key, value in env.items()) or "  {}\n"
    given = f", args: {args}" if args is not None else ""
    lasting = f", slow_for: {slow_for:g}" if slow_for is not None else ""
    (project / "job.yaml").write_text(
        f"name: mine\nnnodes: 2\nbackend: gloo\nmaster_port: {free_port()}\nimage: registry.example/torch:2\n"
        f"entrypoint: {{script: train.py{given}}}\nenv:\n{lines}restarts: {restarts}\n"
        f"health: {{stall: {STALL}{lasting}}}\nk8s: {{port: {free_port()}, spares: {spares}}}\n")
    if secret is not None:
        with_secret(project / "job.yaml", "{k8s: {secret: hf, key: token}}")
    return docs(project / "job.yaml", flavor, supervised=True)


def test_supervised_a_rank_asleep_is_named_and_the_hang_fails_the_job_as_the_infrastructures(cluster2, tmp_path):
    """The workers in an image without the harness (torch only), the JobSet flavor: rank 1 asleep in its data
    loading is found within stall + 15 s and named at its line (py-spy comes from the controller's image, by
    the volume); the stacks are kept on the volume; no restart left, the controller ends with INFRA_EXIT (the
    rule that fails the Job as the infrastructure's); every worker pod is dismissed, nothing is left."""
    objects = user_job(tmp_path / "project", "jobset", HEALTH_STEPS, "{max: 0}", SLEEP_RANK="1", SLEEP_AT_STEP="25")
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    image = plain_python(tmp_path / "image")
    with SupervisedPods(objects, tmp_path / "root", workspace, PROJECT_IMAGE, image, cluster2) as pods:
        controller = pods.controller()
        workers = [pods.worker(index) for index in range(2)]
        wait_for_line(pods, "controller", r"\[rank1\]: rank 1 sleeping in its step 25", 180)
        asleep = time.monotonic()
        verdict = wait_for_line(pods, "controller", r"^harness: hang: (no progress for .*?) \(stacks in (\S+)/\)$",
                                DETECT_WITHIN + 30)
        assert time.monotonic() - asleep < DETECT_WITHIN  # guard: the watch's stall + 15 s, not gloo's 30 min timeout
        assert controller.wait(timeout=120) == INFRA_EXIT, pods.output("controller")
        assert [pods.processes[name].wait(timeout=60) for name in workers] == [0, 0]
    script = tmp_path / "root/etc/harness/code/train.py"  # where the ConfigMap put it in the pods
    sleep = next(n for n, line in enumerate(script.read_text().splitlines(), 1) if "time.sleep(3600)" in line)
    assert re.fullmatch(rf"no progress for {STALL} s: rank 0 waits in all_reduce #\d+ at \S+ in train_step; rank 1 "
                        rf"\(node1 on {workers[1]}\) has not reached #\d+, at {script}:{sleep} in fetch_batch: "
                        rf"time.sleep\(3600\)", verdict.group(1)), verdict.group(1)
    runs = workspace / ".harness/runs"
    run_id = re.search(r"^harness: run (\S+):", pods.output("controller"), re.M).group(1)
    assert verdict.group(2) == str(runs / run_id / "stacks/attempt-0")
    asleep_stack = (runs / run_id / "stacks/attempt-0/rank1.txt").read_text()
    assert f"fetch_batch ({script}:{sleep})\n        time.sleep(3600)" in asleep_stack, asleep_stack
    assert_nothing_left(run_id, within=15)
    cluster2.assert_only_sshd_left(within=15)


def test_supervised_a_program_failure_fails_the_job_at_once(cluster2, tmp_path):
    """A rank's own exit 1, not covered by restarts.on: the controller exits 1, the rule that fails the Job
    (Kubernetes never retries a bug); the worker pods are dismissed. The worker pods take a secret from the
    namespace's Secret: every rank has it, and neither the manifests nor the run's record hold it. On the stand-in
    torch (the job's env): it reports a failed rank in torchrun's words, and torch's part is not what is tested."""
    secret = f"hf_{secrets.token_hex(12)}"
    objects = user_job(tmp_path / "project", "core", REPO / "tests/scripts/ddp_sum.py", "{max: 2, on: infra}",
                       secret, FAIL_RANK="1", FAIL_AT_STEP="3", **STANDIN_ENV)
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    with SupervisedPods(objects, tmp_path / "root", workspace, PROJECT_IMAGE, PROJECT_IMAGE, cluster2,
                        {("hf", "token"): secret}) as pods:
        controller = pods.controller()
        workers = [pods.worker(index) for index in range(2)]
        assert controller.wait(timeout=180) == PROGRAM_EXIT, pods.output("controller")
        assert [pods.processes[name].wait(timeout=60) for name in workers] == [0, 0]
    assert re.search(r"^harness: run \S+ FAILED: first failure on node 1 \(\S+, global rank 1\): exit code 1 after "
                     r"\S+ s \(program\)", pods.output("controller"), re.M), pods.output("controller")
    assert_secret_kept(secret, pods.output("controller"), 2, workspace, tmp_path / "root")
    rule = next(r for r in jobs_by_name(objects)["mine"]["podFailurePolicy"]["rules"]
                if r.get("onExitCodes", {}).get("values") == [PROGRAM_EXIT])
    assert rule["action"] == "FailJob"


STANDIN_RANKS = REPO / "testbed/standin/rank.py"  # a step's CPU work (--busy-ms), which a CPU quota slows
SLOW_FOR = 10
SLOW_SHARE = 0.05  # of a CPU, for the slow pod's rank: its step's 10 ms of work take 200 ms and more


def test_supervised_a_slow_pod_gives_way_to_the_spare_and_deleting_every_pod_is_a_stop(cluster3, tmp_path):
    """Rank 1's pod made slow (its rank held to a twentieth of a CPU, as a noisy neighbour would): named, weighed
    once health.slow_for has passed, and the job restarted without it, once, on the spare pod (k8s.spares, index 2),
    the slow pod left connected but down for the rest of the run. Then `kubectl exec <controller> -- harness
    status|stacks latest` answer while it runs; `kubectl delete -f k8s/`: SIGTERM to every pod at once, SIGKILL
    after its grace period: the controller stops every rank and records the run as stopped; nothing is left
    running. On the stand-in torch (the job's env) and its ranks (testbed/standin/rank.py, each step a CPU-bound
    computation and an all-reduce): its launcher passes SIGTERM on as torchrun does, and the ranks' stacks are
    their script's; torch's part is not what is tested."""
    objects = user_job(tmp_path / "project", "jobset", STANDIN_RANKS, "{max: 2, on: [any, slow], backoff: 0}",
                       args='[--steps, "100000", --step-seconds, "0.05", --busy-ms, "10", --print, first, '
                            '--log-every, "10"]', spares=1, slow_for=SLOW_FOR, **STANDIN_ENV)
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    with SupervisedPods(objects, tmp_path / "root", workspace, PROJECT_IMAGE, PROJECT_IMAGE, cluster3) as pods:
        pods.controller()
        workers = [pods.worker(index) for index in range(3)]
        run_id = wait_for_line(pods, "controller", r"^harness: run (\S+): 2 node\(s\)", 180).group(1)
        # 200 steps of at least 0.05 s each: the job's pace before the slowness is known (over 5 s and more)
        wait_for_line(pods, "controller", r"\[rank0\]: epoch 1/1 step 200/", 180)
        with throttled([worker_pid(run_id, 1)], share=SLOW_SHARE):
            wait_for_line(pods, "controller", rf"^harness: attempt 0 stopped for {workers[1]}'s slowness; restart 1 "
                                              rf"of 2 in 0 s, without {workers[1]}$", 120)
        weighed = wait_for_line(pods, "controller", rf"^harness: slow: rank 1 \(node1 on {workers[1]}\) for \d+ s: "
                                                    rf"the slowness costs .*$", 10).group(0)
        assert weighed.endswith(f"a restart without it costs less; stopping the job to restart without {workers[1]} "
                                f"(restarts.on: slow)"), weighed
        wait_for_line(pods, "controller", rf"^harness: run {run_id} attempt 1, 2 node\(s\) x 1 process\(es\) on "
                                          rf"{workers[0]}, {workers[2]},", 120)
        attempt1 = workspace / ".harness/runs" / run_id / "node0.attempt1.log"
        while not (attempt1.exists() and "[rank0]: epoch 1/1 step 10/" in attempt1.read_text()):
            assert pods.processes["controller"].poll() is None, pods.output("controller")
            time.sleep(0.1)
        exec_env = {"HARNESS_RUNS_DIR": str(workspace / ".harness/runs"), "PATH": os.environ["PATH"]}
        status = harness("status", "latest", env=exec_env, cwd=workspace)  # kubectl exec <controller> -- harness ...
        assert status.returncode == 0 and f"run {run_id}" in status.stdout and "running" in status.stdout, status
        stacks = harness("stacks", "latest", env=exec_env, cwd=workspace)
        assert stacks.returncode == 0 and f"1 (node1 on {workers[2]}, pid " in stacks.stdout, stacks
        assert re.search(r"main \(\S+/etc/harness/code/train.py:\d+\)", stacks.stdout), stacks.stdout
        # `kubectl delete -f k8s/`: every pod deleted at once, each by its kubelet (the controller's preStop first)
        deleting = [threading.Thread(target=lambda name=name: ended.__setitem__(name, pods.delete(name)))
                    for name in ["controller", *workers]]
        ended: dict[str, int] = {}
        for thread in deleting:
            thread.start()
        for thread in deleting:
            thread.join()
        assert [ended[name] for name in workers] == [143] * 3 and ended["controller"] == 130, ended
    summary = json.loads((workspace / ".harness/runs" / run_id / "summary.json").read_text())
    slow, last = summary["attempts"]
    assert (slow["hosts"], slow["kind"], slow["down"]) == (workers[:2], "slow", [workers[1]]), slow
    assert slow["failures"][0]["kind"] == "slow", slow["failures"][0]
    assert slow["failures"][0]["evidence"].startswith(f"rank 1 (node1 on {workers[1]}) held the job at "), slow
    assert last["hosts"] == [workers[0], workers[2]], last
    output = pods.output("controller")
    assert len(re.findall(r"^harness: slow: rank \d+ \(node\d on \S+\) for \d+ s: ", output, re.M)) == 1, output
    # The workers' pods may go first: then attempt 1 failed (its pods lost), and no other started.
    assert summary["status"] == "stopped" and last["status"] in ("stopped", "failed"), summary
    assert "attempt 2," not in output, output
    assert_nothing_left(run_id)
    cluster3.assert_only_sshd_left(within=15)
