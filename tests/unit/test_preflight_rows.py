"""Which hosts check which in preflight's data-plane row: all to all for a few hosts, a ring of peers at scale."""

from __future__ import annotations

from harness.preflight.ports import MESH_UP_TO, PEERS, data_peers


def test_a_few_hosts_check_each_other_and_many_check_a_ring_of_peers_each_reached_as_often():
    few = [f"h{i}" for i in range(1, MESH_UP_TO + 1)]
    assert data_peers(few, "h1") == set(few) - {"h1"}
    many = [f"h{i}" for i in range(1, 65)]
    assert data_peers(many, "h1") == {f"h{i}" for i in range(2, 2 + PEERS)}
    assert data_peers(many, "h64") == {f"h{i}" for i in range(1, 1 + PEERS)}, "the ring closes"
    reached = [dest for source in many for dest in data_peers(many, source)]
    assert sorted(set(reached)) == sorted(many) and all(reached.count(h) == PEERS for h in many)
