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

With tensor parallelism of size t (inside the node, as Lightning's ModelParallelStrategy numbers ranks: global rank
g = d * t + j for data-parallel index d and tensor-parallel index j), the topology is the data-parallel one: D = W / t
ranks, N / t per node, rank d = g // t. Every ZeRO++ collective runs among the ranks of one tensor-parallel position
j, so every group above exists once per j (global ranks ``d * t + j``), and FSDP's groups are recognised by those::

    world 8 = 2 nodes x 4, t = 2   data-parallel groups   intra-node (per j)          rails (per j)
    node 0: 0 1 | 2 3              j=0: [0 2 4 6]         [0 2] [4 6]                 [0 4] [2 6]
    node 1: 4 5 | 6 7              j=1: [1 3 5 7]         [1 3] [5 7]                 [1 5] [3 7]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class Topology:
    """Pure rank arithmetic; no process groups (so it is testable without ``torch.distributed``).

    In the data-parallel index space: with ``tensor_parallel_size`` t > 1, ``world_size``, ``ranks_per_node`` and
    ``rank`` count the data-parallel ranks of one tensor-parallel position (``tensor_parallel_rank``);
    :meth:`global_ranks` names them as the job numbers them."""

    world_size: int
    ranks_per_node: int
    rank: int
    hpz_partition_size: int = 1
    tensor_parallel_size: int = 1
    tensor_parallel_rank: int = 0

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
        if self.tensor_parallel_size < 1 or not 0 <= self.tensor_parallel_rank < self.tensor_parallel_size:
            raise ValueError(
                f"Topology: tensor_parallel_rank={self.tensor_parallel_rank} is outside"
                f" [0, tensor_parallel_size={self.tensor_parallel_size})."
            )

    @classmethod
    def of_job(
        cls, world_size: int, ranks_per_node: int, rank: int, hpz_partition_size: int = 1, tensor_parallel_size: int = 1
    ) -> Topology:
        """The data-parallel topology of global ``rank`` in a job of ``world_size`` ranks, ``ranks_per_node`` per
        node, whose consecutive groups of ``tensor_parallel_size`` ranks are tensor-parallel (t must divide the
        node)."""
        t = tensor_parallel_size
        if t < 1 or ranks_per_node % t:
            raise ValueError(f"Topology: tensor_parallel_size={t} must divide ranks_per_node={ranks_per_node}.")
        return cls(world_size // t, ranks_per_node // t, rank // t, hpz_partition_size, t, rank % t)

    @property
    def global_world_size(self) -> int:
        """Every rank of the job, all tensor-parallel positions."""
        return self.world_size * self.tensor_parallel_size

    @property
    def global_rank(self) -> int:
        return self.rank * self.tensor_parallel_size + self.tensor_parallel_rank

    def global_ranks(self, ranks: list[int], tensor_parallel_rank: int | None = None) -> list[int]:
        """The job's numbers of data-parallel ranks ``ranks`` at ``tensor_parallel_rank`` (default: this rank's)."""
        j = self.tensor_parallel_rank if tensor_parallel_rank is None else tensor_parallel_rank
        return [d * self.tensor_parallel_size + j for d in ranks]

    def per_position(self, partition: list[list[int]]) -> list[list[int]]:
        """A partition of the data-parallel ranks, once per tensor-parallel position (positions in order), as the
        job numbers its ranks: the groups every rank creates, in the same order."""
        return [self.global_ranks(ranks, j) for j in range(self.tensor_parallel_size) for ranks in partition]

    def partitions(self) -> dict[str, list[list[int]]]:
        """Every group :meth:`ProcessGroups.build` creates, by role, in creation order, as the job numbers ranks:
        ``"world"`` (the data-parallel groups), ``"intra_node"``, ``"inter_node"`` (the rails) and, with hpZ inside
        the world, ``"hpz"``."""
        W, R = self.world_size, self.hpz_partition_size
        out = {
            "world": self.per_position([list(range(W))]),
            "intra_node": self.per_position([self.intra_node_ranks(n) for n in range(self.num_nodes)]),
            "inter_node": self.per_position([self.rail_ranks(lr) for lr in range(self.ranks_per_node)]),
        }
        if 1 < R < W:
            out["hpz"] = self.per_position([list(range(s, s + R)) for s in range(0, W, R)])
        return out

    def tensor_parallel_partition(self) -> list[list[int]]:
        """The tensor-parallel groups (consecutive ranks of one node), as the job numbers ranks."""
        t = self.tensor_parallel_size
        return [list(range(d * t, (d + 1) * t)) for d in range(self.world_size)]

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

    def node_of_global(self, rank: int) -> int:
        """The node of a rank as the job numbers it (with tensor parallelism: not a data-parallel rank)."""
        return self.node_of(rank // self.tensor_parallel_size)

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
    """The groups of one job, built collectively by :meth:`build`. ``world`` is this rank's data-parallel group (all
    ranks without tensor parallelism); ``everyone`` (tensor parallelism only) holds every rank of the job, for what
    the strategy agrees on across all of them (:attr:`all_ranks`)."""

    topology: Topology
    world: dist.ProcessGroup
    intra_node: dist.ProcessGroup
    inter_node: dist.ProcessGroup
    hpz: dist.ProcessGroup | None
    timeout: timedelta | None = None
    hybrid: bool = False
    everyone: dist.ProcessGroup | None = None
    _by_ranks: dict[tuple[int, ...], str] = field(default_factory=dict)

    @classmethod
    def build(cls, topology: Topology, timeout: timedelta | None = None, hybrid: bool = False) -> ProcessGroups:
        """Creates every group (with the default group's backend); all ranks must call this in the same order.

        ``timeout``: how long a collective on these groups waits for a peer before it raises (torch's default, 30
        minutes for gloo and NCCL, when None). Every group gets it: a frozen rank must end the job on the others.
        ``hybrid``: the model is sharded HSDP-style, so FSDP's collectives run on the node's ranks ("node").
        With tensor parallelism, first a group of every rank, then each group once per tensor-parallel position
        (positions in order, the same on every rank), named by the job's rank numbers.
        """
        me, all_ranks = topology.global_rank, list(range(topology.global_world_size))
        everyone = dist.new_group(all_ranks, timeout=timeout) if topology.tensor_parallel_size > 1 else None
        made = {role: own_group(partition, me, timeout) for role, partition in topology.partitions().items()}
        world, intra, inter, hpz = made["world"], made["intra_node"], made["inter_node"], made.get("hpz")
        groups = cls(topology, world, intra, inter, hpz, timeout, hybrid, everyone)
        if hybrid:
            groups._by_ranks[tuple(topology.global_ranks(topology.intra_node_ranks()))] = "node"
        groups._by_ranks[tuple(topology.global_ranks(list(range(topology.world_size))))] = "world"
        if hpz is not None:
            groups._by_ranks[tuple(topology.global_ranks(topology.hpz_ranks()))] = "hpz"
        return groups

    @property
    def all_ranks(self) -> dist.ProcessGroup:
        """Every rank of the job (the data-parallel group when there is no tensor parallelism)."""
        return self.everyone if self.everyone is not None else self.world

    def destroy(self) -> None:
        """Releases this rank's groups (with NCCL: their communicators). The object is unusable afterwards."""
        held = (self.world, self.intra_node, self.inter_node, self.hpz, self.everyone)
        for group in {id(g): g for g in held if g}.values():
            dist.destroy_process_group(group)
        self._by_ranks.clear()

    def role_of(self, group: dist.ProcessGroup) -> str:
        """ "world", "hpz" or (HSDP) "node" for a group FSDP passes to a collective (matched by its ranks), else
        raises."""
        ranks = tuple(dist.get_process_group_ranks(group))
        role = self._by_ranks.get(ranks)
        if role is None:
            raise RuntimeError(
                f"ZeroPPStrategy: FSDP asked for a collective on ranks {list(ranks)}, which is none of this rank's"
                f" groups ({', '.join(map(str, self._by_ranks))}). Was the module sharded outside ZeroPPStrategy?"
            )
        return role

    def group(self, role: str) -> dist.ProcessGroup:
        if role == "world":
            return self.world
        if role == "hpz":
            assert self.hpz is not None
            return self.hpz
        if role == "node":
            return self.intra_node
        raise KeyError(role)

    def ranks(self, role: str) -> list[int]:
        """The data-parallel ranks of the group of ``role`` (the ledger's numbering; see :class:`Topology`)."""
        if role == "world":
            return list(range(self.topology.world_size))
        if role == "hpz":
            return self.topology.hpz_ranks()
        if role == "node":
            return self.topology.intra_node_ranks()
        raise KeyError(role)


def own_group(partition: list[list[int]], rank: int, timeout: timedelta | None) -> dist.ProcessGroup:
    """Creates every group of a partition of the ranks (collective) and returns the one holding ``rank``."""
    own = None
    for ranks in partition:
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            own = group
    assert own is not None
    return own


def check_launch(
    num_nodes: int, devices: int, local_rank: int, node_rank: int, env: dict[str, str], front_door: str = "Trainer"
) -> None:
    """Refuses a process whose launcher (torchrun, SLURM, a script's variables) describes another job than the
    Trainer's ``num_nodes`` x ``devices``, before any process group exists: otherwise some ranks train alone as a
    separate job while the others fail deep inside the backend, or Lightning indexes a device that is not there.

    ``local_rank`` / ``node_rank``: what the cluster environment says of this process; ``env``: the launcher's
    variables (``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``SLURM_NTASKS``, ``SLURM_NTASKS_PER_NODE``) where set;
    ``front_door``: ``"Trainer"`` or ``"Fabric"``, whose arguments the message names.
    """
    world = _int_var(env, "WORLD_SIZE") or _int_var(env, "SLURM_NTASKS")
    per_node = _int_var(env, "LOCAL_WORLD_SIZE") or _slurm_tasks_per_node(env)
    wrong = []
    if world is not None and world != num_nodes * devices:
        wrong.append(f"{world} ranks in all")
    if per_node is not None and per_node != devices:
        wrong.append(f"{per_node} per node")
    if local_rank >= devices:
        wrong.append(f"this process has local rank {local_rank}")
    if node_rank >= num_nodes:
        wrong.append(f"this process is on node {node_rank}")
    if not wrong:
        return
    said = {k: env[k] for k in _LAUNCH_VARIABLES if k in env}
    said.update(LOCAL_RANK=str(local_rank), NODE_RANK=str(node_rank))
    hint = ""
    if world is not None and per_node and world % per_node == 0:
        hint = (
            f" Set {front_door}(num_nodes={world // per_node}, devices={per_node}), or launch {num_nodes} x {devices}."
        )
    raise RuntimeError(
        f"ZeroPPStrategy: the launcher and the {front_door} describe different jobs: the {front_door} has"
        f" num_nodes={num_nodes},"
        f" devices={devices} ({num_nodes * devices} ranks, {devices} per node), the launcher says "
        + ", ".join(wrong)
        + f" ({', '.join(f'{k}={v}' for k, v in said.items())}).{hint or ' Make them agree.'}"
    )


_LAUNCH_VARIABLES = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE")


def _int_var(env: dict[str, str], name: str) -> int | None:
    value = env.get(name)
    return int(value) if value is not None and value.strip().isdigit() else None


def _slurm_tasks_per_node(env: dict[str, str]) -> int | None:
    """``SLURM_NTASKS_PER_NODE`` when it is one number ("4"; not a per-node list such as "4(x2),3")."""
    return _int_var(env, "SLURM_NTASKS_PER_NODE")
