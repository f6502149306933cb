"""Master port and data plane: real listeners on the hosts, real TCP connections between them.

The master binds master_port (proving it is free) and every host binds one ephemeral port, the
kind gloo and NCCL open for rank-to-rank traffic (nccl#388: MASTER_PORT alone proves little).
Then every host connects to every other host's ephemeral port, at the address of the interface the
collectives are pinned to (and at the addresses their defaults would take), and the workers to
master_port, all
at once with a short timeout, so a firewall that drops packets costs seconds, and the report tells
a drop (timeout) from a reject (refused) from a routing problem (no route).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Mapping
from typing import Any

from harness.node import netcheck
from harness.preflight.interfaces import Pin, Reached, extra_target
from harness.preflight.remote import Link, Process, first_answer, on_hosts, run_script, start_script
from harness.preflight.table import Check, Status
from harness.targets.host_command import RemoteTimeout

CONNECT_TIMEOUT = 3.0
MASTER = "master"
OTHER_USER = "other user"  # another user of the master host, reaching for the job's store there

_DESCRIBE = {
    "timeout": "timed out after {timeout:g}s (a firewall drops the packets)",
    "refused": "refused (a firewall rejects it, or nothing listens)",
    "no_route": "no route to host (a firewall answers host-unreachable, or the address is wrong)",
    "no_reply": "connected, but not to our listener (another service or a proxy in between?)",
}


def _describe(result: dict[str, Any], timeout: float) -> str:
    template = _DESCRIBE.get(result["status"])
    return template.format(timeout=timeout) if template else f"failed: {result['detail']}"


def _listen(connection: Link, ports: list[int], lifetime: float, timeout: float,
            started: dict[str, Process], keep: int | None = None) -> dict[str, Any]:
    config = json.dumps({"ports": ports, "lifetime": lifetime, "keep": keep})
    process = start_script(connection, netcheck, ["listen", config], timeout=timeout)
    started[connection.host.name] = process
    return first_answer(process, timeout=timeout)


def _stop(process: Process, timeout: float) -> None:
    """Closing stdin ends a listener; one that lingers is killed with its tree."""
    try:
        process.close_stdin()
        process.wait(timeout)
    except (RemoteTimeout, OSError, EOFError):
        pass
    finally:
        process.close()


MESH_UP_TO = 16  # hosts whose data plane is checked from every host to every other
PEERS = 8  # beyond, each host is checked from this many others: a ring, so that the work grows with the hosts


def data_peers(names: list[str], source: str) -> set[str]:
    """The hosts source connects to in the data-plane check: every other, or of more than MESH_UP_TO hosts the
    PEERS after it in the inventory's order (64 hosts all to all are 4,032 connections at once: on a loaded
    controller's network they time out and read as firewalls; 2,048 would be 4 million)."""
    if len(names) <= MESH_UP_TO:
        return set(names) - {source}
    at = names.index(source)
    return {names[(at + step) % len(names)] for step in range(1, PEERS + 1)}


def network_checks(connections: Mapping[str, Link], master: str, master_port: int, *, timeout: float,
                   pins: Mapping[str, Pin] | None = None,
                   also: Mapping[str, list[str]] | None = None) -> tuple[list[Check], Reached]:
    """master_port rows (free on the master, reached by each worker) and data_plane rows (per destination,
    at its pinned interface's address, else the one SSH reached), and every connection's result (also: more
    addresses per destination to try, see interfaces.default_targets)."""
    names = list(connections)
    pins, also = pins or {}, also or {}
    where = {name: pins[name].address if name in pins else connections[name].peer_ip for name in names}
    wait = min(CONNECT_TIMEOUT, timeout)
    started: dict[str, Process] = {}
    try:
        listening = on_hosts(lambda name: _listen(
            connections[name], [0, master_port] if name == master else [0], 4 * timeout + 30, timeout, started,
            keep=master_port if name == master else None,
        ), names)
        data_ports = {n: a["ports"][0]["port"] for n, a in listening.items() if isinstance(a, dict)}
        udp = {n for n, a in listening.items() if isinstance(a, dict) and a["ports"][0].get("udp")}
        master_answer = listening.get(master)
        master_bound = isinstance(master_answer, dict) and master_answer["ports"][1]["error"] is None

        def targets(source: str) -> list[dict[str, Any]]:
            frame = pins[source].mtu if source in pins else None
            peers = data_peers(names, source)
            found = [{"id": dest, "address": where[dest], "port": port} | ({"frame": frame} if frame and dest in udp
                                                                           else {})
                     for dest, port in data_ports.items() if dest in peers]
            found += [{"id": extra_target(dest, address), "address": address, "port": port}
                      for dest, port in data_ports.items() if dest in peers for address in also.get(dest, [])]
            if master_bound and source != master:
                found.append({"id": MASTER, "address": connections[master].peer_ip, "port": master_port})
            if master_bound and source == master:
                found.append({"id": OTHER_USER, "address": connections[master].peer_ip, "port": master_port,
                              "as_other_user": True})
            return found

        reached = on_hosts(lambda name: run_script(
            connections[name], netcheck, ["connect", json.dumps({"targets": targets(name), "timeout": wait})],
            timeout=timeout + wait,
        ), names)
        here = _reached_from_here(connections[master].peer_ip, master_port, wait) if master_bound else None
    finally:
        on_hosts(lambda name: _stop(started[name], timeout), list(started))
    results = {source: {r["id"]: r for r in answer["results"]} for source, answer in reached.items()
               if isinstance(answer, dict)}
    rows = [_master_row(master, master_port, master_answer)]
    if master_bound and isinstance(master_answer, dict):
        rows.append(_store_row(master, connections[master].peer_ip, master_port, master_answer.get("kept"),
                               results.get(master, {}).get(OTHER_USER), here))
    rows += [_worker_row(name, master, master_port, master_bound, reached[name], results, connections, wait)
             for name in names if name != master]
    ephemeral = master_answer.get("ephemeral_range") if isinstance(master_answer, dict) else None
    rows += [_data_row(name, listening[name], reached[name], results, data_ports, pins.get(name), where[name], wait,
                       ephemeral) for name in names]
    order = {name: i for i, name in enumerate(names)}
    return sorted(rows, key=lambda c: (order[c.host], c.name != "master_port")), results


def _master_row(master: str, port: int, answer: dict[str, Any] | Exception | None) -> Check:
    if not isinstance(answer, dict):
        return Check(master, "master_port", Status.FAIL, f"could not start a test listener: {answer}",
                     "see the fingerprint row: the host's python must run")
    error = answer["ports"][1]["error"]
    if error == "in use":
        return Check(master, "master_port", Status.FAIL, f"port {port} is already in use on {master}",
                     f"stop what listens there (`ss -ltnp 'sport = :{port}'` names it) or set another master_port")
    if error:
        return Check(master, "master_port", Status.FAIL, f"cannot listen on port {port}: {error}",
                     "pick a master_port >= 1024 that the job's user may bind")
    return Check(master, "master_port", Status.PASS, f"port {port} is free on {master} (test listener bound)")


def _reached_from_here(address: str, port: int, timeout: float) -> bool:
    """Whether this machine, where preflight runs, reaches the master's store port: a machine outside the job
    (unless it is one of its hosts too)."""
    try:
        socket.create_connection((address, port), timeout=timeout).close()
    except OSError:
        return False
    return True


def _store_row(master: str, address: str, port: int, kept: str | None, other: dict[str, Any] | None,
               here: bool | None) -> Check:
    """Who can reach the job's rendezvous store, which has no authentication, proved as the job's agent will keep
    it: another user of the master host (refused where the rule holds), and this machine."""
    machines = (f"any machine that reaches {address}:{port} reaches it (this one did)" if here else
                f"this machine could not reach {address}:{port}: a firewall keeps some machines out")
    if other is not None and other["status"] == "refused" and kept is None:
        return Check(master, "store", Status.PASS, f"port {port}: another user of {master} (nobody) was refused, as "
                     f"the job's agent keeps its store from them; {machines}")
    why = kept or (f"another user of {master} connected" if other is None or other["status"] == "ok" else
                   f"another user's connection: {other['status']} {other['detail']}".strip())
    return Check(master, "store", Status.WARN, f"port {port} is open to every user of {master} ({why}); {machines}",
                 "launch as root on the master host to have its agent keep the store from the host's other users "
                 "(docs/security.md#torchs-rendezvous-store)")


def _worker_row(source: str, master: str, port: int, master_bound: bool, answer: Any,
                results: dict[str, dict[str, dict[str, Any]]], connections: Mapping[str, Link],
                wait: float) -> Check:
    if not isinstance(answer, dict):
        return Check(source, "master_port", Status.FAIL, f"could not run the connection test: {answer}",
                     "see the fingerprint row: the host's python must run")
    if not master_bound:
        return Check(source, "master_port", Status.SKIP, f"not tested: port {port} is not available on {master}")
    result = results[source][MASTER]
    where = f"{source} -> {master} {connections[master].peer_ip}:{port}"
    if result["status"] == "ok":
        return Check(source, "master_port", Status.PASS, f"{where} connected in {result['ms']:g} ms")
    return Check(source, "master_port", Status.FAIL, f"{where} {_describe(result, wait)}",
                 f"allow tcp {port} into {master} from {source} (e.g. `iptables -I INPUT -p tcp --dport {port} "
                 f"-j ACCEPT` on {master}, or the cloud security group)", result)


def _data_row(dest: str, listening: Any, own: Any, results: dict[str, dict[str, dict[str, Any]]],
              data_ports: dict[str, int], pin: Pin | None, address: str, wait: float,
              ephemeral: list[int] | None) -> Check:
    problems = []
    if not isinstance(listening, dict):
        problems.append(f"could not start a test listener on {dest}: {listening}")
    if not isinstance(own, dict):
        problems.append(f"could not run the connection test from {dest}: {own}")
    sources = [s for s in results if dest in results[s]]
    failed = [(s, results[s][dest]) for s in sources if results[s][dest]["status"] != "ok"]
    port = data_ports.get(dest)
    at = f"{pin.interface} {address}" if pin else address
    problems += [f"{s} -> {dest} {at}:{port} {_describe(r, wait)}" for s, r in failed]
    frames = [(s, results[s][dest]["frame"]) for s in sources if "frame" in results[s][dest]]
    narrow = [(s, f) for s, f in frames if f["status"] != "ok"]
    problems += [f"{s} -> {dest} {at}: {f['bytes']}-byte frames (don't fragment) "
                 + ("lost while small packets arrive: the path's MTU is below the interface's" if f["status"] == "lost"
                    else f"not sent: {f['detail']}") for s, f in narrow]
    if problems:
        span = f"{ephemeral[0]}-{ephemeral[1]}" if ephemeral else "32768-60999"
        network = f"check the {pin.interface} network between these hosts and " if pin and failed else ""
        fixes = [f"{network}allow tcp from the other hosts into {dest} on the ephemeral ports {span}, where gloo and "
                 f"NCCL listen (not only master_port), e.g. `iptables -I INPUT -p tcp -s <cluster subnet> -j ACCEPT` "
                 f"on {dest}"] if failed or not narrow else []
        if narrow:
            fixes.append("one MTU along the whole data path: lower the sender's interface to what the switch ports "
                         "(or bridges) between them carry, or raise those to the interfaces' MTU")
        return Check(dest, "data_plane", Status.FAIL, "; ".join(problems), "; ".join(fixes),
                     {"failed": [{"source": s, **r} for s, r in failed], "frames": [{"source": s, **f}
                                                                                    for s, f in narrow]})
    if not sources:
        return Check(dest, "data_plane", Status.SKIP, "no other host to connect from")
    full = {f["bytes"] for _, f in frames}
    sizes = f", {'/'.join(str(b) for b in sorted(full))}-byte frames too" if full else ""
    return Check(dest, "data_plane", Status.PASS,
                 f"ephemeral port {port} on {at} reached from {', '.join(sources)}{sizes}")
