"""Rank arithmetic, the hpZ -> reshard_after_forward mapping, and the ledger's per-peer accounting."""

import pytest

from lightning_zeropp import CommLedger
from lightning_zeropp.commplan import reshard_after_forward
from lightning_zeropp.topology import Topology


def test_two_nodes_of_four():
    t = Topology(world_size=8, ranks_per_node=4, rank=6, hpz_partition_size=2)
    assert (t.num_nodes, t.node, t.local_rank) == (2, 1, 2)
    assert t.intra_node_ranks() == [4, 5, 6, 7]
    assert t.rail_ranks() == [2, 6]
    assert t.hpz_ranks() == [6, 7]
    assert not t.hpz_crosses_nodes
    assert t.peers_split(list(range(8))) == (3, 4)
    assert t.peers_split([6, 7]) == (1, 0)


def test_three_nodes_and_hpz_across_nodes():
    t = Topology(world_size=6, ranks_per_node=2, rank=3, hpz_partition_size=6)
    assert t.num_nodes == 3 and t.node == 1 and t.local_rank == 1
    assert t.rail_ranks() == [1, 3, 5]
    assert t.hpz_crosses_nodes
    t2 = Topology(world_size=6, ranks_per_node=2, rank=1, hpz_partition_size=3)
    assert t2.hpz_ranks() == [0, 1, 2] and t2.hpz_crosses_nodes
    # rank 0's own group [0, 1] stays on node 0, but [2, 3] spans nodes 0 and 1: the answer is the same on every rank
    assert all(Topology(6, 3, r, 2).hpz_crosses_nodes for r in range(6))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(world_size=6, ranks_per_node=4, rank=0),
        dict(world_size=4, ranks_per_node=2, rank=4),
        dict(world_size=4, ranks_per_node=2, rank=0, hpz_partition_size=3),
    ],
)
def test_inconsistent_topology_refused(kwargs):
    with pytest.raises(ValueError, match="Topology"):
        Topology(**kwargs)


def test_reshard_after_forward_mapping():
    # hpZ off and hpZ over the whole world are both plain ZeRO-3: full reshard (never the int 1, which FSDP2 reads
    # as "keep the unsharded weights")
    assert reshard_after_forward(1, 8) is True
    assert reshard_after_forward(8, 8) is True
    assert reshard_after_forward(4, 8) == 4


def test_ledger_per_peer_accounting():
    t = Topology(world_size=4, ranks_per_node=2, rank=1)
    ledger = CommLedger(t)
    ledger.record_all_gather("weight_all_gather", [0, 1, 2, 3], 100)
    ledger.record_to_peers("gradient_reduce_scatter", [0, 1, 2, 3], [10, 20, 30, 40])
    ledger.record_to_peers("gradient_all_to_all_inter", t.rail_ranks(), 7)
    ag = ledger.total("weight_all_gather")
    assert (ag.intra_node_bytes, ag.inter_node_bytes, ag.calls) == (100, 200, 1)
    rs = ledger.total("gradient_reduce_scatter")
    assert (rs.intra_node_bytes, rs.inter_node_bytes) == (10, 70)  # its own chunk (20) stays home
    assert ledger.total("gradient_all_to_all_inter").inter_node_bytes == 7
    assert ledger.inter_node_bytes == 277 and ledger.intra_node_bytes == 110
    ledger.start_step()
    assert ledger.step().total_bytes == 0 and ledger.total().total_bytes == 387
    with pytest.raises(KeyError, match="unknown ledger kind"):
        ledger.record_all_gather("weights", [0, 1], 1)
