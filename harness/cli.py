"""The `harness` command: render, launch, stop, status, preflight, prepare."""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from harness import __version__
from harness.errors import HarnessError, UsageError
from harness.inventory import Inventory, load_inventory
from harness.k8s import manifests_yaml
from harness.launch import check_local_entrypoint, run_plan
from harness.local import start_local_nodes
from harness.plan import Plan, plan_hosts, plan_local
from harness.procs import is_alive
from harness.render import render_json, render_text
from harness.runs import CONTROLLER_LOG, find_run, list_runs, new_run_id, runs_root, write_text_atomic
from harness.spec import JobSpec, load_job
from harness.stop import stop_run


def resolve_master_ip(inventory: Inventory) -> str:
    """MASTER_ADDR must be an IP: hostnames resolve differently per node (127.0.1.1, IPv6-only)."""
    address = inventory.master_host().address
    try:
        return str(ipaddress.ip_address(address))
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise UsageError(f"{inventory.path}: master address {address!r} does not resolve ({exc.strerror}); "
                         f"write the master's IP address in the inventory") from None
    ips = sorted({str(info[4][0]) for info in infos}, key=lambda ip: ":" in ip)
    if ipaddress.ip_address(ips[0]).is_loopback:
        raise UsageError(f"{inventory.path}: master address {address!r} resolves to loopback {ips[0]} here; "
                         f"other nodes cannot reach that, write the master's routable IP")
    return ips[0]


def _local_gpus(spec: JobSpec) -> int:
    if spec.nproc_per_node != "auto":
        return 0
    import torch  # only when needed: importing torch costs seconds

    return torch.cuda.device_count()


def build_plan(spec: JobSpec, inventory: Inventory | None, run_id: str, log_dir: Path | None = None) -> Plan:
    """Simulated nodes here without an inventory; otherwise one node per host, MASTER_ADDR an IP."""
    if inventory is None:
        return plan_local(spec, run_id=run_id, python=sys.executable, local_gpus=_local_gpus(spec),
                          local_cpus=len(os.sched_getaffinity(0)), log_dir=str(log_dir.resolve()) if log_dir else None)
    return plan_hosts(spec, inventory, run_id=run_id, master_ip=resolve_master_ip(inventory))


def cmd_render(args: argparse.Namespace) -> int:
    spec = load_job(args.job)
    if args.target == "k8s":
        text = manifests_yaml(spec, Path(args.job).read_text(), args.job)
        if args.out is None:
            sys.stdout.write(text)
            return 0
        out = Path(args.out) / f"{spec.name}.yaml"
        out.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(out, text)
        print(f"wrote {out}; apply with: kubectl apply -f {args.out}/")
        return 0
    if args.out is not None:
        raise UsageError("--out is for --target k8s; redirect stdout to save a torchrun plan")
    inventory = load_inventory(args.hosts) if args.hosts else None
    plan = build_plan(spec, inventory, args.run_id or spec.name)
    sys.stdout.write(render_json(plan) if args.format == "json" else render_text(plan))
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    spec = load_job(args.job)
    root = runs_root(args.runs_dir)
    if args.detach:
        return launch_detached(args, new_run_id(spec.name), root)
    run_id = args.run_id or new_run_id(spec.name)
    if args.hosts is None:
        check_local_entrypoint(spec, Path.cwd())
        plan = build_plan(spec, None, run_id, log_dir=root / run_id / "torchrun")
        return run_plan(plan, spec, Path(args.job), root, lambda p: list(start_local_nodes(p.nodes)), mode="local")
    return launch_over_ssh(spec, Path(args.job), load_inventory(args.hosts), run_id, root, args)


def launch_detached(args: argparse.Namespace, run_id: str, root: Path, startup_timeout: float = 300) -> int:
    """Run the controller in a session of its own, so the run outlives this terminal; report once it started."""
    log_path = root / run_id / CONTROLLER_LOG
    log_path.parent.mkdir(parents=True)
    argv = [sys.executable, "-m", "harness.cli", "launch", args.job, "--runs-dir", str(root), "--run-id", run_id]
    argv += ["--hosts", args.hosts] if args.hosts else []
    argv += ["--known-hosts", args.known_hosts] if args.known_hosts else []
    argv += [flag for flag, on in (("--skip-preflight", args.skip_preflight),
                                   ("--accept-new-host-keys", args.accept_new_host_keys)) if on]
    with open(log_path, "w") as log:
        controller = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
    state = root / run_id / "state.json"
    deadline = time.monotonic() + startup_timeout
    while not state.exists() and controller.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    if not state.exists():
        sys.stderr.write(log_path.read_text())
        if controller.poll() is None:
            controller.kill()
        return controller.wait()
    print(f"run {run_id} started in the background (controller pid {controller.pid})\n"
          f"  follow: tail -f {log_path}\n  status: harness status {run_id}\n  stop:   harness stop {run_id}")
    return 0


def launch_over_ssh(spec: JobSpec, job_path: Path, inventory: Inventory, run_id: str, root: Path,
                    args: argparse.Namespace) -> int:
    """Preflight's fast checks, then one supervised SSH channel per node; connections closed at the end."""
    from harness.ssh import connect
    from harness.ssh_launch import SSHNode, start_ssh_nodes

    plan = build_plan(spec, inventory, run_id)
    hosts = inventory.ordered_hosts()[: spec.nnodes]
    if not args.skip_preflight:
        from harness.preflight import run_preflight

        report = run_preflight(inventory.model_copy(update={"hosts": hosts}), spec, known_hosts=args.known_hosts,
                               accept_new_host_keys=args.accept_new_host_keys, fast=True,
                               timeout=spec.timeouts.connect)
        if not report.ok:
            print(report.render_table(), file=sys.stderr)
            print("harness: preflight failed, nothing was started (use --skip-preflight to launch anyway)",
                  file=sys.stderr)
            return 1
    started: list[SSHNode] = []

    def start(plan: Plan) -> list[SSHNode]:
        started.extend(start_ssh_nodes(
            plan.nodes,
            lambda host: connect(host, known_hosts=args.known_hosts, accept_new_host_keys=args.accept_new_host_keys,
                                 timeout=spec.timeouts.connect),
            spec.timeouts.stop_grace,
        ))
        return started

    try:
        return run_plan(plan, spec, job_path, root, start, mode="ssh")
    finally:
        for node in started:
            node.close()


def cmd_stop(args: argparse.Namespace) -> int:
    return stop_run(find_run(runs_root(args.runs_dir), args.run_id), timeout=args.timeout)


def _age(seconds: float) -> str:
    return f"{seconds:.0f}s" if seconds < 120 else f"{seconds / 60:.0f}m" if seconds < 7200 else f"{seconds / 3600:.0f}h"


def cmd_status(args: argparse.Namespace) -> int:
    root = runs_root(args.runs_dir)
    if args.run_id is None:
        runs = list_runs(root)
        if not runs:
            print(f"no runs in {root}/")
            return 0
        print(f"{'RUN ID':<44} {'STATUS':<12} {'NODES':>5} {'STARTED':>8} {'DURATION':>9}")
        for run in runs:
            state, summary = run.read_state(), run.read_summary()
            status = _live_status(state)
            duration = summary["duration_s"] if summary else time.time() - state["started_at"]
            print(f"{run.run_id:<44} {status:<12} {state['nnodes']:>5} "
                  f"{_age(time.time() - state['started_at']) + ' ago':>8} {duration:>8.1f}s")
        return 0
    run = find_run(root, args.run_id)
    state, summary = run.read_state(), run.read_summary()
    print(f"run {run.run_id}: {_live_status(state)} ({state['mode']}, {state['nnodes']} node(s), "
          f"world size {state['world_size']})")
    if summary is None:
        for node_rank, host in enumerate(state["hosts"]):
            print(f"  node{node_rank} on {host}: running; log {run.log_file(node_rank)}")
        return 0
    for node in summary["nodes"]:
        ended = node["error"] or (f"signal {node['signal']}" if node["signal"] else f"exit {node['exit_code']}")
        print(f"  node{node['node_rank']} on {node['host']}: {ended} after {node['duration_s']} s; log {node['log']}")
    failure = summary["first_failure"]
    if failure:
        print(f"  first failure: node{failure['node_rank']} ({failure['host']}), "
              f"rank {failure['rank']}, {failure['description']}")
    return 0


def _live_status(state: dict[str, object]) -> str:
    controller = state["controller"]
    assert isinstance(controller, dict)
    if state["status"] == "running" and not is_alive(controller["pid"], controller["start_ticks"]):
        return "lost"
    return str(state["status"])


def cmd_preflight(args: argparse.Namespace) -> int:
    from harness.preflight import preflight_command

    return preflight_command(args.hosts, args.job, json_out=args.json, collective=args.collective,
                             accept_new_host_keys=args.accept_new_host_keys, known_hosts=args.known_hosts,
                             timeout=args.timeout)


def cmd_prepare(args: argparse.Namespace) -> int:
    from harness.payload import prepare

    return prepare.main(args.passthrough)


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="harness", description=__doc__)
    top.add_argument("--version", action="version", version=f"harness {__version__}")
    verbs = top.add_subparsers(dest="verb", required=True, metavar="VERB")

    render = verbs.add_parser("render", help="print every node's exact torchrun command without running anything")
    render.add_argument("job", help="job spec, e.g. jobs/cifar.yaml")
    render.add_argument("--hosts", help="host inventory (hosts.yaml); default: simulated nodes on this machine")
    render.add_argument("--format", choices=("text", "json"), default="text")
    render.add_argument("--run-id", help="run id to render with (default: the job name)")
    render.add_argument("--target", choices=("torchrun", "k8s"), default="torchrun",
                        help="torchrun: per-node commands (default); k8s: Kubernetes manifests")
    render.add_argument("--out", help="with --target k8s: write DIR/<job>.yaml instead of printing")
    render.set_defaults(func=cmd_render)

    runs_dir = argparse.ArgumentParser(add_help=False)
    runs_dir.add_argument("--runs-dir", help="where run records live (default: $HARNESS_RUNS_DIR or ./runs)")

    launch = verbs.add_parser("launch", parents=[runs_dir], help="run the job and supervise every node")
    launch.add_argument("job")
    launch.add_argument("--hosts", help="host inventory; default: nnodes simulated nodes on this machine")
    launch.add_argument("--detach", action="store_true",
                        help="run in the background: the run outlives this terminal; see status/stop")
    launch.add_argument("--run-id", help=argparse.SUPPRESS)
    launch.add_argument("--skip-preflight", action="store_true", help="with --hosts: start without the fast checks")
    launch.add_argument("--known-hosts", help="known_hosts file for host keys (default ~/.ssh/known_hosts)")
    launch.add_argument("--accept-new-host-keys", action="store_true",
                        help="trust and record keys of hosts not yet in known_hosts (never silent otherwise)")
    launch.set_defaults(func=cmd_launch)

    stop = verbs.add_parser("stop", parents=[runs_dir], help="stop a running run (from any terminal)")
    stop.add_argument("run_id")
    stop.add_argument("--timeout", type=float, default=15.0, help="seconds to wait for the run to end")
    stop.set_defaults(func=cmd_stop)

    status = verbs.add_parser("status", parents=[runs_dir], help="list runs, or show one run's nodes")
    status.add_argument("run_id", nargs="?")
    status.set_defaults(func=cmd_status)
    preflight = verbs.add_parser("preflight", help="prove before launch that every host can run the job")
    preflight.add_argument("hosts", help="host inventory, e.g. hosts.yaml")
    preflight.add_argument("--job", help="job spec: its port, backend, GPUs and entrypoint are checked too")
    preflight.add_argument("--json", action="store_true", help="the same report as JSON")
    preflight.add_argument("--collective", action="store_true",
                           help="also run a short all_reduce across all hosts with the job's backend")
    preflight.add_argument("--known-hosts", help="known_hosts file for host keys (default ~/.ssh/known_hosts)")
    preflight.add_argument("--accept-new-host-keys", action="store_true",
                           help="trust and record keys of hosts not yet in known_hosts")
    preflight.add_argument("--timeout", type=float, default=10.0, help="seconds per step")
    preflight.set_defaults(func=cmd_preflight)

    prepare = verbs.add_parser("prepare", add_help=False, help="download and verify CIFAR-10 once, before training "
                               "(harness prepare --data-dir DIR; --help for options)")
    prepare.set_defaults(func=cmd_prepare)
    return top


def main(argv: list[str] | None = None) -> int:
    top = parser()
    args, passthrough = top.parse_known_args(argv)
    if passthrough and args.verb != "prepare":
        top.error(f"unrecognized arguments: {' '.join(passthrough)}")
    args.passthrough = passthrough
    try:
        return args.func(args)
    except HarnessError as exc:
        print(f"harness: error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
