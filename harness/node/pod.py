"""What a worker pod of a rendered Kubernetes job runs, from the job's ConfigMap, with the standard library
only: the pod's image needs Python and torch, never the harness.

    python -I pod.py wait HOST PORT [--timeout S]    unsupervised: wait for the master's rendezvous port
    python -I pod.py serve HOST PORT [--timeout S]   supervised: serve the run's controller

wait: pods start in any order and pod 0's DNS record appears only once it is scheduled; torchrun alone
would retry silently until its own timeout. This says what it waits for and fails clearly.

serve: the pod dials the run's controller (its Service) and says who it is (HELLO: the pod, its completion
index, its Kubernetes node, its Python and directory, a fresh nonce). Then each end proves it holds the run's
key (--key, a file on the job's volume that the controller writes at its start) before the other acts on
anything it says: the controller answers with its nonce, the run it serves and its proof (CONTROLLER_PROOF), which
the pod checks before it runs any order; the pod answers with its own proof (POD_PROOF), which the controller
checks before it sends any. Both proofs, and the session's keys, are bound to the whole exchange (Handshake): the
pod's hello as sent (so its name and index), both nonces and the run, so that nothing of it can be changed on the
way. The controller then checks the identity the pod proved against the pods it expects (targets/k8s/pods.py). A
connection that fails a proof is closed and said; a pod says the controllers it refused in its next hello, for
the run's record.

From there the connection is a Channel: every message either way is sealed with keys of this connection alone,
and one that was changed, replayed, reordered or dropped on the way is refused, never acted on, and the link
closed (Channel says why the standard library's own primitives and not TLS or a dependency). Each connection
is one session: the controller sends one message, a node agent's command and environment to run (then the
connection is that agent's stdin and stdout, as an SSH channel is: targets/k8s/pods.py), the exit code to end
the pod with when the run is over, or why it refuses this pod. Every parser on the link bounds what it reads:
the handshake's lines (LINE_BYTES), each message (RECORD_BYTES), JSON's nesting (MAX_DEPTH).

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
import re
import secrets
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

HELLO = "HARNESS-POD "  # the first line a pod sends, then its facts as JSON
CONTROLLER_PROOF = "HARNESS-CONTROLLER "  # the controller's answer: {"nonce", "run", "proof"}
POD_PROOF = "HARNESS-POD-PROOF "  # the pod's: {"proof"}
PROOF_SECONDS = 10.0  # how long either end waits for the other's proof
CONTROLLER_LOST = 75  # EX_TEMPFAIL: the controller (or, unsupervised, the master) never answered
READ_BYTES = 1 << 16  # an agent's output is read, and sent, in messages of at most this
LINE_BYTES = 1 << 16  # the longest line of the handshake either end reads
RECORD_BYTES = 1 << 20  # the longest message either end reads (an order: a node agent's command and environment)
MAX_DEPTH = 4  # the deepest JSON read on the link (the protocol's own is 2: an order's env, a hello's refusals)
KEPT_REFUSALS, REFUSAL_CHARS = 8, 300  # what a pod's hello says of the controllers it refused: the last 8, each cut
REFUSED_PAUSE = 2.0  # seconds a pod the controller refused waits before it dials again
END_SECONDS = 1.0  # how long a closing end waits to say its end while another thread sends
TERM = b"TERM\n"  # the node agent's stop word (harness.node.protocol's Word.TERM: this file ships alone)
# A controller whose Kubernetes node vanished sends no FIN: TCP's keepalive finds it gone within
# KEEPALIVE_IDLE + KEEPALIVE_COUNT x KEEPALIVE_EVERY seconds (25), not the kernel's default two hours.
KEEPALIVE_IDLE, KEEPALIVE_EVERY, KEEPALIVE_COUNT = 10, 5, 3
PROTOCOL = b"harness pod link 2"  # in every proof and key: none is worth anything to another protocol or version
RECORD = struct.Struct(">BI")  # a sealed message's header: its kind and its length
DATA, END = 0, 1  # its kinds: bytes of the session, and the sender's end (what a cut link lacks)
TAG_BYTES = 32  # its MAC, after it
_STRING_OR_BRACKET = re.compile(r'"[^"]*"|[\[\]{}]')  # JSON's strings (their escapes taken out) and its nesting


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


def bounded_json(text: str) -> Any:
    """json.loads for what the other end sent, refusing (ValueError) what nests deeper than MAX_DEPTH: json's
    parser recurses once per level, and 60,000 `[` would end the process on a RecursionError. The nesting is
    counted outside strings, once their escaped backslashes and quotes are taken out (left to right, as JSON
    reads them); it never counts fewer levels than the parser would go down."""
    depth = 0
    for token in _STRING_OR_BRACKET.finditer(text.replace("\\\\", "").replace('\\"', "")):
        if token.group() in ("[", "{"):
            depth += 1
            if depth > MAX_DEPTH:
                raise ValueError(f"JSON nested deeper than {MAX_DEPTH} levels, deeper than any of the protocol's")
        elif token.group() in ("]", "}"):
            depth = max(depth - 1, 0)
    return json.loads(text)


def message(line: bytes, prefix: str) -> dict[str, Any]:
    """A handshake line's JSON object after its prefix; ValueError that says what it is not."""
    text = line.decode("utf-8")  # a UnicodeDecodeError is a ValueError
    if not text.startswith(prefix):
        raise ValueError(f"a line that does not start with {prefix.strip()!r}")
    found = bounded_json(text[len(prefix):])
    if not isinstance(found, dict):
        raise ValueError(f"{prefix.strip()} followed by JSON that is not an object")
    return found


def read_line(link: socket.socket, timeout: float) -> tuple[bytes, bytes]:
    """One line the other end sent (without its newline) and the bytes after it; ConnectionError where the link
    closed first, TimeoutError where nothing whole came within timeout (in all: a trickle never holds an end),
    ValueError for a line longer than LINE_BYTES."""
    deadline = time.monotonic() + timeout
    data = b""
    try:
        while b"\n" not in data:
            if len(data) > LINE_BYTES:
                raise ValueError(f"a line longer than {LINE_BYTES} bytes, longer than any of the protocol's")
            link.settimeout(max(deadline - time.monotonic(), 0.001))
            chunk = link.recv(LINE_BYTES)
            if not chunk:
                raise ConnectionError("closed")
            data += chunk
    finally:
        link.settimeout(None)
    line, _, rest = data.partition(b"\n")
    return line, rest


def keep_alive(link: socket.socket) -> None:
    """TCP's keepalive on the link, at KEEPALIVE_*'s pace: a peer whose machine vanished is found gone."""
    link.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in ((socket.TCP_KEEPIDLE, KEEPALIVE_IDLE), (socket.TCP_KEEPINTVL, KEEPALIVE_EVERY),
                          (socket.TCP_KEEPCNT, KEEPALIVE_COUNT)):
        link.setsockopt(socket.IPPROTO_TCP, option, value)


class Handshake:
    """One connection's proofs and keys, as both ends compute them from the run's key and what was said: the pod's
    hello as sent (its name, index and nonce among it), the controller's nonce and the run it serves. HKDF-SHA256
    (RFC 5869): the exchange's hash is the salt, the run's key the input; each side's proof and each direction's
    keys are expanded from that under labels of their own, so no proof is worth anything on another connection,
    for another pod, in the other direction or as a key, and changing one byte of the hello on the way makes both
    proofs fail."""

    def __init__(self, key: bytes, hello: bytes, nonce: str, run: str) -> None:
        said = b"".join(len(part).to_bytes(4, "big") + part for part in (PROTOCOL, hello, nonce.encode(), run.encode()))
        self._secret = hmac.digest(hashlib.sha256(said).digest(), key, "sha256")  # HKDF-Extract

    def _expand(self, label: str, length: int) -> bytes:
        """HKDF-Expand: length bytes for label."""
        out = block = b""
        while len(out) < length:
            block = hmac.digest(self._secret, block + PROTOCOL + b" " + label.encode() + bytes([len(out) // 32 + 1]),
                                "sha256")
            out += block
        return out[:length]

    def proof(self, role: str) -> str:
        """What `role` (the controller or the pod) shows: only a holder of the run's key can make it."""
        return self._expand(f"{role} proof", 32).hex()

    def proven(self, role: str, claimed: object) -> bool:
        return isinstance(claimed, str) and hmac.compare_digest(claimed.encode(), self.proof(role).encode())

    def channel(self, link: socket.socket, role: str, refuse: Callable[[str], None], pending: bytes = b"") -> Channel:
        """The session on link, for `role`'s end; refuse: where a message it refuses is said; pending: what the
        other end sent after its proof."""
        other = "pod" if role == "controller" else "controller"
        return Channel(link, self._expand(f"{role} to {other}", 64), self._expand(f"{other} to {role}", 64), refuse,
                       pending)


class Refused(ConnectionError):
    """A message the channel refused (said, the link closed): nothing of it was acted on."""


class Channel:
    """A connection after its handshake: every message either way sealed, each direction with keys of its own.

    A message is its header (RECORD: kind, length), its data enciphered, and an HMAC-SHA256 of its sequence number,
    header and enciphered data (encrypt-then-MAC, the MAC checked before anything is deciphered or acted on). The
    sequence numbers are counted, not sent: a message changed, replayed (from this connection or another),
    reordered or dropped on the way fails its MAC; the sender's end is a message of its own (END), so a link cut
    on the way is told from one that ended; a header that claims more than RECORD_BYTES is refused unread.

    Why enciphered, and how: the session carries the node's command and the job's `env:` (values that need not be
    `secrets:` to be private), and a relay on the pods' network (a pod wearing the controller's labels, ARP or DNS
    spoofing) would read them. The worker pods' image has Python and torch, not the harness or its dependencies, so
    this file has the standard library alone: no AES-GCM or ChaCha20-Poly1305 (`cryptography` is the controller's,
    through paramiko, not the pods'); and `ssl` needs Python 3.13 for TLS with a pre-shared key, certificates made
    and shared for the run, and one SSL object read and written from two threads at once, which OpenSSL does not
    allow. So: the keystream is SHAKE-256 of the direction's cipher key and the sequence number (a keyed sponge, the
    construction NIST's KMAC is built on, used as a PRF in counter mode), XORed with the data; both primitives are
    FIPS-approved and C-fast in hashlib (about 140 MB/s here, far beyond a node's output). What it does not hide:
    each message's length and timing."""

    def __init__(self, link: socket.socket, sending: bytes, receiving: bytes, refuse: Callable[[str], None],
                 pending: bytes = b"") -> None:
        self.link = link
        self._send_cipher, self._send_mac = sending[:32], sending[32:]
        self._receive_cipher, self._receive_mac = receiving[:32], receiving[32:]
        self._refuse = refuse
        self._buffer = bytearray(pending)
        self._sent = self._received = 0  # the sequence numbers of the next message either way
        self._lock = threading.Lock()  # one sender at a time: a sequence number and its bytes go together
        self._closed = False  # by this end
        self._ended = False  # by the other end: its END, a cut, a refused message

    @property
    def open(self) -> bool:
        """Whether the session may still carry anything either way."""
        return not (self._closed or self._ended)

    def _seal(self, kind: int, data: bytes) -> bytes:
        sequence = self._sent.to_bytes(8, "big")
        self._sent += 1
        header = RECORD.pack(kind, len(data))
        sealed = _xor(data, hashlib.shake_256(self._send_cipher + sequence).digest(len(data)))
        return header + sealed + hmac.digest(self._send_mac, sequence + header + sealed, "sha256")

    def send(self, data: bytes) -> None:
        """data, in messages of at most READ_BYTES; OSError where the link is closed or broke."""
        with self._lock:
            if self._closed:
                raise ConnectionError("the link is closed")
            for start in range(0, len(data), READ_BYTES):
                self.link.sendall(self._seal(DATA, data[start:start + READ_BYTES]))

    def send_message(self, data: bytes) -> None:
        """data as one message (an order: the other end reads it whole); ValueError for more than RECORD_BYTES."""
        if not 0 < len(data) <= RECORD_BYTES:
            raise ValueError(f"a message of {len(data)} bytes: the pod link carries 1 to {RECORD_BYTES}")
        with self._lock:
            if self._closed:
                raise ConnectionError("the link is closed")
            self.link.sendall(self._seal(DATA, data))

    def recv(self) -> bytes:
        """The next message's data; b"" at the other end's end. ConnectionError where the link was cut (or this end
        closed it); Refused, said and the link closed, for a message that is not the other end's as it sent it."""
        while not self._ended:
            header = self._read(RECORD.size)
            kind, length = RECORD.unpack(header)
            if length > RECORD_BYTES:
                raise self.refuse(f"a message of {length} bytes, more than any of the link's ({RECORD_BYTES})")
            sealed = self._read(length + TAG_BYTES)
            sequence = self._received.to_bytes(8, "big")
            expected = hmac.digest(self._receive_mac, sequence + header + sealed[:length], "sha256")
            if not hmac.compare_digest(sealed[length:], expected):
                raise self.refuse("a message whose MAC did not match: changed, replayed, reordered or dropped on "
                                  "the way")
            self._received += 1
            if kind == END:
                self._ended = True
            elif kind != DATA:
                raise self.refuse(f"a message of a kind the link does not have ({kind})")
            elif length:
                return _xor(sealed[:length], hashlib.shake_256(self._receive_cipher + sequence).digest(length))
        return b""

    def recv_ready(self) -> bytes | None:
        """Once a selector said the link is readable: one read of it, and the data of every message now whole (None:
        none is yet; b"": the other end's end). Errors as recv's."""
        if self._ended:
            return b""
        try:
            chunk = self.link.recv(READ_BYTES)
        except OSError:
            self._ended = True
            raise
        if not chunk:
            self._ended = True
            raise ConnectionError("the link ended without the other end's end: cut on the way, or its end is gone")
        self._buffer += chunk
        data = []
        while not self._ended and len(self._buffer) >= RECORD.size and \
                len(self._buffer) >= RECORD.size + min(RECORD.unpack_from(self._buffer)[1], RECORD_BYTES) + TAG_BYTES:
            data.append(self.recv())  # a whole message: read from the buffer alone (b"": the end, said next time)
        return b"".join(data) if data else None

    def _read(self, count: int) -> bytes:
        try:
            while len(self._buffer) < count:
                chunk = self.link.recv(max(READ_BYTES, count - len(self._buffer)))
                if not chunk:
                    raise ConnectionError("the link ended without the other end's end: cut on the way, or its end "
                                          "is gone")
                self._buffer += chunk
        except OSError:
            self._ended = True
            raise
        data = bytes(self._buffer[:count])
        del self._buffer[:count]
        return data

    def refuse(self, reason: str) -> Refused:
        """The link closed at once and reason said: returns the error to raise."""
        self._ended = True
        self.abort()
        self._refuse(reason)
        return Refused(reason)

    def peer_closed(self) -> bool:
        """Block until the other end sends or closes; True where it closed (a waiting connection's watch)."""
        if self._buffer:
            return False
        try:
            return not self.link.recv(1, socket.MSG_PEEK)
        except OSError:
            return True

    def close(self) -> None:
        """This end's end, then the link closed: the other end reads that the session ended here, not that it was
        cut. Said without waiting on a stuck sender or a full buffer (then the other end reads a cut)."""
        if self._lock.acquire(timeout=END_SECONDS):
            try:
                if not self._closed:
                    with contextlib.suppress(OSError):
                        self.link.send(self._seal(END, b""), socket.MSG_DONTWAIT)
            finally:
                self._lock.release()
        self.abort()

    def abort(self) -> None:
        """The link closed without an end (a waiting connection never used, a refused one)."""
        self._closed = True
        with contextlib.suppress(OSError):
            self.link.shutdown(socket.SHUT_RDWR)
        self.link.close()


def _xor(data: bytes, keystream: bytes) -> bytes:
    return (int.from_bytes(data, "big") ^ int.from_bytes(keystream, "big")).to_bytes(len(data), "big")


def checked_order(found: object) -> dict[str, Any]:
    """The controller's word on a session, as the pod takes it; ValueError for anything else."""
    if isinstance(found, dict):
        run, env = found.get("run"), found.get("env")
        if set(found) == {"run", "env"} and isinstance(run, list) and run and all(isinstance(a, str) for a in run) \
                and isinstance(env, dict) and all(isinstance(value, str) for value in env.values()):
            return found
        if set(found) == {"exit"} and type(found["exit"]) is int and 0 <= found["exit"] <= 255:
            return found
        if set(found) == {"refused"} and isinstance(found["refused"], str):
            return found
    raise ValueError('expected {"run": [ARG, ...], "env": {NAME: VALUE}}, {"exit": 0-255} or {"refused": WHY}')


def hello() -> dict[str, Any]:
    """Who this pod is, from the downward API's variables (the manifests set them) and the process itself."""
    env = os.environ
    return {"pod": env.get("POD_NAME") or socket.gethostname(), "index": int(env.get("POD_INDEX") or 0),
            "machine": env.get("NODE_NAME") or "", "python": sys.executable, "workdir": os.getcwd()}


class Pod:
    """The pod's sessions: one connection waiting for the controller's word, any number running agents."""

    def __init__(self, host: str, port: int, timeout: float, key_path: str) -> None:
        self.host, self.port, self.timeout, self.key_path = host, port, timeout, key_path
        self.refused: list[str] = []  # the controllers (and messages) this pod refused, said in its next hello
        self.agents: set[subprocess.Popen[bytes]] = set()
        self.sessions: set[Channel] = set()  # the running agents' connections
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.waiting: Channel | None = None  # the connection waiting for the controller's word
        self.dialing: socket.socket | None = None  # the connection whose proofs are under way
        self.serving: str | None = None  # the run whose controller this pod last proved, said when it changes

    @property
    def peer(self) -> str:
        return f"{self.host}:{self.port}"

    def connect(self) -> Channel | None:
        """A session with the controller, once it proved it holds the run's key and this pod did too; None when
        none came for the timeout."""
        started, said = time.monotonic(), False
        while not self.stopping.is_set():
            try:
                with open(self.key_path, "rb") as handle:
                    key = handle.read()
                link = socket.create_connection((self.host, self.port), timeout=10)
                with self.lock:  # stop() breaks off the proofs, which wait seconds for the controller's
                    if self.stopping.is_set():
                        link.close()
                        return None
                    self.dialing = link
            except OSError as exc:
                if not said:
                    waiting = f"the run's key at {self.key_path}" if exc.filename == self.key_path else \
                        f"the controller at {self.peer}"
                    print(f"harness pod: waiting for {waiting} ({exc.strerror or exc})", flush=True)
                    said = True
            else:
                proved = self.prove(link, key)
                with self.lock:
                    self.dialing = None
                if proved is not None:
                    return proved
            if time.monotonic() - started > self.timeout:
                return None
            self.stopping.wait(1.0)
        return None

    def prove(self, link: socket.socket, key: bytes) -> Channel | None:
        """The session once the controller proved it holds the key and this pod did too; None (the link closed,
        the refusal said and kept for the next hello) where it did not."""
        facts = hello() | {"nonce": secrets.token_hex(16), "refused": self.refused}
        said = (HELLO + json.dumps(facts)).encode()
        address = self.host
        try:
            keep_alive(link)
            address = link.getpeername()[0]
            link.sendall(said + b"\n")
            line, rest = read_line(link, PROOF_SECONDS)
            answer = message(line, CONTROLLER_PROOF)
            run = str(answer.get("run", ""))
            handshake = Handshake(key, said, str(answer.get("nonce", "")), run)
            proved = handshake.proven("controller", answer.get("proof"))
            if proved:
                link.sendall((POD_PROOF + json.dumps({"proof": handshake.proof("pod")}) + "\n").encode())
        except ValueError as exc:
            self.refuse(address, f"its answer is not the pod link's ({exc})")
            link.close()
            return None
        except OSError as exc:
            print(f"harness pod: the controller at {self.peer} broke off its proof ({exc})", flush=True)
            link.close()
            return None
        if not proved:
            self.refuse(address, "its proof of the run's key did not match")
            link.close()
            return None
        self.refused = []
        if self.serving != run:
            print(f"harness pod: serving run {run}'s controller at {self.peer} ({address})", flush=True)
            self.serving = run
        return handshake.channel(link, "pod", lambda reason: self.refuse(address, reason, "the link is closed and "
                                                                          "nothing it carried is run"), rest)

    def refuse(self, address: str, reason: str, then: str = "nothing it sends is run") -> None:
        """A controller (or one of its messages) refused: said here, and kept for the next hello."""
        self.refused = [*self.refused, f"{address} answering at {self.peer}: {reason}"[:REFUSAL_CHARS]
                        ][-KEPT_REFUSALS:]
        print(f"harness pod: refused the controller at {self.peer} ({address}): {reason}; {then}", flush=True)

    def serve(self) -> int:
        while True:
            channel = self.connect()
            if channel is None:
                if self.stopping.is_set():
                    return 128 + signal.SIGTERM
                print(f"harness pod: no controller at {self.peer} for {self.timeout:g} s: ending", flush=True)
                return CONTROLLER_LOST
            with self.lock:  # a SIGTERM before this ends the waiting session here, one after through stop()
                if self.stopping.is_set():
                    channel.abort()
                    return 128 + signal.SIGTERM
                self.waiting = channel
            order = _order(channel)
            self.waiting = None
            if order is None:  # the controller went away (or restarts), or what it sent was refused: dial again
                channel.abort()
            elif "refused" in order:
                channel.close()
                print(f"harness pod: the controller at {self.peer} refused this pod: {order['refused']}", flush=True)
                self.stopping.wait(REFUSED_PAUSE)
            elif "exit" in order:
                channel.close()
                self.end_agents()
                return int(order["exit"])
            else:
                threading.Thread(target=self.run, args=(channel, order["run"], order["env"]), daemon=True).start()

    def run(self, channel: Channel, argv: list[str], env: dict[str, str]) -> None:
        """One agent, its stdin and stdout on the session, until it ends."""
        try:
            agent = subprocess.Popen(argv, env=os.environ | env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as exc:
            with contextlib.suppress(OSError):
                channel.send(f"harness pod: cannot start the node agent: {exc}\n".encode())
            channel.close()
            return
        with self.lock:
            self.agents.add(agent)
            self.sessions.add(channel)
        threading.Thread(target=_feed, args=(channel, agent), daemon=True).start()
        assert agent.stdout is not None
        forward = True
        while chunk := os.read(agent.stdout.fileno(), READ_BYTES):
            try:
                if forward:
                    channel.send(chunk)
            except OSError:  # the controller is gone, or the pod is: the agent sees its stdin end
                forward = False  # and stops its node; what it says meanwhile is read, so that it never blocks
        agent.wait()
        with self.lock:
            self.agents.discard(agent)
            self.sessions.discard(channel)
        channel.close()

    def stop(self) -> None:
        """SIGTERM (the pod deleted or evicted, its node drained): no more sessions, and each running one ends
        at once, without its node's end: to the controller this pod is lost (its nodes' failures are the
        infrastructure's, the pod a host down), whatever the agents make of their stop. They stop their nodes."""
        self.stopping.set()
        self.tell_agents(TERM)  # before their links end: an agent whose stdin only ended would hold its node
        with self.lock:
            sessions, waiting, dialing = list(self.sessions), self.waiting, self.dialing
        if dialing is not None:
            with contextlib.suppress(OSError):
                dialing.shutdown(socket.SHUT_RDWR)
        for channel in sessions:
            with contextlib.suppress(OSError):
                channel.send(b"harness pod: SIGTERM: this pod is being deleted; its node stops\n")
            channel.close()
        if waiting is not None:
            waiting.abort()
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


def _order(channel: Channel) -> dict[str, Any] | None:
    """The controller's one message on a waiting session (checked_order); None where the link ended first or the
    message was refused (said)."""
    try:
        data = channel.recv()
        return checked_order(bounded_json(data.decode())) if data else None
    except ValueError as exc:  # a UnicodeDecodeError, JSON's own errors and checked_order's are ValueErrors
        channel.refuse(f"an order the pod does not take ({exc})")
    except OSError:
        pass
    return None


def _feed(channel: Channel, agent: subprocess.Popen[bytes]) -> None:
    """The controller's bytes to the agent's stdin, until the session ends (then the agent's stdin ends too)."""
    assert agent.stdin is not None
    try:
        while data := channel.recv():
            agent.stdin.write(data)
            agent.stdin.flush()
    except (OSError, ValueError):
        pass  # the session ended, was cut or refused a message (said); or the agent ended, or a stop closed its stdin
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
