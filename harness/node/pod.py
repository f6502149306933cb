"""What a worker pod of a rendered Kubernetes job runs, from the job's ConfigMap, with the standard library
only: the pod's image needs Python and torch, never the harness.

    python -I pod.py wait HOST PORT [--timeout S]    unsupervised: wait for the master's rendezvous port
    python -I pod.py serve HOST PORT [--timeout S]   supervised: serve the run's controller

wait: pods start in any order and pod 0's DNS record appears only once it is scheduled; torchrun alone
would retry silently until its own timeout. This says what it waits for and fails clearly.

serve: the pod dials the run's controller (its Service) and says who it is (HELLO: the pod, its completion
index, its Kubernetes node, its Python and directory, a fresh nonce). Then each end proves it holds the run's
key (--key, a file on the job's volume that the controller writes at its start) before the other acts on
anything it says: the controller answers with its nonce and an HMAC of both nonces (CONTROLLER_PROOF), which the
pod checks before it runs any order; the pod answers with its own HMAC (POD_PROOF), which the controller checks
before it sends any. A connection that fails a proof is closed and said; a pod says the controllers it refused
in its next hello, for the run's record. Each connection is one session: the controller sends
one line, a node agent's command and environment to run (then the connection is that agent's stdin and
stdout, as an SSH channel is: targets/k8s/pods.py), or the exit code to end the pod with when the run is over.
The pod always keeps one connection waiting, so the next attempt's agent (or a standby, beside a running
one) starts without a new pod: restarts happen in place. A controller out of reach for --timeout seconds is
the end (exit CONTROLLER_LOST). A controller lost mid-run (its pod evicted, its Kubernetes node gone) ends each
agent's stdin: the agent holds its node for supervision.grace (harness.node.link), and the controller's new pod,
which this pod dials as it dials any, takes it back through a session that runs the relay. SIGTERM (the pod
deleted, a stop) says TERM to each agent, then ends its stdin: the agent stops its node in its grace period, then
the pod exits 143.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import hmac
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

HELLO = "HARNESS-POD "  # the first line a pod sends, then its facts as JSON
CONTROLLER_PROOF = "HARNESS-CONTROLLER "  # the controller's answer: {"nonce", "proof"}
POD_PROOF = "HARNESS-POD-PROOF "  # the pod's: {"proof"}
PROOF_SECONDS = 10.0  # how long either end waits for the other's proof
CONTROLLER_LOST = 75  # EX_TEMPFAIL: the controller (or, unsupervised, the master) never answered
READ_BYTES = 1 << 16
TERM = b"TERM\n"  # the node agent's stop word (harness.node.protocol's Word.TERM: this file ships alone)
# A controller whose Kubernetes node vanished sends no FIN: TCP's keepalive finds it gone within
# KEEPALIVE_IDLE + KEEPALIVE_COUNT x KEEPALIVE_EVERY seconds (25), not the kernel's default two hours.
KEEPALIVE_IDLE, KEEPALIVE_EVERY, KEEPALIVE_COUNT = 10, 5, 3


def wait_for_port(host: str, port: int, timeout: float, interval: float = 1.0) -> float:
    """Seconds waited until a connection succeeded; TimeoutError names the last failure."""
    start = time.monotonic()
    last = "no attempt"
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(interval * 2, 5)):
                return time.monotonic() - start
        except socket.gaierror as exc:
            last = f"name does not resolve yet ({exc.strerror})"
        except OSError as exc:
            last = exc.strerror or str(exc)
        if time.monotonic() - start + interval > timeout:
            raise TimeoutError(f"{host}:{port} not reachable after {timeout:.0f} s (last error: {last})")
        time.sleep(interval)


def wait(host: str, port: int, timeout: float) -> int:
    print(f"harness: waiting for the master's rendezvous port {host}:{port}", flush=True)
    try:
        waited = wait_for_port(host, port, timeout)
    except TimeoutError as exc:
        print(f"harness: {exc}; is node 0 running and is the port open between pods?", file=sys.stderr)
        return CONTROLLER_LOST
    print(f"harness: master reachable after {waited:.1f} s", flush=True)
    return 0


def proof(key: bytes, role: str, asked: str, answered: str, pod: str) -> str:
    """An HMAC of one side's role, the nonce it was asked with, its own and the pod's name: only the key's holders
    can make it, and it is worth nothing on another connection or in the other direction."""
    return hmac.new(key, f"{role}\n{asked}\n{answered}\n{pod}".encode(), hashlib.sha256).hexdigest()


def proven(key: bytes, claimed: object, role: str, asked: str, answered: str, pod: str) -> bool:
    return isinstance(claimed, str) and hmac.compare_digest(claimed, proof(key, role, asked, answered, pod))


def read_line(link: socket.socket, timeout: float) -> tuple[str, bytes]:
    """One line the other end sent (without its newline) and the bytes after it; ConnectionError where the link
    closed first, TimeoutError where nothing whole came in time, ValueError for a line too long to be one."""
    link.settimeout(timeout)
    data = b""
    try:
        while b"\n" not in data:
            if len(data) > READ_BYTES:
                raise ValueError("a line longer than any of the protocol's")
            chunk = link.recv(READ_BYTES)
            if not chunk:
                raise ConnectionError("closed")
            data += chunk
    finally:
        link.settimeout(None)
    line, _, rest = data.partition(b"\n")
    return line.decode(errors="replace"), rest


def hello() -> dict[str, Any]:
    """Who this pod is, from the downward API's variables (the manifests set them) and the process itself."""
    env = os.environ
    return {"pod": env.get("POD_NAME") or socket.gethostname(), "index": int(env.get("POD_INDEX") or 0),
            "machine": env.get("NODE_NAME") or "", "python": sys.executable, "workdir": os.getcwd()}


class Pod:
    """The pod's sessions: one connection waiting for the controller's word, any number running agents."""

    def __init__(self, host: str, port: int, timeout: float, key_path: str) -> None:
        self.host, self.port, self.timeout, self.key_path = host, port, timeout, key_path
        self.refused: list[str] = []  # the controllers this pod refused, said in its next hello
        self.agents: set[subprocess.Popen[bytes]] = set()
        self.sessions: set[socket.socket] = set()  # the running agents' connections
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.waiting: socket.socket | None = None  # the connection waiting for the controller's word

    def connect(self) -> socket.socket | None:
        """A connection to the controller that proved it holds the run's key, and to which this pod proved it
        too; None when none came for the timeout."""
        started, said = time.monotonic(), False
        while not self.stopping.is_set():
            try:
                with open(self.key_path, "rb") as handle:
                    key = handle.read()
                link = socket.create_connection((self.host, self.port), timeout=10)
            except OSError as exc:
                if not said:
                    waiting = f"the run's key at {self.key_path}" if exc.filename == self.key_path else \
                        f"the controller at {self.host}:{self.port}"
                    print(f"harness pod: waiting for {waiting} ({exc.strerror or exc})", flush=True)
                    said = True
            else:
                if (proved := self.prove(link, key)) is not None:
                    return proved
            if time.monotonic() - started > self.timeout:
                return None
            self.stopping.wait(1.0)
        return None

    def prove(self, link: socket.socket, key: bytes) -> socket.socket | None:
        """The link once the controller proved it holds the key and this pod did too; None (the link closed, the
        refusal said and kept for the next hello) where it did not."""
        link.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for option, value in ((socket.TCP_KEEPIDLE, KEEPALIVE_IDLE), (socket.TCP_KEEPINTVL, KEEPALIVE_EVERY),
                              (socket.TCP_KEEPCNT, KEEPALIVE_COUNT)):
            link.setsockopt(socket.IPPROTO_TCP, option, value)
        facts, asked = hello(), secrets.token_hex(16)
        peer = f"{self.host}:{self.port}"
        try:
            link.sendall((HELLO + json.dumps(facts | {"nonce": asked, "refused": self.refused}) + "\n").encode())
            line, _ = read_line(link, PROOF_SECONDS)
            answer = json.loads(line.removeprefix(CONTROLLER_PROOF)) if line.startswith(CONTROLLER_PROOF) else {}
            theirs = str(answer.get("nonce", ""))
            if not proven(key, answer.get("proof"), "controller", asked, theirs, facts["pod"]):
                self.refused.append(f"{link.getpeername()[0]} answering at {peer}: its proof of the run's key did "
                                    f"not match")
                print(f"harness pod: refused the controller at {peer} ({link.getpeername()[0]}): its proof of the "
                      f"run's key did not match; nothing it sends is run", flush=True)
                link.close()
                return None
            link.sendall((POD_PROOF + json.dumps({"proof": proof(key, "pod", theirs, asked, facts["pod"])}) +
                          "\n").encode())
        except (OSError, ValueError, AttributeError) as exc:
            print(f"harness pod: the controller at {peer} broke off its proof ({exc})", flush=True)
            link.close()
            return None
        self.refused = []
        return link

    def serve(self) -> int:
        while True:
            link = self.connect()
            if link is None:
                if self.stopping.is_set():
                    return 128 + signal.SIGTERM
                print(f"harness pod: no controller at {self.host}:{self.port} for {self.timeout:g} s: ending",
                      flush=True)
                return CONTROLLER_LOST
            self.waiting = link
            order, rest = _line(link)
            self.waiting = None
            if order is None:  # the controller went away (or restarts): dial again
                link.close()
                continue
            if "exit" in order:
                link.close()
                self.end_agents()
                return int(order["exit"])
            threading.Thread(target=self.run, args=(link, order, rest), daemon=True).start()

    def run(self, link: socket.socket, order: dict[str, Any], rest: bytes) -> None:
        """One agent, its stdin and stdout on the link, until it ends."""
        try:
            agent = subprocess.Popen(order["run"], env=os.environ | order.get("env", {}), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as exc:
            link.sendall(f"harness pod: cannot start the node agent: {exc}\n".encode())
            link.close()
            return
        with self.lock:
            self.agents.add(agent)
            self.sessions.add(link)
        threading.Thread(target=_feed, args=(link, agent, rest), daemon=True).start()
        assert agent.stdout is not None
        forward = True
        while chunk := os.read(agent.stdout.fileno(), READ_BYTES):
            try:
                if forward:
                    link.sendall(chunk)
            except OSError:  # the controller is gone, or the pod is: the agent sees its stdin end
                forward = False  # and stops its node; what it says meanwhile is read, so that it never blocks
        agent.wait()
        with self.lock:
            self.agents.discard(agent)
            self.sessions.discard(link)
        link.close()

    def stop(self) -> None:
        """SIGTERM (the pod deleted or evicted, its node drained): no more sessions, and each running one ends
        at once, without its node's end: to the controller this pod is lost (its nodes' failures are the
        infrastructure's, the pod a host down), whatever the agents make of their stop. They stop their nodes."""
        self.stopping.set()
        self.tell_agents(TERM)  # before their links end: an agent whose stdin only ended would hold its node
        with self.lock:
            links = [*self.sessions, *([self.waiting] if self.waiting is not None else [])]
        for link in links:
            try:
                if link is not self.waiting:
                    link.sendall(b"harness pod: SIGTERM: this pod is being deleted; its node stops\n")
                link.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.end_agents()

    def tell_agents(self, word: bytes) -> None:
        """A word to every agent whose stdin is still open (one held after its controller was lost has none: the
        kubelet ends it with the pod, after its grace period)."""
        with self.lock:
            agents = list(self.agents)
        for agent in agents:
            with contextlib.suppress(OSError, ValueError):  # an agent that ended, or a stdin _feed closed
                if agent.stdin is not None:
                    agent.stdin.write(word)
                    agent.stdin.flush()

    def end_agents(self) -> None:
        """TERM to every agent, then its stdin's end: each stops its node in its grace period (an agent whose stdin
        only ended would hold it for a new controller); wait for them."""
        self.tell_agents(TERM)
        with self.lock:
            agents = list(self.agents)
        for agent in agents:
            if agent.stdin is not None:
                with contextlib.suppress(OSError):
                    agent.stdin.close()
        for agent in agents:
            agent.wait()


def _line(link: socket.socket) -> tuple[dict[str, Any] | None, bytes]:
    """The controller's one line on a session, and what came after it (the agent's first input)."""
    data = b""
    while b"\n" not in data:
        try:
            chunk = link.recv(READ_BYTES)
        except OSError:
            return None, b""
        if not chunk:
            return None, b""
        data += chunk
    line, _, rest = data.partition(b"\n")
    return json.loads(line), rest


def _feed(link: socket.socket, agent: subprocess.Popen[bytes], rest: bytes) -> None:
    """The controller's bytes to the agent's stdin, until the link ends (then the agent's stdin ends too)."""
    assert agent.stdin is not None
    try:
        chunk = rest
        while True:
            if chunk:
                agent.stdin.write(chunk)
                agent.stdin.flush()
            chunk = link.recv(READ_BYTES)
            if not chunk:
                break
    except (OSError, ValueError):
        pass  # the agent ended, or its stdin was closed by a stop
    with contextlib.suppress(OSError):
        agent.stdin.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["wait", "serve"])
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--code", help="serve: the job's shipped code, first on every node's PYTHONPATH")
    parser.add_argument("--tools", help="serve: the controller's tools for the node agents (py-spy), first on PATH")
    parser.add_argument("--key", help="serve: the run's key, which the controller writes at its start")
    args = parser.parse_args(argv)
    if args.what == "wait":
        return wait(args.host, args.port, args.timeout)
    for variable, first in (("PYTHONPATH", args.code), ("PATH", args.tools)):
        if first:
            os.environ[variable] = first + (f":{os.environ[variable]}" if os.environ.get(variable) else "")
    if args.key is None:
        parser.error("serve needs --key: the controller proves it holds the run's key before the pod runs anything")
    pod = Pod(args.host, args.port, args.timeout, args.key)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=pod.stop, daemon=True).start())
    code = pod.serve()
    pod.end_agents()
    return code


if __name__ == "__main__":
    sys.exit(main())
