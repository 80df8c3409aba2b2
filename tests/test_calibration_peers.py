"""The calibration's inter-node traffic patterns (benchmarks/testbed/calibration.py)."""

import pytest

from benchmarks.testbed.calibration import inter_node_peers


@pytest.mark.parametrize("nodes,per_node", [(2, 4), (3, 4), (4, 2), (2, 8)])
def test_one_way_pattern_never_uses_a_rank_pair_both_ways(nodes, per_node):
    world = nodes * per_node
    peers = [inter_node_peers(r, per_node, nodes) for r in range(world)]
    sends = {(r, peers[r]["inter"][0]) for r in range(world)}
    for r in range(world):
        to, frm = peers[r]["inter"]
        assert to // per_node == (r // per_node + 1) % nodes  # the next node
        assert peers[to]["inter"][1] == r and peers[frm]["inter"][0] == r  # receive what is sent
    assert not any((b, a) in sends for a, b in sends)
    assert sorted(to for to, _ in (p["inter"] for p in peers)) == list(range(world))


@pytest.mark.parametrize("nodes,per_node", [(2, 4), (3, 4), (4, 2)])
def test_duplex_pattern_pairs_same_index_ranks_of_partner_nodes(nodes, per_node):
    for r in range(nodes * per_node):
        peers = inter_node_peers(r, per_node, nodes)
        if r // per_node ^ 1 >= nodes:  # odd node count: the last node has no partner
            assert "duplex" not in peers
            continue
        to, frm = peers["duplex"]
        assert to == frm and to % per_node == r % per_node and to // per_node == r // per_node ^ 1
        assert inter_node_peers(to, per_node, nodes)["duplex"][0] == r
