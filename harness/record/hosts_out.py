"""Hosts taken out after they failed at the machine's level -- lost during an attempt, or unfit in the check
before one (unreachable, a GPU the driver calls unfit) -- and kept out of every run for a cool-down, so that
neither the next attempt nor the next run is given them again. Kept in the user's state directory beside the
index of runs ($XDG_STATE_HOME/harness/hosts.json), one entry per machine (its address and SSH port), each
with the reason, the run and when it ends; `harness hosts` lists them and brings one back.

A limit on how many of an inventory's hosts are out at once (restarts.max_out) keeps one bad switch from
draining a cluster: past it, a failing host is still down for its run, but not kept out of the next."""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from harness.errors import UsageError
from harness.record.atomic import write_text_atomic
from harness.record.index import index_dir

ALL = "all"


@dataclass(frozen=True)
class HostOut:
    """A machine kept out: the name its inventory gave it, why, by which run, from when until when (epoch s)."""

    machine: str  # address:port (a Slurm node: targets/slurm/srun.slurm_machine)
    name: str
    reason: str
    run_id: str
    since: float
    until: float

    def said(self, name: str | None = None) -> str:
        """What a run says of it (name: what this run's inventory calls it)."""
        name = name or self.name
        return (f"{name} is kept out until {_clock(self.until)}: {self.reason} (run {self.run_id}); `harness hosts "
                f"--release {name}` brings it back")


def hosts_file(environ: Mapping[str, str] = os.environ) -> Path:
    return index_dir(environ).parent / "hosts.json"


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One writer at a time: runs that end together each add their hosts (the lock file stays, empty)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f".{path.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _read(path: Path) -> list[HostOut]:
    try:
        entries = json.loads(path.read_text())
        return [HostOut(**entry) for entry in entries]
    except FileNotFoundError:
        return []
    except (OSError, ValueError, TypeError) as exc:
        raise UsageError(f"{path}: cannot read the hosts kept out ({exc}); delete the file to forget them "
                         f"all") from None


def _write(path: Path, entries: list[HostOut]) -> None:
    write_text_atomic(path, json.dumps([asdict(entry) for entry in entries], indent=2) + "\n")


def hosts_out(path: Path, now: float | None = None) -> list[HostOut]:
    """The machines whose cool-down has not ended, oldest first."""
    now = time.time() if now is None else now
    return [entry for entry in _read(path) if entry.until > now]


def take_out(path: Path, failed: Mapping[str, str], machines: Mapping[str, str], run_id: str, cooldown: float,
             limit: int) -> tuple[list[HostOut], list[str]]:
    """Keep the failed hosts (name -> reason; names of machines, the inventory's: name -> machine) out for
    cooldown seconds, as long as no more than limit of the inventory's machines are out at once. Returns the
    entries made and the names left in (past the limit)."""
    if cooldown <= 0 or not failed:
        return [], []
    with _locked(path):
        now = time.time()
        entries = hosts_out(path, now)  # ended cool-downs are dropped here
        ours = {entry.machine for entry in entries} & set(machines.values())
        made, left = [], []
        for name, reason in failed.items():
            if machines[name] in ours:
                continue
            if len(ours) >= limit:
                left.append(name)
                continue
            ours.add(machines[name])
            made.append(HostOut(machines[name], name, reason, run_id, round(now, 3), round(now + cooldown, 3)))
        _write(path, entries + made)
    return made, left


def bring_back(path: Path, which: str) -> list[HostOut]:
    """End the cool-down of the host named which (its inventory name or its address), or of every one (ALL);
    returns those brought back."""
    with _locked(path):
        entries = hosts_out(path)
        back = [entry for entry in entries
                if which in (ALL, entry.name, entry.machine, entry.machine.rsplit(":", 1)[0])]
        if not back:
            listed = ", ".join(entry.name for entry in entries) or "none"
            raise UsageError(f"no host {which!r} is kept out (kept out: {listed}; `harness hosts` lists them)")
        _write(path, [entry for entry in entries if entry not in back])
    return back


def _clock(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(at))


@dataclass
class RunsHosts:
    """One run's side of it: its inventory's machines (name -> address:port; none: nothing to keep out), the
    hosts kept out of it, and the hosts it keeps out, each said in words for the run's stream."""

    path: Path
    machines: dict[str, str]
    run_id: str
    cooldown: float
    limit: int
    kept_out: dict[str, HostOut] = field(default_factory=dict)

    def keep_out_earlier(self) -> list[str]:
        """The inventory's hosts an earlier failure keeps out (kept_out), and what to say of them."""
        names = {machine: name for name, machine in self.machines.items()}
        self.kept_out = {names[e.machine]: e for e in hosts_out(self.path) if e.machine in names} if names else {}
        return [entry.said(name) for name, entry in self.kept_out.items()]

    def keep_out(self, failed: Mapping[str, str]) -> list[str]:
        """Keep the failed hosts (name -> reason) out of later runs, within the limit; what to say of it."""
        known = {name: reason for name, reason in failed.items() if name in self.machines}
        made, left = take_out(self.path, known, self.machines, self.run_id, self.cooldown, self.limit)
        said = [f"{e.name} is kept out of later runs until {_clock(e.until)} (restarts.cooldown); `harness hosts "
                f"--release {e.name}` brings it back" for e in made]
        if left:
            said.append(f"{', '.join(left)} not kept out of later runs: {self.limit} of the inventory's "
                        f"{len(self.machines)} hosts are out already (restarts.max_out); so many failing together "
                        f"is more likely the network's fault than theirs: look before bringing them back")
        return said
