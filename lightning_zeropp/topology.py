"""Who is where: nodes, local ranks, and the process groups ZeRO++ communicates on.

Ranks are numbered node-major (as Lightning and torchrun do): rank ``r`` lives on node ``r // N`` with local rank
``r % N``, for ``N`` ranks per node. The groups are built once per job, in the same order on every rank, and are
the only groups the ZeRO++ collectives run on. ``fully_shard(reshard_after_forward=int)`` makes fresh groups for
every call; we never communicate on those (at scale that would be one communicator per layer), we only recognise
them by their rank list.

::

    world 8 = 2 nodes x 4          intra-node groups      rails (same local rank)     hpZ groups (R = 2)
    node 0: 0 1 2 3                [0 1 2 3]              [0 4] [1 5] [2 6] [3 7]     [0 1] [2 3]
    node 1: 4 5 6 7                [4 5 6 7]                                          [4 5] [6 7]
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class Topology:
    """Pure rank arithmetic; no process groups (so it is testable without ``torch.distributed``)."""

    world_size: int
    ranks_per_node: int
    rank: int
    hpz_partition_size: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.ranks_per_node < 1 or self.world_size % self.ranks_per_node:
            raise ValueError(
                f"Topology: ranks_per_node={self.ranks_per_node} must divide world_size={self.world_size}."
            )
        if self.hpz_partition_size < 1 or self.world_size % self.hpz_partition_size:
            raise ValueError(
                f"Topology: hpz_partition_size={self.hpz_partition_size} must divide world_size={self.world_size}."
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"Topology: rank={self.rank} is outside [0, {self.world_size}).")

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def node(self) -> int:
        return self.node_of(self.rank)

    @property
    def local_rank(self) -> int:
        return self.rank % self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def intra_node_ranks(self, node: int | None = None) -> list[int]:
        node = self.node if node is None else node
        start = node * self.ranks_per_node
        return list(range(start, start + self.ranks_per_node))

    def rail_ranks(self, local_rank: int | None = None) -> list[int]:
        """The ranks with the same local rank on every node: the inter-node hop of qgZ."""
        local_rank = self.local_rank if local_rank is None else local_rank
        return [node * self.ranks_per_node + local_rank for node in range(self.num_nodes)]

    def hpz_ranks(self, rank: int | None = None) -> list[int]:
        """The ``hpz_partition_size`` consecutive ranks that share the secondary weight partition."""
        rank = self.rank if rank is None else rank
        start = rank - rank % self.hpz_partition_size
        return list(range(start, start + self.hpz_partition_size))

    @property
    def hpz_crosses_nodes(self) -> bool:
        """Whether any hpZ group (not only this rank's) spans more than one node."""
        return self.hpz_partition_size > 1 and self.ranks_per_node % self.hpz_partition_size != 0

    def peers_split(self, group_ranks: list[int]) -> tuple[int, int]:
        """``(same-node peers, other-node peers)`` of this rank inside ``group_ranks`` (itself excluded)."""
        intra = sum(1 for r in group_ranks if r != self.rank and self.node_of(r) == self.node)
        inter = sum(1 for r in group_ranks if self.node_of(r) != self.node)
        return intra, inter


@dataclass(slots=True)
class ProcessGroups:
    """The groups of one job, built collectively by :meth:`build`."""

    topology: Topology
    world: dist.ProcessGroup
    intra_node: dist.ProcessGroup
    inter_node: dist.ProcessGroup
    hpz: dist.ProcessGroup | None
    _by_ranks: dict[tuple[int, ...], str] = field(default_factory=dict)

    @classmethod
    def build(cls, topology: Topology) -> ProcessGroups:
        """Creates every group (with the default group's backend); all ranks must call this in the same order."""
        world_ranks = list(range(topology.world_size))
        world = dist.new_group(world_ranks)
        intra = _own_group([topology.intra_node_ranks(n) for n in range(topology.num_nodes)], topology.rank)
        inter = _own_group([topology.rail_ranks(lr) for lr in range(topology.ranks_per_node)], topology.rank)
        hpz = None
        if 1 < topology.hpz_partition_size < topology.world_size:
            R = topology.hpz_partition_size
            hpz = _own_group([list(range(s, s + R)) for s in range(0, topology.world_size, R)], topology.rank)
        groups = cls(topology, world, intra, inter, hpz)
        groups._by_ranks[tuple(world_ranks)] = "world"
        if hpz is not None:
            groups._by_ranks[tuple(topology.hpz_ranks())] = "hpz"
        return groups

    def role_of(self, group: dist.ProcessGroup) -> str:
        """ "world" or "hpz" for a group FSDP passes to a collective (matched by its ranks), else raises."""
        ranks = tuple(dist.get_process_group_ranks(group))
        role = self._by_ranks.get(ranks)
        if role is None:
            raise RuntimeError(
                f"ZeroPPStrategy: FSDP asked for a collective on ranks {list(ranks)}, which is neither the world nor"
                f" this rank's hpZ group {self.topology.hpz_ranks()}. Was the module sharded outside ZeroPPStrategy?"
            )
        return role

    def group(self, role: str) -> dist.ProcessGroup:
        if role == "world":
            return self.world
        if role == "hpz":
            assert self.hpz is not None
            return self.hpz
        raise KeyError(role)

    def ranks(self, role: str) -> list[int]:
        if role == "world":
            return list(range(self.topology.world_size))
        if role == "hpz":
            return self.topology.hpz_ranks()
        raise KeyError(role)


def _own_group(partition: list[list[int]], rank: int) -> dist.ProcessGroup:
    """Creates every group of a partition of the ranks (collective) and returns the one holding ``rank``."""
    own = None
    for ranks in partition:
        group = dist.new_group(ranks)
        if rank in ranks:
            own = group
    assert own is not None
    return own
