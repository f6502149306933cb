"""The pod link (node/pod.py, targets/k8s/pods.py): a worker pod and the controller each prove they hold the run's
key before the other acts on anything it says, and from there every message either way is sealed. A rogue on
either side gets nothing run and nothing sent; a relay without the key between a real pod and the real controller
passes both proofs but reads nothing of a session and changes nothing of it; a holder of the key is refused where
it says it is a pod it is not; every parser on the link bounds what it reads. Each refusal is said in the run's
stream (the supervised pods with rogues beside them: tests/integration/test_k8s_pods.py)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from harness.node.pod import (
    CONTROLLER_PROOF,
    HELLO,
    POD_PROOF,
    PROOF_SECONDS,
    RECORD,
    TAG_BYTES,
    TERM,
    Handshake,
    Pod,
    Refused,
    bounded_json,
    message,
    read_line,
)
from harness.node.protocol import Word, word_line
from harness.targets.k8s.pods import PodLink, WorkerPods

POD_SCRIPT = Path(__file__).resolve().parents[2] / "harness/node/pod.py"
WORKERS = WorkerPods(("job-node",), 2)  # an Indexed Job `job-node` of 2 pods
POD_0, POD_1 = "job-node-0-abcde", "job-node-1-fghij"
RUN = "job-20260101-000000-abcd"
MAC_REFUSAL = "a message whose MAC did not match: changed, replayed, reordered or dropped on the way"


def _until(condition: Callable[[], object], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout  # guard: each step is a loopback round trip or a pod's start
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(condition())


class Controller:
    """The controller's real end of the link on loopback, with the run's key written as the controller writes it
    (commands.k8s_controller); said: what it says into the run's stream."""

    def __init__(self, directory: Path) -> None:
        self.key_path = directory / "link-key"
        self.key_path.write_text(secrets.token_hex(32))
        self.key = self.key_path.read_bytes()
        self.link = PodLink(0, self.key, RUN, WORKERS, host="127.0.0.1")
        self.port = self.link._server.getsockname()[1]
        self.said: list[str] = []
        self.link.announce_to(self.said.append)

    def names(self) -> list[str]:
        return [p.pod for p in self.link.pods()]


class PodProcess:
    """A worker pod's real end, node/pod.py as the pods run it (`python -I pod.py serve`), dialing host:port; its
    output, line by line."""

    def __init__(self, port: int, key_path: Path, name: str, index: int) -> None:
        env = {"PATH": os.environ["PATH"], "POD_NAME": name, "POD_INDEX": str(index)}
        self.process = subprocess.Popen([sys.executable, "-I", str(POD_SCRIPT), "serve", "127.0.0.1", str(port),
                                         "--timeout", "60", "--key", str(key_path)], env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    def said(self, start: str) -> bool:
        return any(line.startswith(start) for line in self.lines)

    def end(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=30)


@pytest.fixture
def pods() -> Iterator[Callable[..., PodProcess]]:
    """Start real pods; each is deleted (SIGTERM) at the test's end."""
    started: list[PodProcess] = []

    def start(*args: object) -> PodProcess:
        started.append(PodProcess(*args))  # type: ignore[arg-type]
        return started[-1]

    yield start
    for pod in started:
        pod.end()


Tamper = Callable[[int, str, int, bytes], list[bytes]]


class Relay:
    """A relay without the key between pods and the controller (a pod wearing the controller's labels, ARP or DNS
    spoofing): it knows the protocol, passes the handshake's lines as they are (the pod's hello and proof, the
    controller's proof), then each sealed message through tamper(connection, direction, number, message), which
    says what to pass on in its place. seen: every byte that crossed it."""

    def __init__(self, port: int, tamper: Tamper = lambda connection, direction, number, sealed: [sealed]) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port, self.target, self.tamper = self.server.getsockname()[1], port, tamper
        self.seen = bytearray()
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                pod, _ = self.server.accept()
            except OSError:
                return
            controller = socket.create_connection(("127.0.0.1", self.target))
            number, self.connections = self.connections, self.connections + 1
            threading.Thread(target=self._pump, args=(pod, controller, number, "to controller", 2), daemon=True).start()
            threading.Thread(target=self._pump, args=(controller, pod, number, "to pod", 1), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, connection: int, direction: str, lines: int) -> None:
        data = bytearray()

        def fill() -> None:
            if not (chunk := source.recv(1 << 16)):
                raise EOFError
            self.seen += chunk
            data.extend(chunk)

        def take(count: int) -> bytes:
            while len(data) < count:
                fill()
            taken = bytes(data[:count])
            del data[:count]
            return taken

        try:
            for _ in range(lines):
                while b"\n" not in data:
                    fill()
                sink.sendall(take(data.index(b"\n") + 1))
            number = 0
            while True:
                header = take(RECORD.size)
                sealed = header + take(RECORD.unpack(header)[1] + TAG_BYTES)
                for passed in self.tamper(connection, direction, number, sealed):
                    sink.sendall(passed)
                number += 1
        except (OSError, EOFError):
            pass
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


def _order(argv: list[str], env: dict[str, str] | None = None) -> bytes:
    return json.dumps({"run": argv, "env": env or {}}).encode()


def _append(path: Path, word: str) -> list[str]:
    """An order's command whose only trace is word, appended to path: whether it ran, and how often."""
    return [sys.executable, "-c", "import pathlib, sys; pathlib.Path(sys.argv[1]).open('a').write(sys.argv[2] + '\\n')",
            str(path), word]


def _output(session) -> bytes:
    """Everything the pod's agent said on a session, until the pod's end of it."""
    return b"".join(iter(session.recv, b""))


def test_a_keyless_relay_passes_both_proofs_but_reads_nothing_of_a_session_and_changes_nothing(tmp_path, pods):
    """The relay sits where the pod dials (its hello and both proofs pass through it as they are): the session
    works, and of the order's command, its env and the agent's stdin and stdout nothing crosses it in clear."""
    controller = Controller(tmp_path)
    relay = Relay(controller.port)
    pod = pods(relay.port, controller.key_path, POD_0, 0)
    assert _until(lambda: controller.names() == [POD_0]), (controller.said, pod.lines)
    private, marker, word = (secrets.token_hex(16) for _ in range(3))
    show = f"import os, sys; print(os.environ['PRIVATE'], sys.stdin.readline().strip()[::-1])  # {marker}"
    session = controller.link.take(POD_0)
    session.send_message(_order([sys.executable, "-c", show], {"PRIVATE": private}))
    session.send(f"{word}\n".encode())
    assert _output(session) == f"{private} {word[::-1]}\n".encode()
    assert relay.seen.count(b"HARNESS-POD-PROOF ") >= 1  # it saw the handshake: it is where the pod dials
    assert not [secret for secret in (private, marker, word, word[::-1]) if secret.encode() in relay.seen]
    assert controller.said == [] and not pod.said("harness pod: refused")
    serving = f"harness pod: serving run {RUN}'s controller at 127.0.0.1:{relay.port} (127.0.0.1)"
    assert _until(lambda: serving in pod.lines), pod.lines  # the pod's stderr, read apart from the session's output
    controller.link.dismiss(0)
    assert pod.process.wait(timeout=30) == 0


def _flip(sealed: bytes) -> list[bytes]:
    """One bit of the sealed data changed (the first, or the MAC's where there is none)."""
    changed = bytearray(sealed)
    changed[RECORD.size] ^= 1
    return [bytes(changed)]


def _tampering(how: str) -> Tamper:
    """What the relay does to the controller's messages to the pod: to the first session's first (its order) and
    second (the agent's first input); replayed: the first session's order instead of the second session's."""
    kept: dict[str, bytes] = {}

    def tamper(connection: int, direction: str, number: int, sealed: bytes) -> list[bytes]:
        if direction != "to pod":
            return [sealed]
        if how == "changed" and (connection, number) == (0, 0):
            return _flip(sealed)
        if how == "dropped" and (connection, number) == (0, 0):
            return []
        if how == "reordered" and (connection, number) == (0, 0):
            kept["order"] = sealed
            return []
        if how == "reordered" and (connection, number) == (0, 1):
            return [sealed, kept["order"]]
        if how == "replayed" and (connection, number) == (0, 0):
            kept["order"] = sealed
        if how == "replayed" and (connection, number) == (1, 0):
            return [kept["order"]]
        return [sealed]

    return tamper


@pytest.mark.parametrize("how", ["changed", "dropped", "reordered", "replayed"])
def test_a_message_the_relay_changed_dropped_reordered_or_replayed_is_refused_and_nothing_runs(tmp_path, pods, how):
    """The controller sends an order and the agent's first input; the relay changes a bit of the order, drops it,
    swaps the two, or (the first session run as sent) puts the first session's order in place of the second's.
    The pod refuses the first message that is not the controller's as it sent it, closes the link and runs
    nothing; its next hello says so, and the controller says it in the run's stream."""
    controller = Controller(tmp_path)
    relay = Relay(controller.port, _tampering(how))
    pod = pods(relay.port, controller.key_path, POD_0, 0)
    ran = tmp_path / "ran"
    assert _until(lambda: controller.names() == [POD_0]), (controller.said, pod.lines)
    if how == "replayed":
        first = controller.link.take(POD_0)
        first.send_message(_order(_append(ran, "first")))
        assert _output(first) == b""
        assert _until(lambda: controller.names() == [POD_0]), pod.lines  # its next connection waits
    session = controller.link.take(POD_0)
    session.send_message(_order(_append(ran, "second")))
    with contextlib.suppress(OSError):  # the pod may have refused the order and closed the link already
        session.send(b"the agent's first input\n")
    refusal = f"127.0.0.1 answering at 127.0.0.1:{relay.port}: {MAC_REFUSAL}"
    assert _until(lambda: f"pod {POD_0} refused a controller that answered it: {refusal}" in controller.said), \
        (controller.said, pod.lines)
    said = f"harness pod: refused the controller at 127.0.0.1:{relay.port} (127.0.0.1): {MAC_REFUSAL}; the link is " \
           f"closed and nothing it carried is run"
    assert _until(lambda: said in pod.lines), pod.lines  # its reader may take the line after the pod's next dial
    with pytest.raises(ConnectionError):
        _output(session)  # the pod closed it without its end
    assert (ran.read_text().splitlines() if ran.exists() else []) == (["first"] if how == "replayed" else [])
    controller.link.dismiss(0)
    assert pod.process.wait(timeout=30) == 0


def test_a_pod_deleted_while_it_waits_for_the_controllers_proof_ends_at_once(tmp_path, pods):
    """SIGTERM while the pod's hello waits for the controller's proof (a controller that never answers): the pod
    breaks off the proof and ends, not after PROOF_SECONDS and another dial."""
    key_path = tmp_path / "link-key"
    key_path.write_text(secrets.token_hex(32))
    with socket.create_server(("127.0.0.1", 0)) as server:
        pod = pods(server.getsockname()[1], key_path, POD_0, 0)
        server.settimeout(60)
        connection, _ = server.accept()
        with connection:
            connection.settimeout(60)
            assert connection.recv(4096).startswith(HELLO.encode()), "the pod's hello, then it waits for a proof"
            pod.process.send_signal(signal.SIGTERM)
            assert pod.process.wait(timeout=PROOF_SECONDS - 1) == 128 + signal.SIGTERM, pod.lines


def test_a_message_from_the_pod_that_the_relay_changed_is_refused_and_said(tmp_path, pods):
    """The other way: the agent's first output, one bit changed on the way, is refused before anything of it is
    read, the link closed, and the controller says so in the run's stream."""
    controller = Controller(tmp_path)
    relay = Relay(controller.port, lambda connection, direction, number, sealed:
                  _flip(sealed) if (connection, direction, number) == (0, "to controller", 0) else [sealed])
    pod = pods(relay.port, controller.key_path, POD_0, 0)
    assert _until(lambda: controller.names() == [POD_0]), (controller.said, pod.lines)
    session = controller.link.take(POD_0)
    session.send_message(_order([sys.executable, "-c", "print('said by the agent')"]))
    with pytest.raises(ConnectionError, match="MAC did not match"):
        session.recv()
    assert controller.said == [f"refused a message from pod {POD_0} (127.0.0.1): {MAC_REFUSAL}; the link is closed "
                               f"and nothing it carried was acted on"]
    assert not session.open


def test_a_session_ended_by_its_sender_is_told_from_one_cut_on_the_way(tmp_path):
    """The sender's end is a sealed message of its own: a link that ends without it (a relay that drops the end,
    then closes) was cut, and the reader knows."""
    handshake = Handshake(b"k" * 64, b"hello", "nonce", RUN)
    for closing, read in (("close", b""), ("cut", None)):
        controller_end, pod_end = socket.socketpair()
        sender = handshake.channel(controller_end, "controller", pytest.fail)
        reader = handshake.channel(pod_end, "pod", pytest.fail)
        sender.send(b"all of it")
        if closing == "close":
            sender.close()
        else:
            controller_end.shutdown(socket.SHUT_RDWR)
        assert reader.recv() == b"all of it"
        if read is None:
            with pytest.raises(ConnectionError, match="cut on the way"):
                reader.recv()
        else:
            assert reader.recv() == read
        reader.abort()
        sender.abort()


def test_a_selectors_reads_give_each_sealed_message_once_it_is_whole_and_then_the_end():
    """The controller reads pods through its one selector thread (control/output.py's Streams): a read takes what
    came, parts of a message say nothing yet, a whole one is given, the sender's end after it; a message changed on
    the way is refused as recv refuses it."""
    handshake = Handshake(b"k" * 64, b"hello", "nonce", RUN)
    wire, relay = socket.socketpair()
    sender = handshake.channel(wire, "pod", pytest.fail)
    sender.send(b"first")
    sender.send(b"second")
    sender.close()
    sealed = b""
    while chunk := relay.recv(1 << 16):
        sealed += chunk
    refused: list[str] = []
    for damage in (None, 8):
        controller_end, pod_end = socket.socketpair()
        reader = handshake.channel(controller_end, "controller", refused.append)
        sent = bytearray(sealed)
        if damage is not None:
            sent[damage] ^= 1
        got = []
        with contextlib.suppress(Refused) if damage is not None else contextlib.nullcontext():
            for at in range(0, len(sent), 7):  # in parts of 7 bytes, the link readable after each
                pod_end.sendall(sent[at:at + 7])
                if (data := reader.recv_ready()) is not None:
                    got.append(data)
        if damage is None:
            assert got == [b"first", b"second", b""] and reader.recv_ready() == b""
        else:
            assert got == [] and len(refused) == 1 and not reader.open, "refused before anything of it is given"
        pod_end.close()
        reader.abort()
    relay.close()


def _key_holder(port: int, key: bytes, pod: str, index: int, source: str = "127.0.0.1") -> list[bytes]:
    """A holder of the run's key (any process of any pod of the job) that says it is pod `pod` of index `index`
    from address source, and proves the key: what the controller sends it."""
    link = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
    said = (HELLO + json.dumps({"pod": pod, "index": index, "machine": "", "python": sys.executable, "workdir": "/",
                                "nonce": secrets.token_hex(16)})).encode()
    link.sendall(said + b"\n")
    line, _ = read_line(link, 10)
    answer = message(line, CONTROLLER_PROOF)
    handshake = Handshake(key, said, answer["nonce"], answer["run"])
    link.sendall((POD_PROOF + json.dumps({"proof": handshake.proof("pod")}) + "\n").encode())
    return list(iter(handshake.channel(link, "pod", pytest.fail).recv, b""))


def test_a_key_holder_cannot_say_it_is_another_pod_or_take_its_index(tmp_path, pods):
    """Pod 0 is connected. A holder of the key that says it is another pod of index 0, pod 0 itself from another
    address, a pod whose name is not its index's, or an index the job does not have, is refused with a line that
    says why (sealed: it proved the key), sent nothing else, and said once in the run's stream; pod 0 stays the
    only pod. One that says it is a pod nobody is is taken."""
    controller = Controller(tmp_path)
    pod = pods(controller.port, controller.key_path, POD_0, 0)
    assert _until(lambda: controller.names() == [POD_0]), (controller.said, pod.lines)
    claims = [
        ("job-node-0-zzzzz", 0, "127.0.0.1", f"index 0 is pod {POD_0}'s, connected from 127.0.0.1"),
        (POD_0, 0, "127.0.0.2", f"pod {POD_0} is connected from 127.0.0.1"),
        ("job-node-0-zzzzz", 1, "127.0.0.1",
         "job-node-0-zzzzz is not a name of the job's worker pod of index 1 (job-node-1-xxxxx, index 0 to 1)"),
        ("job-node-2-zzzzz", 2, "127.0.0.1",
         "job-node-2-zzzzz is not a name of the job's worker pod of index 2 (job-node-2-xxxxx, index 0 to 1)"),
    ]
    for name, index, source, why in claims:
        told = _key_holder(controller.port, controller.key, name, index, source)
        assert [json.loads(m) for m in told] == [{"refused": f"it holds the run's key, but {why}"}]
        _key_holder(controller.port, controller.key, name, index, source)  # again: said once
        said = (f"refused a worker pod's connection from {source} (it says it is pod {name}, index {index}): it "
                f"holds the run's key, but {why}; it was sent nothing else")
        assert _until(lambda said=said: said in controller.said), controller.said  # the pod is told, then it is said
        assert controller.said[-1] == said
        assert controller.names() == [POD_0]
    assert len(controller.said) == len(claims)
    taken = threading.Thread(target=_key_holder, args=(controller.port, controller.key, POD_1, 1), daemon=True)
    taken.start()
    assert _until(lambda: controller.names() == [POD_0, POD_1]), controller.said
    controller.link.dismiss(0)
    taken.join(timeout=30)
    assert pod.process.wait(timeout=30) == 0


def test_the_controllers_answer_nested_60000_deep_is_refused_with_a_line_not_a_recursion_error(tmp_path, pods):
    """A controller without the key answers `HARNESS-CONTROLLER ` and 60,000 `[`: the pod says it refused it and
    why, and runs on (json's parser would have ended it on a RecursionError)."""
    key_path = tmp_path / "link-key"
    key_path.write_text(secrets.token_hex(32))
    impostor = socket.create_server(("127.0.0.1", 0))
    port = impostor.getsockname()[1]

    def answer() -> None:
        peer, _ = impostor.accept()
        impostor.close()
        read_line(peer, 10)
        peer.sendall(CONTROLLER_PROOF.encode() + b"[" * 60_000 + b"\n")
        peer.recv(1)

    threading.Thread(target=answer, daemon=True).start()
    pod = pods(port, key_path, POD_0, 0)
    refusal = f"harness pod: refused the controller at 127.0.0.1:{port} (127.0.0.1): its answer is not the pod " \
              f"link's (JSON nested deeper than 4 levels, deeper than any of the protocol's); nothing it sends is run"
    assert _until(lambda: refusal in pod.lines), pod.lines
    assert pod.process.poll() is None and not [line for line in pod.lines if "Traceback" in line or "Error" in line]


def test_an_order_nested_60000_deep_from_a_key_holder_is_refused_and_nothing_runs(tmp_path, pods):
    """A holder of the key answering as the controller proves it, then orders 60,000 `[`: refused, said, the link
    closed; the pod dials again."""
    key_path = tmp_path / "link-key"
    key_path.write_text(secrets.token_hex(32))
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    dialed = threading.Event()

    def order() -> None:
        peer, _ = server.accept()
        line, _ = read_line(peer, 10)
        handshake = Handshake(key_path.read_bytes(), line, "nonce", RUN)
        peer.sendall((CONTROLLER_PROOF + json.dumps({"nonce": "nonce", "run": RUN,
                                                     "proof": handshake.proof("controller")}) + "\n").encode())
        read_line(peer, 10)
        handshake.channel(peer, "controller", pytest.fail).send_message(b"[" * 60_000)
        server.accept()  # the pod's next dial
        dialed.set()

    threading.Thread(target=order, daemon=True).start()
    pod = pods(port, key_path, POD_0, 0)
    assert dialed.wait(timeout=30), pod.lines
    refused = (f"harness pod: refused the controller at 127.0.0.1:{port} (127.0.0.1): an order the pod does not take "
               f"(JSON nested deeper than 4 levels, deeper than any of the protocol's); the link is closed and nothing "
               f"it carried is run")
    assert _until(lambda: refused in pod.lines), pod.lines  # its line may reach the reader after its next dial
    assert pod.process.poll() is None
    server.close()


def test_a_hello_nested_60000_deep_is_closed_and_the_controller_runs_on(tmp_path, monkeypatch):
    """The same against the controller: a connection whose hello nests 60,000 deep is closed (it is no pod's), and
    no thread of the controller dies of it."""
    died: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: died.append(args.exc_value))
    controller = Controller(tmp_path)
    nested = socket.create_connection(("127.0.0.1", controller.port), timeout=10)
    nested.sendall(HELLO.encode() + b"[" * 60_000 + b"\n")
    assert nested.recv(1) == b""
    assert died == [] and controller.said == [] and controller.names() == []
    controller.link.dismiss(0)


def test_nesting_is_counted_outside_strings_as_json_reads_them():
    assert bounded_json('{"a": "[[[[[[", "b": ["\\\\", "\\"[[[[[[[", [[1]]]}') == \
        {"a": "[[[[[[", "b": ["\\", '"[[[[[[[', [[1]]]}
    with pytest.raises(ValueError, match="nested deeper than 4 levels"):
        bounded_json('[[[["\\\\"], [[1]]]]')
    with pytest.raises(ValueError, match="nested deeper than 4 levels"):
        bounded_json("[" * 60_000)


def test_a_pod_and_the_controller_prove_the_runs_key_and_a_rogue_on_either_side_gets_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    controller = Controller(tmp_path)
    link, port, said, key_path = controller.link, controller.port, controller.said, controller.key_path
    monkeypatch.setenv("POD_NAME", POD_0)
    monkeypatch.setenv("POD_INDEX", "0")
    real = Pod("127.0.0.1", port, 10, str(key_path))
    waiting = real.connect()  # kept: a closed connection is no longer offered
    assert waiting is not None
    assert _until(lambda: [p.pod for p in link.pods()] == [POD_0]), link.pods()

    # A worker that knows the pod's name and index but not the key: refused after the controller's proof alone.
    rogue = socket.create_connection(("127.0.0.1", port))
    rogue.sendall((HELLO + json.dumps({"pod": "job-node-0-evil0", "index": 0, "machine": "", "python": "python",
                                       "workdir": "/", "nonce": "n"}) + "\n").encode())
    line, rest = read_line(rogue, 10)
    assert line.startswith(CONTROLLER_PROOF.encode()) and rest == b""
    rogue.sendall((POD_PROOF + json.dumps({"proof": "0" * 64}) + "\n").encode())
    rogue.settimeout(10)
    assert rogue.recv(1 << 16) == b"", "a pod that failed its proof is sent nothing"
    assert _until(lambda: any("refused a worker pod's connection from 127.0.0.1" in s for s in said)), said
    assert said == ["refused a worker pod's connection from 127.0.0.1 (it says it is pod job-node-0-evil0, index 0): "
                    "its proof of the run's key did not match; it was sent nothing"]
    assert [p.pod for p in link.pods()] == [POD_0]

    # A controller without the key, answering where the pods dial: the pod runs nothing it sends.
    planted = tmp_path / "planted"
    impostor = socket.create_server(("127.0.0.1", 0))
    impostor_port = impostor.getsockname()[1]

    def answer() -> None:
        peer, _ = impostor.accept()
        impostor.close()  # one answer: the pod's next tries find nobody
        read_line(peer, 10)
        peer.sendall((CONTROLLER_PROOF + json.dumps({"nonce": "m", "run": RUN, "proof": "1" * 64}) + "\n").encode())
        peer.sendall((json.dumps({"run": ["touch", str(planted)], "env": {}}) + "\n").encode())

    threading.Thread(target=answer, daemon=True).start()
    fooled = Pod("127.0.0.1", impostor_port, 1, str(key_path))
    assert fooled.connect() is None and not planted.exists()
    refusal = f"127.0.0.1 answering at 127.0.0.1:{impostor_port}: its proof of the run's key did not match"
    assert fooled.refused == [refusal]
    fooled.port = port  # the real controller again: the pod says whom it refused
    also_waiting = fooled.connect()
    assert also_waiting is not None
    assert _until(lambda: len(said) == 2), said
    assert said[1] == f"pod {POD_0} refused a controller that answered it: {refusal}"
    link.dismiss(0)


def test_the_pods_stop_word_is_the_agents():
    """node/pod.py ships alone, so it spells the agent's TERM itself: a word the agent did not know would be a PING,
    and a deleted pod's agents would hold their nodes instead of stopping them."""
    assert word_line(Word.TERM) == TERM
