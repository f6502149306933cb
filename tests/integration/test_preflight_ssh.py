"""harness.targets.ssh.transport against real sshd hosts: commands, deadlines, and every class of connection failure."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from harness.plan.shell import remote_command
from harness.targets.ssh.backend import ended_on_host
from harness.targets.ssh.transport import RemoteTimeout, SSHConnectError, connect
from testbed.cluster import Cluster


def _connect(cluster: Cluster, name: str = "h1", *, known_hosts: Path | None = None, timeout: float = 5.0,
             accept: bool = False, **overrides: object):
    return connect(cluster.inventory_host(name, **overrides), known_hosts=known_hosts or cluster.known_hosts,
                   accept_new_host_keys=accept, timeout=timeout)


def _failure(cluster: Cluster, name: str = "h1", **kwargs: object) -> SSHConnectError:
    with pytest.raises(SSHConnectError) as caught:
        _connect(cluster, name, **kwargs)
    return caught.value


def test_commands_python_and_env_on_one_connection(cluster2: Cluster) -> None:
    with _connect(cluster2, "h2") as conn:
        assert conn.run("hostname", timeout=10) == (0, "h2\n", "")
        assert conn.run("cat; echo done >&2", stdin=b"piped", timeout=10) == (0, "piped", "done\n")
        # The host's Python runs the first line of its stdin (harness.targets.boot); the command line only labels it.
        program = b"import sys; print(sys.argv[1], sys.stdin.read()); sys.exit(3)\n"
        assert conn.run(conn.python_command(["label"]), stdin=program + b"rest", timeout=10) == (3, "label rest\n", "")
        line = remote_command(["sh", "-c", 'echo "$GREETING"; pwd'], env={"GREETING": "a 'b' c"}, workdir="/tmp")
        assert conn.run(line, timeout=10) == (0, "a 'b' c\n/tmp\n", "")
        assert conn.peer_ip == cluster2.host("h2").address


def test_overrun_command_is_stopped_with_its_whole_tree(cluster2: Cluster) -> None:
    def sleepers() -> list[int]:
        found = []
        for pid in cluster2.pids("h1"):
            try:
                if b"31.4" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(pid)
            except OSError:
                pass
        return found

    with _connect(cluster2) as conn:
        started = time.monotonic()
        with pytest.raises(RemoteTimeout, match="did not finish within 1s") as caught:
            conn.run("echo started; sleep 31.41 & sleep 31.42", timeout=1)
        assert time.monotonic() - started < 6  # guard: stopped at its 1 s timeout, not after the 31 s sleeps
        assert caught.value.stdout == "started\n"
    deadline = time.monotonic() + 5
    while sleepers() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sleepers() == []


def test_a_session_a_signal_ended_is_told_from_a_lost_link(cluster2: Cluster) -> None:
    """sshd says a signal's end as `exit-signal`, which paramiko drops (no exit status: -1, as for a lost link); its
    end of file still says the command ended on the host: a node agent killed there is never linked to again."""
    with _connect(cluster2) as conn:
        killed = conn.transport.open_session()
        killed.exec_command("exec sh -c 'echo up; kill -KILL $$'")
        assert killed.recv(100) == b"up\n" and killed.recv(100) == b""
        assert killed.recv_exit_status() == -1 and ended_on_host(killed)
        ended = conn.transport.open_session()
        ended.exec_command("exit 3")
        assert ended.recv(100) == b"" and ended.recv_exit_status() == 3 and ended_on_host(ended)
        cut = conn.transport.open_session()
        cut.exec_command("echo up; exec cat")
        assert cut.recv(100) == b"up\n"
        conn.transport.close()  # what keep_alive does to a host that stopped answering
        assert cut.recv(100) == b"" and not ended_on_host(cut)
    cluster2.assert_only_sshd_left()


def test_refused(cluster2: Cluster) -> None:
    error = _failure(cluster2, port=2223)
    assert error.kind == "refused"
    assert f"{cluster2.host('h1').address}:2223 refused the connection" in str(error)


def test_timeout_when_a_firewall_drops_ssh(cluster2: Cluster) -> None:
    with cluster2.firewall("h2", "-p", "tcp", "--dport", "22", "-j", "DROP"):
        started = time.monotonic()
        error = _failure(cluster2, "h2", timeout=1.5)
    assert time.monotonic() - started < 6  # guard: the 1.5 s timeout, not the 10 s default
    assert error.kind == "timeout"
    assert f"no answer from {cluster2.host('h2').address}:22 within 1.5s (a firewall drops the packets" in str(error)


def test_no_route_to_an_address_without_a_host(cluster2: Cluster) -> None:
    error = _failure(cluster2, address=cluster2.unused_address)
    assert error.kind == "no_route"
    assert f"no route to {cluster2.unused_address} (No route to host)" in str(error)


def test_dns_failure_is_told_apart(cluster2: Cluster) -> None:
    script = (
        "from harness.spec.inventory import Host\nfrom harness.targets.ssh.transport import connect, SSHConnectError\n"
        "try:\n    connect(Host(name='x', address='no-such-host.invalid'), known_hosts='/dev/null', timeout=3)\n"
        "except SSHConnectError as e:\n    print(e.kind, e, sep='|')\n"
    )
    out = cluster2.exec("h1", [sys.executable, "-c", script]).stdout  # the host's resolver only asks loopback
    kind, message = out.strip().split("|")
    assert kind == "dns"
    assert "cannot resolve 'no-such-host.invalid'" in message and "use an IP address" in message


def test_rejected_and_missing_keys(cluster2: Cluster) -> None:
    stranger = cluster2.new_client_key("stranger_key")
    error = _failure(cluster2, identity_file=str(stranger))
    assert error.kind == "auth"
    assert f"root@{cluster2.host('h1').address}:22 rejected key {stranger}" in str(error)
    error = _failure(cluster2, identity_file="/nonexistent/id_ed25519")
    assert error.kind == "auth"
    assert "identity file /nonexistent/id_ed25519 does not exist" in str(error)


def test_changed_host_key_is_refused(cluster2: Cluster, tmp_path: Path) -> None:
    wrong = tmp_path / "known_hosts"
    wrong.write_text(f"{cluster2.host('h1').address} {cluster2.host('h2').host_key}\n")
    error = _failure(cluster2, known_hosts=wrong)
    assert error.kind == "hostkey_mismatch"
    assert f"host key for {cluster2.host('h1').address} does not match {wrong}" in str(error)
    assert f"ssh-keygen -f {wrong} -R '{cluster2.host('h1').address}'" in str(error)


def test_unknown_host_key_is_refused_unless_accepting_new_keys(cluster2: Cluster, tmp_path: Path) -> None:
    users_file = Path("~/.ssh/known_hosts").expanduser()
    users_before = users_file.read_bytes() if users_file.exists() else None
    known = tmp_path / "ssh" / "known_hosts"
    address = cluster2.host("h1").address
    error = _failure(cluster2, known_hosts=known, port=2222)
    assert error.kind == "hostkey_unknown"
    assert f"ssh-keyscan -p 2222 {address} >> {known}` or pass --accept-new-host-keys" in str(error)
    assert not known.exists()
    with _connect(cluster2, known_hosts=known, accept=True, port=2222) as conn:
        assert conn.new_host_key is not None and conn.new_host_key.startswith("SHA256:")
    assert known.read_text() == f"[{address}]:2222 {cluster2.host('h1').host_key}\n"
    assert oct(known.stat().st_mode & 0o777) == "0o600"
    with _connect(cluster2, known_hosts=known, port=2222) as conn:
        assert conn.new_host_key is None
    assert _failure(cluster2, known_hosts=known).kind == "hostkey_unknown"  # port 22 is another entry
    assert (users_file.read_bytes() if users_file.exists() else None) == users_before  # the user's file untouched
