"""`docker run` (or `podman run`) for a node whose host runs the job inside the image (an SSH cluster,
`container: true`, or `container: {engine: podman}`).

Pure: the SSH backend wraps every planned node with `in_containers`; nothing runs here.
Every node then runs the same image, so the same torch, CUDA and NCCL, whatever the host has.

Stopping: the SSH agent's SIGTERM reaches `docker run`, which passes it to the container, where
docker's init (`--init`) hands it to torchrun. A SIGKILLed `docker run` leaves its container
running, so a stop also runs `remove_argv`: the container is named after the run id and node rank,
and labelled with both (`docker ps --filter label=harness.run-id=RUN_ID` lists a run's containers).
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from decimal import ROUND_CEILING

from harness.errors import UsageError
from harness.plan.planner import Plan
from harness.plan.setup_script import setup_script, with_setup
from harness.spec.job import ContainerEngine, JobSpec, quantity_value

# All GPUs: docker through the NVIDIA container toolkit's runtime hook, podman through the toolkit's
# CDI spec (`nvidia-ctk cdi generate`; podman ignores --gpus).
GPU_FLAG: dict[str, str] = {"docker": "--gpus=all", "podman": "--device=nvidia.com/gpu=all"}
RUN_ID_LABEL = "harness.run-id"
NODE_RANK_LABEL = "harness.node-rank"
# docker's rule for container names.
CONTAINER_NAME = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]*$")


@dataclass(frozen=True)
class Mount:
    """A host path bind-mounted into the container: a dataset (read_only), a checkpoint folder."""

    source: str
    target: str
    read_only: bool = False


def container_name(run_id: str, node_rank: int) -> str:
    """One name per run and node, so that a stop removes exactly this node's container."""
    name = f"harness-{run_id}-node{node_rank}"
    if not CONTAINER_NAME.match(name):
        raise ValueError(f"run id {run_id!r} does not make a valid container name")
    return name


def remove_argv(run_id: str, node_rank: int, engine: ContainerEngine = "docker") -> list[str]:
    """Stops (SIGKILL) and removes the node's container; a no-op error if it is already gone."""
    return [engine, "rm", "--force", container_name(run_id, node_rank)]


def shm_bytes(quantity: str) -> int:
    """A Kubernetes quantity (the spec's shm_size, e.g. 16Gi) in bytes, as docker's --shm-size takes.

    docker reads `16G` as 16 GiB and `500m` as 500 MiB; bytes mean the same on both backends.
    """
    value = quantity_value(quantity)
    if value is None:
        raise UsageError(f"shm_size: expected a quantity such as 16Gi or 512Mi, got {quantity!r}")
    size = int(value.to_integral_value(rounding=ROUND_CEILING))
    if size < 1:
        raise UsageError(f"shm_size: {quantity!r} is less than one byte")
    return size


def _mount_flag(mount: Mount) -> str:
    """--mount is a CSV list (commas and quotes in a path are quoted, as docker's parser expects)."""
    for path in (mount.source, mount.target):
        if not path.startswith("/"):
            raise UsageError(f"container mounts need absolute paths, got {path!r}")
    fields = ["type=bind", f"source={mount.source}", f"target={mount.target}"]
    if mount.read_only:
        fields.append("readonly")
    line = io.StringIO()
    csv.writer(line, lineterminator="").writerow(fields)
    return f"--mount={line.getvalue()}"


def container_argv(
    image: str,
    argv: Sequence[str],
    env: Iterable[str],
    workdir: str | None,
    run_id: str,
    *,
    node_rank: int,
    gpus: bool,
    shm_size: str | None = None,
    mounts: Sequence[Mount] = (),
    user: str | None = None,
    engine: ContainerEngine = "docker",
    interactive: bool = False,
) -> list[str]:
    """The `docker run` command line that runs argv (e.g. python -m torch.distributed.run ...) in image.

    - host network: MASTER_ADDR, the ports preflight checked and NCCL_SOCKET_IFNAME name the
      host's own addresses and interfaces, exactly as without a container;
    - shm_size sets /dev/shm (the 64 MB default breaks DataLoader workers); without it the
      container shares the host's IPC namespace and /dev/shm, as a bare-metal torchrun would;
    - workdir (absolute) is mounted at the same path and is the working directory, so relative
      paths in the job (data/, checkpoints/) land on the host; None keeps the image's /workspace,
      whose files go with the container;
    - env (names) is passed by name (--env KEY), each value taken from the engine's own environment, which
      the node's line and its agent set (a secret's, spec/secrets.py): the engine's command line, which `ps`
      shows every user for the whole run, holds no value;
    - user (e.g. "1001:1001") runs the job as the owner of workdir instead of the image's uid 10001;
    - interactive keeps the container's stdin open (a preflight script arrives on it).
    """
    if not argv:
        raise ValueError("argv must name the program to run")
    args = [
        engine, "run", "--rm", "--init",
        f"--name={container_name(run_id, node_rank)}",
        f"--label={RUN_ID_LABEL}={run_id}", f"--label={NODE_RANK_LABEL}={node_rank}",
        "--network=host",
    ]
    if interactive:
        args.append("--interactive")
    if gpus:
        # Only where the host has GPUs: docker refuses --gpus without the NVIDIA runtime, and an engine
        # that may not raise memlock refuses the ulimit. Pinned memory without a cap is NVIDIA's advice for NCCL.
        args += [GPU_FLAG[engine], "--ulimit=memlock=-1"]
    args.append(f"--shm-size={shm_bytes(shm_size)}" if shm_size is not None else "--ipc=host")
    all_mounts = list(mounts)
    if workdir is not None:
        all_mounts.insert(0, Mount(workdir, workdir))
        args.append(f"--workdir={workdir}")
    args += [_mount_flag(mount) for mount in all_mounts]
    if user is not None:
        args.append(f"--user={user}")
    args += [f"--env={key}" for key in sorted(env)]
    return [*args, f"--entrypoint={argv[0]}", image, *argv[1:]]


def in_containers(plan: Plan, spec: JobSpec) -> Plan:
    """Every node of a host plan run inside spec.image: the image's interpreter in place of the host's,
    the same torchrun arguments and env, the job's setup inside the container (it needs the image's
    tools), and the container's removal as the node's cleanup."""
    assert spec.image is not None and spec.container is not None
    engine = spec.container.engine
    nodes = []
    for node in plan.nodes:
        assert node.ssh is not None
        # The job's setup without the rank hook's line: the agent's directory stays outside the container.
        setup = setup_script(spec.setup, spec.data_paths)
        argv = container_argv(spec.image, with_setup(["python", *node.argv[1:]], setup), [*node.env, *node.secrets],
                              node.ssh.workdir, plan.run_id, node_rank=node.node_rank, gpus=bool(node.ssh.gpus),
                              shm_size=spec.resources.shm_size, engine=engine)
        cleanup = remove_argv(plan.run_id, node.node_rank, engine)
        # Its ranks run as the image's user, not the agent's: a rule admitting the agent's user alone would keep them
        # from their own store (node/store_port.py), so the store is not kept from the host's users (security.md).
        nodes.append(replace(node, argv=tuple(argv), cleanup=tuple(cleanup), setup=None, store_port=None))
    return replace(plan, nodes=tuple(nodes))
