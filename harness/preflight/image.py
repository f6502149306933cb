"""Container jobs: the engine answers on every host, the image is there with one digest everywhere,
and the probe runs inside the image, so that the versions compared are the ones the job will run.

Nothing is pulled: a tag pulled separately on each host can resolve to different images, so a
missing image is a failure with the command that fixes it, before anything starts.
"""

from __future__ import annotations

import shlex
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from harness.plan.shell import remote_command
from harness.preflight.checks import majority
from harness.preflight.remote import Link, Process, on_hosts
from harness.preflight.table import Check, Status
from harness.spec.inventory import Host
from harness.spec.job import JobSpec
from harness.targets.boot import BOOT
from harness.targets.host_command import CommandResult
from harness.targets.ssh.container import container_argv

# Printed between the engine's answers, so that one command per host tells both apart.
_SEPARATOR = "--harness-image--"
NOT_FOUND = 127


@dataclass(frozen=True)
class ImageFacts:
    """What one host's engine said: its version, and the image's id (None: not there)."""

    version: str | None
    image_id: str | None
    error: str | None


def inspect_command(engine: str, image: str) -> str:
    """The engine's client version, then the image's id: docker's `version` also reaches the daemon."""
    version = "{{.Client.Version}}" if engine == "podman" else "{{.Server.Version}}"
    return (f"{shlex.join([engine, 'version', '--format', version])} && echo {_SEPARATOR} && "
            f"{shlex.join([engine, 'image', 'inspect', '--format', '{{.Id}}', image])}")


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def image_facts(result: CommandResult) -> ImageFacts:
    """Read inspect_command's answer (pure, for tests)."""
    before, found, after = result.stdout.partition(_SEPARATOR)
    if not found:
        return ImageFacts(None, None, _last_line(result.stderr or result.stdout))
    version = before.strip() or None
    image_id = after.strip().removeprefix("sha256:") or None
    return ImageFacts(version, image_id if result.status == 0 else None,
                      None if result.status == 0 else _last_line(result.stderr))


def engine_row(host: str, engine: str, facts: ImageFacts, status: int) -> Check:
    if facts.version is not None:
        return Check(host, "engine", Status.PASS, f"{engine} {facts.version}")
    if status == NOT_FOUND:
        return Check(host, "engine", Status.FAIL, f"{engine} is not installed (`{engine}`: command not found)",
                     f"install {engine} on {host}, or set `container: {{engine: ...}}` to the engine the hosts have")
    daemon = " (is dockerd running, and may this user use its socket?)" if engine == "docker" else ""
    return Check(host, "engine", Status.FAIL, f"{engine} does not answer: {facts.error}{daemon}",
                 f"check `{engine} version` on {host}")


def image_checks(links: Mapping[str, Link], spec: JobSpec, master: str,
                 timeout: float) -> tuple[list[Check], list[str]]:
    """The engine and image rows per host, and the hosts whose engine has the image (probed inside it)."""
    assert spec.image is not None and spec.container is not None
    engine, image = spec.container.engine, spec.image
    answers = on_hosts(lambda name: links[name].run(inspect_command(engine, image), timeout=timeout), links)
    facts: dict[str, ImageFacts] = {}
    rows = []
    for name, answer in answers.items():
        if isinstance(answer, Exception):
            rows.append(Check(name, "engine", Status.FAIL, f"{engine} did not answer: {answer}"))
            continue
        facts[name] = found = image_facts(answer)
        answered = engine_row(name, engine, found, answer.status)
        rows.append(answered)
        if answered.status is Status.PASS and found.image_id is None:
            rows.append(Check(name, "image", Status.FAIL, f"{image} is not on {name} ({engine}: {found.error})",
                              f"pull it on every host before launch (`{engine} pull {image}`), or load it there "
                              f"(`{engine} load -i FILE`); preflight never pulls"))
    present = {name: f.image_id for name, f in facts.items() if f.image_id is not None}
    if present:
        reference = majority(list(present.values()), present.get(master))
        same = sorted(name for name, image_id in present.items() if image_id == reference)
        for name, image_id in present.items():
            short = image_id[:12]
            if image_id == reference:
                everywhere = ", same on all hosts" if len(present) == len(links) > 1 else ""
                rows.append(Check(name, "image", Status.PASS, f"{image} is image {short}{everywhere}",
                                  details={"id": image_id}))
            else:
                rows.append(Check(name, "image", Status.FAIL,
                                  f"{image} is image {short} on {name} but {reference[:12]} on {', '.join(same)}",
                                  "pull or load the same image on every host, or name it by digest "
                                  "(image: NAME@sha256:...) so that a moved tag cannot differ",
                                  {"id": image_id}))
    return rows, sorted(present)


class InImage:
    """A host's link whose Python snippets run inside the job's image, as the job's torchrun will:
    same engine flags (host network, GPUs, /dev/shm, the workdir mounted at its own path)."""

    def __init__(self, link: Link, spec: JobSpec, index: int) -> None:
        assert spec.image is not None and spec.container is not None
        self._link = link
        self._spec = spec
        self._name = f"preflight-{uuid.uuid4().hex[:8]}"
        self._index = index

    @property
    def host(self) -> Host:
        return self._link.host

    @property
    def peer_ip(self) -> str:
        return self._link.peer_ip

    def run(self, command: str, *, stdin: bytes = b"", timeout: float) -> CommandResult:
        return self._link.run(command, stdin=stdin, timeout=timeout)

    def start(self, command: str, *, timeout: float) -> Process:
        return self._link.start(command, timeout=timeout)

    def python_command(self, args: Sequence[str]) -> str:
        """The image's Python, with the container's stdin attached: the script arrives there."""
        assert self._spec.image is not None and self._spec.container is not None
        argv = container_argv(self._spec.image, ["python", "-c", BOOT, *args], {}, self.host.workdir,
                              self._name, node_rank=self._index, gpus=bool(self.host.gpus),
                              shm_size=self._spec.resources.shm_size, engine=self._spec.container.engine,
                              interactive=True)
        return remote_command(argv)

    def close(self) -> None:
        self._link.close()
