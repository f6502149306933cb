"""Inside a Kubernetes cluster: the run's controller in a pod of its own, the job's worker pods its nodes.

The worker pods dial the controller (node/pod.py `serve`, from the job's ConfigMap: the pods' image needs no
harness) and each keeps one connection waiting, once each end has proved it holds the run's key and the pod is
who it says it is (node/pod.py says how, PodLink what is checked; a connection that fails is refused and said,
and is sent nothing); every message on it is sealed (node/pod.py's Channel). A node of an attempt is a node agent
the controller starts on such a connection, which then carries the agent's stdin and stdout as an SSH channel
does. The pods are the inventory: those connected, in completion-index order, the first nnodes the job's and
the rest spares; a pod Kubernetes recreated (deleted, evicted, its node lost) dials in under its new name and is a
new host. The pods stay up between attempts, so a restart starts its ranks in place, warm where a standby waits.

The agents hold their nodes for supervision.grace when the controller is lost (its pod evicted, its Kubernetes
node gone): the pods dial the controller's Service again, and the Job's new controller pod takes the run on the
volume back (harness k8s-controller), on a session of each of its pods that runs the relay (harness.node.link).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import re
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from harness.node.pod import (
    CONTROLLER_PROOF,
    HELLO,
    KEPT_REFUSALS,
    POD_PROOF,
    PROOF_SECONDS,
    REFUSAL_CHARS,
    Channel,
    Handshake,
    keep_alive,
    message,
    read_line,
)
from harness.plan.planner import NodePlan, Plan, plan_hosts, take_healthy
from harness.spec.inventory import Host
from harness.spec.job import JobSpec
from harness.targets.agent_link import (
    AgentNode,
    Standbys,
    agent_argv,
    agent_env,
    attach_all,
    relay_argv,
    start_all,
)
from harness.targets.base import NodeProcess
from harness.targets.k8s.manifests import object_names
from harness.targets.k8s.supervised import WORKER, worker_names

HELLO_SECONDS = 10.0  # a connection that has not said who it is by then is not one of our pods
SAY_EVERY = 30.0  # how often the controller says which pods it still waits for
FACT_CHARS = 4096  # the longest fact a pod's hello may hold (a name, a path)
GENERATED_BASE = 58  # Kubernetes' longest generateName: a pod's name is that and 5 random characters
_SUFFIX = re.compile(r"[a-z0-9]{5}")


@dataclass(frozen=True)
class PodHello:
    """A worker pod as it introduced itself: its name (the host), completion index, Kubernetes node, Python
    and directory, and the address its connection came from (its pod IP)."""

    pod: str
    index: int
    machine: str
    python: str
    workdir: str
    address: str

    @classmethod
    def read(cls, facts: dict[str, Any], address: str) -> PodHello:
        """The hello's facts, each of its type and at most FACT_CHARS; ValueError for any other."""
        strings = [facts.get(name) for name in ("pod", "machine", "python", "workdir", "nonce")]
        if not all(isinstance(fact, str) and len(fact) <= FACT_CHARS for fact in strings) or \
                type(facts.get("index")) is not int:
            raise ValueError("not a pod's hello")
        return cls(facts["pod"], facts["index"], facts["machine"], facts["python"], facts["workdir"], address)


@dataclass(frozen=True)
class WorkerPods:
    """Who the job's worker pods are: indexes 0 to count - 1, each pod named as the Job controller names an
    Indexed Job's (`<Job>-<index>-` and 5 random characters, the Job's name cut so that the index stays), by the
    workers' Job of either flavor."""

    jobs: tuple[str, ...]
    count: int

    @classmethod
    def of(cls, spec: JobSpec) -> WorkerPods:
        """The workers' Job as supervised.py names it: core's `<job>-node`, JobSet's `<jobset>-node-0`."""
        names = object_names(spec)
        return cls((worker_names(spec, names["job"]), f"{names['jobset']}-{WORKER}-0"), spec.nnodes + spec.k8s.spares)

    def pod_name(self, job: str, index: int) -> str:
        """The generateName of the Job's pod of index (what its name is, less the 5 random characters)."""
        tail = f"-{index}-"
        return job[:GENERATED_BASE - len(tail)] + tail

    def has(self, pod: str, index: int) -> bool:
        """Whether pod is a name the Job's pod of that index may have."""
        return 0 <= index < self.count and _SUFFIX.fullmatch(pod[-5:]) is not None and \
            any(pod[:-5] == self.pod_name(job, index) for job in self.jobs)


class PodLink:
    """The controller's end of the pods' connections: a listening socket, and each pod's waiting one. key: the
    run's, which every pod proves it holds (and the controller too, to it); run_id: the run the controller serves,
    bound into every proof; workers: the pods it expects. say: where the link's own words go (a connection
    refused), until announce_to gives it the run's stream.

    A pod that proves the key is then checked against who it says it is, since any holder of the key (every
    process of every pod of the job) could say anything: its name must be that of a pod of its index; a name
    connected already is that pod's from its address alone; an address connected already is that pod's alone (but
    loopback: the controller's own pod, or a test's machine, where every pod may share one); an index connected
    already is its pod's alone. A connection is refused, and said, for the first that fails."""

    def __init__(self, port: int, key: bytes, run_id: str, workers: WorkerPods, host: str = "0.0.0.0") -> None:
        self._server = socket.create_server((host, port), backlog=1024, reuse_port=False)
        self._key, self._run_id, self._workers = key, run_id, workers
        self._said: list[str] = []  # what was said before the run's stream existed, said again into it
        self.say: Callable[[str], None] = self._said.append
        self._waiting: dict[str, tuple[PodHello, Channel]] = {}
        self._connected: dict[str, tuple[PodHello, list[Channel]]] = {}  # every pod's sessions, waiting ones too
        self._refusals: set[str] = set()  # the identities refused so far: each said once, not at every retry
        self._changed = threading.Condition()
        self._dismissed: int | None = None  # the exit code every pod is sent once the run is over
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                link, (address, *_) = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._greet, args=(link, address), daemon=True).start()

    def announce_to(self, say: Callable[[str], None]) -> None:
        """The run's stream (and record) exists: the link's words go there from now on, what came before first."""
        self.say = say
        for line in self._said:
            say(line)

    def _greet(self, link: socket.socket, address: str) -> None:
        """A pod's hello, then the proofs both ways (node/pod.py); only a pod that proved it holds the run's key,
        and is who it says it is (_who_not), is offered, and nothing but the controller's own proof is ever sent to
        one that did not (to a key holder refused for who it says it is: the refusal, sealed)."""
        try:
            keep_alive(link)
            line, _ = read_line(link, HELLO_SECONDS)
            facts = message(line, HELLO)
            pod = PodHello.read(facts, address)
            refused = facts.get("refused") or []
            if not isinstance(refused, list):
                raise ValueError("not a pod's hello")
            mine = secrets.token_hex(16)
            handshake = Handshake(self._key, line, mine, self._run_id)
            link.sendall((CONTROLLER_PROOF + json.dumps({"nonce": mine, "run": self._run_id,
                                                         "proof": handshake.proof("controller")}) + "\n").encode())
            line, rest = read_line(link, PROOF_SECONDS)
        except (OSError, ValueError):
            link.close()
            return
        try:
            proved = handshake.proven("pod", message(line, POD_PROOF).get("proof"))
        except ValueError:
            proved = False
        if not proved:
            link.close()
            self.say(f"refused a worker pod's connection from {address} (it says it is pod {pod.pod}, index "
                     f"{pod.index}): its proof of the run's key did not match; it was sent nothing")
            return
        for refusal in refused[-KEPT_REFUSALS:]:
            self.say(f"pod {pod.pod} refused a controller that answered it: {str(refusal)[:REFUSAL_CHARS]}")
        channel = handshake.channel(link, "controller", lambda reason: self.say(
            f"refused a message from pod {pod.pod} ({address}): {reason}; the link is closed and nothing it carried "
            f"was acted on"), rest)
        with self._changed:
            dismissed, why_not = self._dismissed, self._who_not(pod)
            if dismissed is None and why_not is None:
                old = self._waiting.pop(pod.pod, None)
                self._waiting[pod.pod] = (pod, channel)
                self._connected = {name: entry for name, entry in self._connected.items() if self._open(name)}
                self._connected[pod.pod] = (pod, [*self._open(pod.pod), channel])
                self._changed.notify_all()
        if dismissed is not None:
            self._dismiss(channel, dismissed)
            return
        if why_not is not None:
            self._refuse(pod, channel, why_not)
            return
        if old is not None:
            old[1].abort()
        self._watch(pod.pod, channel)

    def _open(self, pod: str) -> list[Channel]:
        """The pod's sessions still open (under the lock)."""
        return [channel for channel in self._connected.get(pod, (None, []))[1] if channel.open]

    def _who_not(self, pod: PodHello) -> str | None:
        """Why a pod that proved the run's key is not who it says it is (None: nothing says it is not; under the
        lock)."""
        if not self._workers.has(pod.pod, pod.index):
            names = " or ".join(f"{self._workers.pod_name(job, pod.index)}xxxxx" for job in self._workers.jobs)
            return f"{pod.pod} is not a name of the job's worker pod of index {pod.index} ({names}, index 0 to " \
                   f"{self._workers.count - 1})"
        others = [hello for name, (hello, _) in self._connected.items() if self._open(name)]
        for other in others:
            if other.pod == pod.pod and other.address != pod.address:
                return f"pod {pod.pod} is connected from {other.address}"
        for other in others:
            if other.pod != pod.pod and other.address == pod.address and \
                    not ipaddress.ip_address(pod.address).is_loopback:
                return f"{pod.address} is pod {other.pod}'s address, and that pod is connected"
        for other in others:
            if other.pod != pod.pod and other.index == pod.index:
                return f"index {pod.index} is pod {other.pod}'s, connected from {other.address}"
        return None

    def _refuse(self, pod: PodHello, channel: Channel, why_not: str) -> None:
        """A key holder that is not who it says it is: told why (it proved the key: the refusal is sealed), closed,
        and said once."""
        with contextlib.suppress(OSError):
            channel.send_message(json.dumps({"refused": f"it holds the run's key, but {why_not}"}).encode())
        channel.close()
        line = (f"refused a worker pod's connection from {pod.address} (it says it is pod {pod.pod}, index "
                f"{pod.index}): it holds the run's key, but {why_not}; it was sent nothing else")
        with self._changed:
            said, self._refusals = line in self._refusals, self._refusals | {line}
        if not said:
            self.say(line)

    def _watch(self, pod: str, channel: Channel) -> None:
        """A waiting connection that closes (its pod ended: deleted, evicted) is no longer offered. The pod
        says nothing on it until it is a session: any byte means it is one now, no longer ours to watch."""
        if channel.peer_closed():
            with self._changed:
                if self._waiting.get(pod, (None, None))[1] is channel:
                    del self._waiting[pod]
                    channel.abort()
                    self._changed.notify_all()

    def pods(self) -> list[PodHello]:
        """The pods with a connection waiting now, in completion-index order."""
        with self._changed:
            return sorted((hello for hello, _ in self._waiting.values()), key=lambda p: (p.index, p.pod))

    def await_pods(self, count: int, down: frozenset[str], timeout: float, first: float = 0.0,
                   stopped: Callable[[], bool] = lambda: False, only: frozenset[str] | None = None) -> list[PodHello]:
        """The pods waiting (not down) once count of them are, or when timeout has passed (fewer then). For the
        first `first` seconds, the pods with the first count completion indexes are waited for (the job's own,
        not its spares), whichever of the others dialed in first. only: these pods alone (None: any)."""
        started = time.monotonic()
        deadline, said = started + timeout, started
        with self._changed:
            while True:
                ready = [p for p in self.pods() if p.pod not in down and (only is None or p.pod in only)]
                left = deadline - time.monotonic()
                own = {p.index for p in ready} >= set(range(count)) or time.monotonic() - started >= first
                if (len(ready) >= count and own) or left <= 0 or stopped():
                    return ready
                if time.monotonic() - said >= SAY_EVERY:
                    print(f"harness: {len(ready)} of {count} worker pod(s) connected; waiting up to {left:.0f} s "
                          f"more", file=sys.stderr, flush=True)
                    said = time.monotonic()
                self._changed.wait(min(left, SAY_EVERY, 1.0))

    def take(self, pod: str) -> Channel:
        """The pod's waiting connection, now a session (the pod dials the next one)."""
        with self._changed:
            found = self._waiting.pop(pod, None)
        if found is None:
            raise ConnectionError(f"pod {pod} has no connection waiting: it ended, or its link broke")
        return found[1]

    def dismiss(self, code: int) -> None:
        """The run is over: every pod ends with code, and no new connection is taken."""
        with self._changed:
            self._dismissed = code
            waiting, self._waiting = list(self._waiting.values()), {}
        self._server.close()
        for _, channel in waiting:
            self._dismiss(channel, code)

    @staticmethod
    def _dismiss(channel: Channel, code: int) -> None:
        with contextlib.suppress(OSError):
            channel.send_message(json.dumps({"exit": code}).encode())
        channel.close()


class PodAgentNode(AgentNode):
    """A node agent in a worker pod, on one of its connections."""

    def __init__(self, node: NodePlan, link: Channel, argv: list[str], env: Mapping[str, str]) -> None:
        super().__init__(node)
        self._link = link
        self._ended = threading.Event()
        link.send_message(json.dumps({"run": argv, "env": dict(env)}).encode())

    def readable(self) -> int | None:
        return self._link.link.fileno()

    def read_ready(self) -> bytes | None:
        try:
            data = self._link.recv_ready()
        except OSError:
            self._ended.set()
            raise
        if data == b"":
            self._ended.set()
        return data

    def _chunks(self) -> Iterator[bytes]:
        try:
            while chunk := self._link.recv():
                yield chunk
        finally:
            self._ended.set()

    def _send(self, data: bytes) -> None:
        self._link.send(data)

    def running(self) -> bool:
        return not self._ended.is_set()

    def _wait_agent(self) -> str:
        self._ended.wait()
        return f"the link to pod {self.node.host} closed without the node's end: the pod or its Kubernetes node is gone"

    def _agent_lost(self) -> None:
        """Nothing to sweep from here: an agent whose link broke sees its stdin end and stops its node."""
        self._link.close()

    def end(self) -> None:
        super().end()
        self._link.close()


class PodsBackend:
    """The job's worker pods as hosts: nnodes of those connected, the others spares."""

    name = "k8s"
    standbys_await_check = False

    def __init__(self, link: PodLink, code_dir: str | None, rejoin: float,
                 stopped: Callable[[], bool] = lambda: False, held: Sequence[str] = ()) -> None:
        """held: the pods of a run whose controller pod was lost, in its plan's order: the first plan is theirs (its
        nodes are taken back, not started)."""
        self.link = link
        self.stopped = stopped  # whether the run is being stopped: no more waiting for pods
        self.code_dir = code_dir  # the job's shipped code in every pod (None: none shipped)
        self.rejoin = rejoin  # seconds a restart waits for recreated pods to dial in
        self._first = True
        self._held = list(held)
        self._standbys = Standbys()

    def pool(self, spec: JobSpec) -> list[str]:
        return [p.pod for p in self.link.pods()]  # the connected ones: a spare pod waits among them

    def machines(self) -> dict[str, str]:
        return {}  # a recreated pod is a new host; Kubernetes, not the run, chooses its machine

    def announce_to(self, say: Callable[[str], None]) -> None:
        """The link's refusals, in the run's stream and record (base.Announcing)."""
        self.link.announce_to(say)

    def in_pods(self, spec: JobSpec) -> JobSpec:
        """The spec as the pods run it: a shipped script from the code directory, which also comes first on
        the job's PYTHONPATH (the pods' own environment has it first already)."""
        if self.code_dir is None:
            return spec
        spec = spec.script_under(self.code_dir)
        if (path := spec.env.get("PYTHONPATH")) is not None:
            spec = spec.model_copy(update={"env": spec.env | {"PYTHONPATH": f"{self.code_dir}:{path}"}})
        return spec

    def _hosts(self, spec: JobSpec, pods: list[PodHello]) -> list[Host]:
        return [Host(name=p.pod, address=p.address, python=p.python, workdir=p.workdir, gpus=spec.resources.gpus)
                for p in pods]

    def plan(self, spec: JobSpec, run_id: str, attempt: int = 0, down: frozenset[str] = frozenset()) -> Plan:
        """The first attempt waits for the job's pods as long as a rendezvous may take (scheduling, image
        pulls); a later one for recreated pods up to k8s.rejoin seconds, then goes on with those there."""
        wait = spec.timeouts.rendezvous if self._first else self.rejoin
        if self._held:  # their agents dial in again as the old controller's link broke: seconds
            pods = self.link.await_pods(len(self._held), down, wait, stopped=self.stopped, only=frozenset(self._held))
            pods.sort(key=lambda p: self._held.index(p.pod))
            self._held = []
        else:
            pods = self.link.await_pods(spec.nnodes, down, wait, first=self.rejoin if self._first else 0.0,
                                        stopped=self.stopped)
        self._first = False
        by_name = {p.pod: p for p in pods}
        names = take_healthy(spec, list(by_name), down, what="pod", pool="the connected",
                             fix="see `kubectl get pods` for the job's pods that are not running")
        hosts = self._hosts(spec, [by_name[name] for name in names])
        return plan_hosts(self.in_pods(spec), hosts, run_id=run_id, master_ip=hosts[0].address, attempt=attempt,
                          shared_hosts=False)

    def check(self, plan: Plan, spec: JobSpec) -> Plan:
        """Nothing more to prove cheaply: each pod proved it runs by dialing in."""
        return plan

    def _agent(self, node: NodePlan) -> PodAgentNode:
        return PodAgentNode(node, self.link.take(node.host), agent_argv(node.argv[0], node), agent_env(node))

    def start(self, plan: Plan, spec: JobSpec) -> list[NodeProcess]:
        return start_all(plan.nodes, self._agent, spec, self._standbys, held=True)

    def stand_by(self, spec: JobSpec, run_id: str, attempt: int, down: frozenset[str],
                 plan: Plan | None = None) -> None:
        """A standby on every connected pod that is not down, spares included (plan: on each of its pods, as its
        node)."""
        if plan is not None:
            self._standbys.stand_by(plan.nodes, self._agent, spec, as_planned=True)
            return
        pods = [p for p in self.link.pods() if p.pod not in down]
        if not pods:
            return
        hosts = self._hosts(spec, pods)
        plan = plan_hosts(self.in_pods(spec).at_nnodes(len(hosts)), hosts, run_id=run_id,
                          master_ip=hosts[0].address, attempt=attempt, shared_hosts=False)
        self._standbys.stand_by(plan.nodes, self._agent, spec)

    def stand_down(self) -> None:
        self._standbys.stand_down()

    def attach(self, plan: Plan, spec: JobSpec, resume: Mapping[int, int]) -> list[NodeProcess]:
        """The relay on a session of each node's pod (the pod runs it as it runs an agent), to the agent there."""
        return attach_all(plan.nodes, lambda node: PodAgentNode(node, self.link.take(node.host),
                                                                relay_argv(node.argv[0], node), {}), resume)

    def close(self) -> None:
        """Nothing to release: each session's connection closes with its agent."""
