"""What the node agent sees of its node's ranks, for the controller's judges: every WATCH seconds (every
second while the attempt is young; less often in a job of many nodes) each rank's health sample
(harness.node.ranks: CPU, busy time, I/O) with its progress and new arrivals by Flight Recorder
(harness.node.collectives) and its GPU use where the driver reports one (harness.node.gpu), and on request
every rank's stacks (harness.node.ranks) with its DataLoader workers' and its last collectives. Standard
library only: shipped to nodes with the agent."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from harness.node.collectives import READ_SECONDS, ArrivalsDigest, arrivals, last_entries, progress, read_trace
from harness.node.gpu import Nvml, open_nvml
from harness.node.proctable import command_line, process_tree, stat_fields
from harness.node.protocol import (
    LAUNCHER_RANK,
    Arrival,
    ControllerClock,
    Kind,
    RankSample,
    alike_answers,
    arrivals_bodies,
    health_bodies,
    sample_interval,
    stacks_bodies,
)
from harness.node.ranks import (
    ProgressWatch,
    as_seen,
    children_of,
    dump,
    find_ranks,
    py_spy_path,
    python_children,
    sample,
    source_line,
)

Say = Callable[[Kind, str], None]


class RankObserver:
    """The ranks of this run below the agent (this process). directory: the agent's private directory, where
    the ranks serve their Flight Recorder (None: the ranks run without the hook, for the reason unhooked);
    say: writes one message to the controller."""

    def __init__(self, run_id: str, directory: str | None, unhooked: str, say: Say) -> None:
        self.run_id = run_id
        self.directory = directory
        self.unhooked = unhooked
        self.say = say
        self.ranks: dict[int, int] = {}  # rank -> pid, as last found
        self.seen: dict[int, int] = {}  # pid -> rank, of every rank found (for the OOM killer's record)
        self.arrived: dict[int, int] = {}  # rank -> when it enqueued the newest collective read (ns)
        self.digest = ArrivalsDigest()  # the collectives some ranks have arrived at and others not yet
        self.progress_watch = ProgressWatch()  # each rank's progress, judged here (weighed by the controller)
        self.nvml: Nvml | str | None = None  # opened at the first sample; a string: why there is none
        self.launcher: int | None = None  # the node's command's process (its torchrun, once the shell exec'd it)
        self.started: str | None = None  # the STARTED message's body, once said (said again to a new controller)
        self.clock = ControllerClock()  # from the controller's pings (the agent's words)

    def watch_start(self, every: float, ended: threading.Event) -> None:
        """Say once that the node's ranks exist (Kind.STARTED), looking every `every` seconds until they do or the
        node ended: its torchrun's rendezvous is done then, which the controller's rendezvous deadline waits for."""
        while not ended.wait(every):
            below, _ = process_tree(os.getpid())
            if ranks := find_ranks(below, self.run_id, self.directory):
                self.started = ",".join(str(rank) for rank in sorted(ranks))
                self.say(Kind.STARTED, self.started)
                return

    def sample_every(self, seconds: float, ended: threading.Event, nodes: int = 1) -> None:
        """Every `seconds` (every second while the attempt is young), less often in a job of many nodes (nodes:
        sample_interval), until ended, how far each rank has run (what the controller judges hangs and slow ranks
        by, and draws in timeline.jsonl) with how long each has gone without progress (ranks.ProgressWatch), and
        the collectives every rank of the node has newly arrived at, each said once for the node
        (collectives.ArrivalsDigest)."""
        started = time.monotonic()
        while not ended.wait(sample_interval(seconds, time.monotonic() - started, nodes)):
            below, _ = process_tree(os.getpid())
            self.ranks = find_ranks(below, self.run_id, self.directory) or self.ranks
            self.seen.update({pid: rank for rank, pid in self.ranks.items()})
            tree = children_of(below)
            samples = self._with_gpu_use(sample(self.ranks, tree), tree)
            now = time.time()  # when the CPU times were read: a loaded rank's recorder may take seconds to answer
            traces = self.traces({rank: found.state for rank, found in samples.items()})
            arrived: dict[int, list[Arrival]] = {}
            for rank, trace in traces.items():
                if isinstance(trace, list):
                    completed, pending = progress(trace, time.time_ns())
                    samples[rank] = samples[rank]._replace(completed=completed, pending=round(pending, 2))
                    if new := arrivals(trace, self.arrived.get(rank, 0)):
                        self.arrived[rank] = new[-1].created_ns
                        arrived[rank] = new
            for body in arrivals_bodies(now, self.digest.add(self.ranks, arrived, time.time_ns()),
                                        self.clock.ahead()):
                self.say(Kind.ARRIVALS, body)
            for body in health_bodies(now, self.progress_watch.judged(now, samples)):
                self.say(Kind.HEALTH, body)

    def _with_gpu_use(self, samples: dict[int, RankSample], tree: dict[int, list[int]]) -> dict[int, RankSample]:
        """Each sample with its rank's GPU use (its own process's and its children's), where the driver
        lists one of them; the others unchanged (unknown). tree: children_of the processes below the agent."""
        if self.nvml is None:
            self.nvml = open_nvml()
        if isinstance(self.nvml, str):
            return samples
        use = self.nvml.process_use()
        for rank, taken in samples.items():
            members, stack = [], [taken.pid]
            while stack:
                members.append(stack.pop())
                stack.extend(tree.get(members[-1], []))
            found = [use[pid] for pid in members if pid in use]
            if found:
                memory = [u.memory for u in found if u.memory >= 0]
                samples[rank] = taken._replace(gpu_util=round(sum(u.util for u in found), 1),
                                               gpu_memory=sum(memory) if memory else -1)
        return samples

    def traces(self, states: dict[int, str]) -> dict[int, list[dict[str, object]] | str]:
        """Each rank's Flight Recorder entries (or why not), read in parallel: one rank slow to answer
        holds up nobody else's. states: each rank's scheduler state (a stopped rank's server cannot answer)."""
        found: dict[int, list[dict[str, object]] | str] = {}

        def read(rank: int) -> None:
            found[rank] = read_trace(self.directory, rank) if self.directory else self.unhooked

        ranks = [rank for rank, state in states.items() if state not in ("T", "t", "Z")]
        found.update({rank: f"the rank is {'a zombie' if state == 'Z' else 'stopped'}"
                      for rank, state in states.items() if rank not in ranks})
        readers = [threading.Thread(target=read, args=(rank,), daemon=True) for rank in ranks]
        for reader in readers:
            reader.start()
        deadline = time.monotonic() + 2 * READ_SECONDS
        for reader in readers:
            reader.join(max(0.0, deadline - time.monotonic()))
        return {rank: found.get(rank, "its worker server did not answer in time") for rank in states}

    def send_stacks(self, tag: str) -> None:
        """Every rank's last collectives at once, then its stack and its DataLoader workers', read in parallel, each
        frame with its source line as this node has it, alike ranks' once (protocol.alike_answers); then
        `stacks-done TAG`. A controller that cannot wait for
        every stack (hundreds of ranks on a few cores) still judges by the collectives of every rank."""
        below, _ = process_tree(os.getpid())
        ranks = find_ranks(below, self.run_id, self.directory) or self.ranks
        tree = children_of(below)
        states = sample(ranks, tree)
        py_spy = py_spy_path()
        answers: dict[int, dict[str, object]] = {}

        def threads_of(pid: int, state: str) -> object:
            threads = dump(pid, py_spy, stopped=state in ("T", "t")) if py_spy else \
                "py-spy is not installed beside the job's Python or on PATH"
            if isinstance(threads, list):
                for thread in threads:
                    for frame in thread["frames"]:
                        frame["code"] = source_line(pid, frame["file"], frame["line"])
                        frame["file"] = as_seen(pid, frame["file"])
            return threads

        def read(rank: int, pid: int) -> None:
            state = states[rank].state if rank in states else "gone"
            workers = []
            for child in python_children(pid, tree):  # its DataLoader workers: a hang may be theirs
                child_state = (stat_fields(child) or [b"gone"])[0].decode()
                workers.append({"pid": child, "state": child_state, "threads": threads_of(child, child_state)})
            answers[rank] = {"pid": pid, "state": state, "threads": threads_of(pid, state), "workers": workers,
                             "collectives": collectives.get(rank, "the rank is gone")}

        if not ranks and self.launcher is not None:  # none yet: where its torchrun is, in or before its rendezvous
            state = (stat_fields(self.launcher) or [b"gone"])[0].decode()
            answer = {"pid": self.launcher, "state": state, "command": command_line(self.launcher)[:300],
                      "threads": threads_of(self.launcher, state)}
            for body in stacks_bodies(tag, LAUNCHER_RANK, answer):
                self.say(Kind.STACKS, body)
        traces = self.traces({rank: states[rank].state for rank in ranks if rank in states})
        collectives = {rank: last_entries(trace) if isinstance(trace, list) else trace
                       for rank, trace in traces.items()}
        for rank, pid in sorted(ranks.items()):  # first what the verdict needs most, in milliseconds: the collectives
            early = {"pid": pid, "state": states[rank].state if rank in states else "gone", "workers": [],
                     "threads": "py-spy had not read it when the verdict was made", "collectives": collectives[rank]}
            for body in stacks_bodies(tag, rank, early):
                self.say(Kind.STACKS, body)
        readers = [threading.Thread(target=read, args=item, daemon=True) for item in ranks.items()]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join()
        for rank, answer in sorted(alike_answers(answers).items()):  # then the stacks, alike ranks' once
            for body in stacks_bodies(tag, rank, answer):
                self.say(Kind.STACKS, body)
        self.say(Kind.STACKS_DONE, tag)
