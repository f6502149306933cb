"""The pod link proves both ends (node/pod.py, targets/k8s/pods.py): a worker pod and the controller each show they
hold the run's key before the other acts on anything it says; a rogue on either side gets nothing run and nothing
sent, and is said in the run's stream (the supervised pods with rogues beside them: tests/integration/test_k8s_pods.py)."""

from __future__ import annotations

import json
import secrets
import socket
import threading
import time
from pathlib import Path

import pytest

from harness.node.pod import CONTROLLER_PROOF, HELLO, POD_PROOF, TERM, Pod, read_line
from harness.node.protocol import Word, word_line
from harness.targets.k8s.pods import PodLink


def _until(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout  # guard: each step is a loopback round trip
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_a_pod_and_the_controller_prove_the_runs_key_and_a_rogue_on_either_side_gets_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key_path = tmp_path / "link-key"
    key_path.write_text(secrets.token_hex(32))  # as the controller writes it (commands.k8s_controller)
    link = PodLink(0, key_path.read_bytes(), host="127.0.0.1")
    port = link._server.getsockname()[1]
    said: list[str] = []
    link.announce_to(said.append)
    monkeypatch.setenv("POD_NAME", "job-node-0-abc")
    monkeypatch.setenv("POD_INDEX", "0")
    real = Pod("127.0.0.1", port, 10, str(key_path))
    waiting = real.connect()  # kept: a closed connection is no longer offered
    assert waiting is not None
    assert _until(lambda: [p.pod for p in link.pods()] == ["job-node-0-abc"]), link.pods()

    # A worker that knows the pod's name and index but not the key: refused after the controller's proof alone.
    rogue = socket.create_connection(("127.0.0.1", port))
    rogue.sendall((HELLO + json.dumps({"pod": "job-node-0-evil", "index": 0, "machine": "", "python": "python",
                                       "workdir": "/", "nonce": "n"}) + "\n").encode())
    line, rest = read_line(rogue, 10)
    assert line.startswith(CONTROLLER_PROOF) and rest == b""
    rogue.sendall((POD_PROOF + json.dumps({"proof": "0" * 64}) + "\n").encode())
    rogue.settimeout(10)
    assert rogue.recv(1 << 16) == b"", "a pod that failed its proof is sent nothing"
    assert _until(lambda: any("refused a worker pod's connection from 127.0.0.1" in s for s in said)), said
    assert said == ["refused a worker pod's connection from 127.0.0.1 (it says it is pod job-node-0-evil, index 0): "
                    "its proof of the run's key did not match; it was sent nothing"]
    assert [p.pod for p in link.pods()] == ["job-node-0-abc"]

    # A controller without the key, answering where the pods dial: the pod runs nothing it sends.
    planted = tmp_path / "planted"
    impostor = socket.create_server(("127.0.0.1", 0))
    impostor_port = impostor.getsockname()[1]

    def answer() -> None:
        peer, _ = impostor.accept()
        impostor.close()  # one answer: the pod's next tries find nobody
        read_line(peer, 10)
        peer.sendall((CONTROLLER_PROOF + json.dumps({"nonce": "m", "proof": "1" * 64}) + "\n").encode())
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
    assert said[1] == f"pod job-node-0-abc refused a controller that answered it: {refusal}"
    link.dismiss(0)


def test_the_pods_stop_word_is_the_agents():
    """node/pod.py ships alone, so it spells the agent's TERM itself: a word the agent did not know would be a PING,
    and a deleted pod's agents would hold their nodes instead of stopping them."""
    assert word_line(Word.TERM) == TERM
