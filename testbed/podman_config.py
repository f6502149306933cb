"""A real podman on this machine: its settings, for each namespace host of the test cluster and for
`make image-test` (facts behind each setting: ../shared/notes/containers.md), and the image it runs.

Why podman and not a dockerd per host: podman has no daemon, so a host's engine is only files
(this directory) and the processes of its containers, and every host can use the image that
tests/image/build.sh made, in place, as a read-only additional image store: one 6 GB image serves
all hosts, where each dockerd would need its own loaded copy.

  python testbed/podman_config.py DIR [IMAGE_STORE]   writes DIR/containers.conf and DIR/storage.conf
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
IMAGE = "localhost/harness:image-test"  # what tests/image/build.sh makes (tests/image/env.sh)
BUILD_TIMEOUT = 1800  # a cold build downloads and installs torch with its CUDA wheels
# Where root's podman keeps its blob-info cache whatever the settings say (the tests remove it after).
BLOB_CACHE = Path("/var/lib/containers")

# An unqualified name never goes to a registry (none is reachable, and a test must not try).
REGISTRIES = 'unqualified-search-registries = []\nshort-name-mode = "disabled"\n'
POLICY = '{"default": [{"type": "insecureAcceptAnything"}]}\n'


def _ulimit(kind: int) -> int:
    hard = resource.getrlimit(kind)[1]
    return 1 << 20 if hard == resource.RLIM_INFINITY else hard


def containers_conf(state: Path) -> str:
    """Engine settings: state (locks, events, networks) under `state`, nothing under /run or /etc.

    - default_ulimits within this machine's hard limits: podman asks for 1048576 open files by
      default, and root here lacks CAP_SYS_RESOURCE to raise the limit;
    - runc and cgroupfs: cgroups are hybrid v1 (crun refuses them) and there is no systemd;
    - file locks in `state`: the default shared-memory locks have one machine-wide name, which
      the hosts' engines would share;
    - netns host: the harness passes --network=host anyway; netavark would add iptables chains.
    """
    nofile, nproc = _ulimit(resource.RLIMIT_NOFILE), min(_ulimit(resource.RLIMIT_NPROC), 32768)
    return "\n".join([
        "[containers]",
        f'default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]',
        'netns = "host"',
        "[engine]",
        'runtime = "runc"',
        'cgroup_manager = "cgroupfs"',
        'events_logger = "file"',
        f'events_logfile_path = "{state}/events.log"',
        f'tmp_dir = "{state}/tmp"',
        'lock_type = "file"',
        "[network]",
        f'network_config_dir = "{state}/networks"',
        "",
    ])


def storage_conf(state: Path, image_store: Path | None) -> str:
    """Containers in `state`; images also from image_store, read-only (the build's own store).

    Keep `state` short: podman 4.3 refuses a runroot over 50 characters in the cleanup command that
    conmon runs when a container ends, and every `run --rm` then waits out a 20 s timeout instead.
    """
    lines = ["[storage]", 'driver = "overlay"', f'graphroot = "{state}/storage"', f'runroot = "{state}/run"']
    if image_store is not None:
        lines += ["[storage.options]", f'additionalimagestores = ["{image_store}"]']
    return "\n".join([*lines, ""])


def image_store() -> Path:
    """The test store (tests/image/env.sh) with IMAGE built from this checkout (build.sh: ~7 min the
    first time on a machine, seconds when only the harness changed)."""
    result = subprocess.run([str(REPO / "tests" / "image" / "build.sh")], capture_output=True, text=True,
                            timeout=BUILD_TIMEOUT, env=dict(os.environ, PYTHON=str(REPO / ".venv" / "bin" / "python")))
    if result.returncode != 0:
        raise RuntimeError(f"tests/image/build.sh failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return Path(os.environ.get("HARNESS_IMAGE_CACHE", "/var/tmp/harness-image-cache")) / "storage"


def write(directory: Path, state: Path, image_store: Path | None) -> None:
    """A complete /etc/containers in `directory` (what `ip netns exec` mounts over a host's /etc/containers)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "containers.conf").write_text(containers_conf(state))
    (directory / "storage.conf").write_text(storage_conf(state, image_store))
    (directory / "registries.conf").write_text(REGISTRIES)
    (directory / "policy.json").write_text(POLICY)


if __name__ == "__main__":
    target = Path(sys.argv[1])
    write(target, target, Path(sys.argv[2]) if len(sys.argv) > 2 else None)
