"""The image's version labels, held to the project's pins: a stale or overridden label fails the build.

Labels must be known before anything is installed, so they are build ARGs (docker/Dockerfile).
This script ties them to the one source of truth, pyproject.toml + requirements.lock:

  pins.py requirements PYPROJECT LOCK   the runtime requirements (pyproject's dependencies) on
                                        stdout, after checking that they and the label ARGs (read
                                        from the environment) agree with the lock
  pins.py installed LOCK                checks the label ARGs against what was really installed
                                        (torch's own CUDA and NCCL versions, the interpreter) and
                                        every installed distribution against the lock

Stdlib only: it runs on the bare base image, before any dependency is installed.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import sys
import tomllib
from collections.abc import Mapping
from pathlib import Path

PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^=;\s]+)$")
LABEL_ARGS = ("PYTHON_VERSION", "TORCH_VERSION", "TORCHVISION_VERSION", "CUDA_VERSION", "NCCL_VERSION")
# Build tools that a dependency may pull in (torch requires setuptools): `pip freeze` leaves them out
# of the lock unless run with --all. pip itself comes with the base's venv and nothing requires it.
INSTALLER = ("setuptools", "wheel")


def normalize(name: str) -> str:
    """PEP 503 name: Foo_Bar and foo-bar are one distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: Path) -> dict[str, str]:
    """requirements.lock (`pip freeze`): normalized name -> exact version."""
    pins = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            match = PIN.match(line)
            if match is None:
                raise ValueError(f"{path}: not an exact pin: {line!r}")
            pins[normalize(match.group(1))] = match.group(2)
    return pins


def project_dependencies(path: Path) -> list[str]:
    return list(tomllib.loads(path.read_text())["project"]["dependencies"])


def _one(lock: Mapping[str, str], pattern: str) -> str | None:
    """The version of the single locked distribution whose name matches pattern (e.g. nvidia-nccl-cu13)."""
    found = [version for name, version in lock.items() if re.fullmatch(pattern, name)]
    return found[0] if len(found) == 1 else None


def expected_labels(lock: Mapping[str, str]) -> dict[str, str | None]:
    """Label ARG -> the value the lock implies. Python is the base image's business, not the lock's.

    torch's CUDA version is the major.minor of the CUDA runtime it pins (torch 2.15.0+cu132 pins
    nvidia-cuda-runtime 13.2.x); NCCL is the nvidia-nccl-cuXX wheel that torch loads.
    """
    runtime = _one(lock, r"nvidia-cuda-runtime(-cu\d+)?")
    return {
        "TORCH_VERSION": lock.get("torch"),
        "TORCHVISION_VERSION": lock.get("torchvision"),
        "CUDA_VERSION": ".".join(runtime.split(".")[:2]) if runtime else None,
        "NCCL_VERSION": _one(lock, r"nvidia-nccl-cu\d+"),
    }


def lock_problems(dependencies: list[str], lock: Mapping[str, str], labels: Mapping[str, str]) -> list[str]:
    """Every way pyproject's dependencies or the label ARGs disagree with the lock."""
    problems = []
    for requirement in dependencies:
        match = PIN.match(requirement)
        if match is None:
            problems.append(f"pyproject dependency {requirement!r} is not an exact pin (name==version)")
        elif lock.get(normalize(match.group(1))) != match.group(2):
            problems.append(f"pyproject pins {requirement} but requirements.lock has "
                            f"{lock.get(normalize(match.group(1)), 'no such package')}; run `make lock`")
    for arg, expected in expected_labels(lock).items():
        if labels.get(arg) != expected:
            problems.append(f"label ARG {arg}={labels.get(arg)} but requirements.lock implies {expected}")
    return problems


def installed_versions() -> dict[str, str]:
    """What the image really carries, as preflight reports it on a host (torch's own view)."""
    import torch  # imported here: seconds to import; only in the image, after installing

    return {
        "PYTHON_VERSION": f"{sys.version_info.major}.{sys.version_info.minor}",
        "TORCH_VERSION": importlib.metadata.version("torch"),
        "TORCHVISION_VERSION": importlib.metadata.version("torchvision"),
        "CUDA_VERSION": str(torch.version.cuda),
        "NCCL_VERSION": ".".join(str(part) for part in torch.cuda.nccl.version()),
    }


def label_mismatches(labels: Mapping[str, str], actual: Mapping[str, str]) -> list[str]:
    return [f"label ARG {arg}={labels.get(arg)} but the image has {actual[arg]}"
            for arg in LABEL_ARGS if labels.get(arg) != actual[arg]]


def unlocked(installed: Mapping[str, str], lock: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """(problems, warnings): installed distributions at another version than the lock's, or not in it.

    An unlocked build tool is only a warning: a lock made without `pip freeze --all` cannot pin it.
    """
    problems: list[str] = []
    warnings: list[str] = []
    for name, version in sorted(installed.items()):
        if name == "pip":
            continue
        if name in lock and lock[name] != version:
            problems.append(f"{name} {version} is installed but requirements.lock pins {lock[name]}")
        elif name not in lock:
            (warnings if name in INSTALLER else problems).append(
                f"{name} {version} is installed but not pinned in requirements.lock")
    return problems, warnings


def installed_distributions() -> dict[str, str]:
    return {normalize(dist.metadata["Name"]): dist.version for dist in importlib.metadata.distributions()}


def main(argv: list[str]) -> int:
    labels = {arg: os.environ.get(arg, "") for arg in LABEL_ARGS}
    if argv[:1] == ["requirements"] and len(argv) == 3:
        dependencies = project_dependencies(Path(argv[1]))
        problems = lock_problems(dependencies, read_lock(Path(argv[2])), labels)
        output = "\n".join(dependencies) + "\n"
    elif argv[:1] == ["installed"] and len(argv) == 2:
        problems, warnings = unlocked(installed_distributions(), read_lock(Path(argv[1])))
        problems += label_mismatches(labels, installed_versions())
        for warning in warnings:
            print(f"pins.py: warning: {warning}", file=sys.stderr)
        output = "".join(f"{arg}={labels[arg]}\n" for arg in LABEL_ARGS)
    else:
        print(__doc__, file=sys.stderr)
        return 2
    for problem in problems:
        print(f"pins.py: {problem}", file=sys.stderr)
    if problems:
        return 1
    sys.stdout.write(output)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
