"""The planner's prediction: for each configuration (:data:`CONFIGS`), a GPU's memory by part and whether it fits,
the bytes it sends per step inside and across nodes (exact: :mod:`lightning_zeropp.costs`, the ledger's arithmetic),
and its compute, communication and step time, on a :class:`Cluster` for a :class:`Workload` (:func:`predict`).

A static model. The planner's time model (compute at a fraction of the peak, each collective on the links it uses,
the overlap, tensor parallelism) is stated once, in :mod:`lightning_zeropp.planner`'s docstring, which ``python -m
lightning_zeropp.planner --help`` prints; ``efficiency`` and ``overlap`` are its two free parameters. What to use,
from these rows, is :mod:`lightning_zeropp.recommendation`'s verdict.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from .commplan import job_topology, resolve
from .config import ZeroPPConfig
from .core import HSDP_ARGUMENTS, QUANTIZED_HSDP_ARGUMENTS
from .costs import (
    ELEMENT_BYTES,
    Unit,
    activation_all_reduce_bytes,
    collective_buffers,
    correction_bytes,
    kernel_bytes,
    parameters,
    persistent_memory,
    step_bytes,
    tensor_parallel_units,
)

CONFIGS: dict[str, dict[str, Any]] = {
    "zero3": dict(quantize_weights=False, hpz_partition_size=1, quantize_gradients=False),
    "hsdp": dict(HSDP_ARGUMENTS),
    "qhsdp": dict(QUANTIZED_HSDP_ARGUMENTS),
    "zeropp": {},
    "zeropp+ef": dict(gradient_error_feedback=True),
    "zeropp+deltas": dict(weight_deltas=True),
    "zeropp+qgz8": dict(gradient_bits=8),
}
"""The configurations the planner compares, by the names the README and the benchmarks use."""

RING_KINDS = {"weight_all_gather", "weight_all_gather_backward", "gradient_reduce_scatter"}
"""Collectives FSDP (or qwZ) runs over all ranks as one ring (HSDP: inside the node); the rest are all-to-alls, rail
all-reduces or collectives inside an hpZ group."""

EFFICIENCY, OVERLAP = 0.645, 0.0
"""The two free parameters as fitted on the paper's table (V100s, ``benchmarks/plan_check.py --paper``): pass your
own (``--efficiency``, ``--overlap``) when you have measured your hardware."""


@dataclass(frozen=True)
class Cluster:
    """The hardware: ``nodes`` x ``gpus_per_node``; bandwidths in Gbit/s (inter-node: the node's, shared by its
    GPUs; intra-node: each GPU's), latencies in microseconds, memory in GiB, peak in TFLOP/s and device memory
    bandwidth (``hbm_gbps``, GB/s: the quantization kernels' speed) per GPU; the backend:
    ``"nccl"`` runs all-gathers and reduce-scatters as rings, ``"gloo"`` (the emulated cluster) its all-gathers as
    rings and its reduce-scatter with twice a ring's bytes (measured: docs/results/slow_link.md)."""

    nodes: int
    gpus_per_node: int
    inter_gbps: float
    intra_gbps: float
    inter_latency_us: float = 5.0
    intra_latency_us: float = 2.0
    gpu_memory_gib: float = 80.0
    peak_tflops: float = 989.0
    backend: str = "nccl"
    hbm_gbps: float = 3350.0
    kernel_gbps: float | None = None
    """The quantization kernels' speed, GB/s by device time, where a GPU run measured it
    (:func:`~lightning_zeropp.planner.measured_kernels`); None: assumed at ``hbm_gbps``."""

    def __post_init__(self) -> None:
        if self.backend not in ("nccl", "gloo"):
            raise ValueError(f"planner: `backend={self.backend!r}` must be 'nccl' or 'gloo'.")
        for name in ("nodes", "gpus_per_node"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"planner: `{name}={getattr(self, name)!r}` must be an int >= 1.")
        for name in ("inter_gbps", "intra_gbps", "gpu_memory_gib", "peak_tflops", "hbm_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"planner: `{name}={getattr(self, name)!r}` must be > 0.")
        if self.kernel_gbps is not None and not self.kernel_gbps > 0:
            raise ValueError(f"planner: `kernel_gbps={self.kernel_gbps!r}` must be > 0 (or None: at hbm_gbps).")

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class Workload:
    """Tokens each GPU processes per optimizer step (with tensor parallelism, the global batch over the GPUs: each
    GPU computes on its group's tokens, t x as many), the precision, the optimizer's state per parameter (Adam: 2
    fp32 values), activation checkpointing, and the model's width for the activation estimate."""

    tokens_per_gpu: int
    precision: str = "bf16-mixed"
    optimizer_states: int = 2
    activation_checkpointing: bool = True
    efficiency: float = EFFICIENCY
    overlap: float = OVERLAP


@dataclass
class Row:
    """One configuration's prediction: memory per GPU by part, bytes, compute, communication and step time."""

    config: str
    memory_gib: dict[str, float]
    fits: bool
    inter_node_gb: float
    intra_node_gb: float
    bytes_by_kind: dict[str, tuple[int, int, int]]
    compute_s: float
    comm_s: float
    step_s: float
    speedup: float = 1.0
    tflops_per_gpu: float = 0.0
    notes: list[str] = field(default_factory=list)
    tensor_parallel_size: int = 1
    tensor_parallel_gb: float = 0.0
    """Bytes (GB) of the activations' all-reduces each GPU sends per step inside its node: in neither of the
    data-parallel columns, never across nodes."""
    tensor_parallel_s: float = 0.0
    """Seconds they take, on the compute's path (in ``step_s``, not in ``compute_s`` or ``comm_s``)."""


# ------------------------------------------------------------------------------------------------ time
def collective_seconds(kind: str, intra: int, inter: int, calls: int, cluster: Cluster, config: ZeroPPConfig) -> float:
    """Seconds one step's ``calls`` collectives of ``kind`` take, from the bytes one GPU sends (the time model).
    With tensor parallelism t (``config``'s), a collective runs on the W / t data-parallel ranks, N / t per node, and
    the t groups run at once, each with a t-th of the node's link."""
    topology = job_topology(config, cluster.world, cluster.gpus_per_node, 0)  # the data-parallel ranks
    t, N, W = topology.tensor_parallel_size, topology.ranks_per_node, topology.world_size
    inter_Bps, intra_Bps = cluster.inter_gbps * 1e9 / 8 / t, cluster.intra_gbps * 1e9 / 8
    lat_inter, lat_intra = cluster.inter_latency_us * 1e-6, cluster.intra_latency_us * 1e-6
    if kind in RING_KINDS and inter:  # a ring over all W ranks: shard = inter / (W - N) bytes per peer
        shard = inter / (W - N)
        wire = shard * (W - 1) * (2 if cluster.backend == "gloo" and kind == "gradient_reduce_scatter" else 1)
        return max(wire / inter_Bps, wire / intra_Bps) + calls * (W - 1) * lat_inter
    if kind in RING_KINDS and not inter:  # a ring inside the node (HSDP, or one node)
        return intra / intra_Bps + calls * (N - 1) * lat_intra
    seconds = intra / intra_Bps + (N * inter) / inter_Bps
    return seconds + calls * ((lat_inter if inter else 0.0) + (lat_intra if intra else 0.0))


def tensor_parallel_seconds(sent: int, all_reduces: int, cluster: Cluster, tensor_parallel_size: int) -> float:
    """Seconds the activations' all-reduces take: a ring inside the node, ``sent`` bytes on each GPU's own link, a
    latency per ring step (``2 (t - 1)`` of them per all-reduce)."""
    steps = all_reduces * 2 * (tensor_parallel_size - 1)
    return sent / (cluster.intra_gbps * 1e9 / 8) + steps * cluster.intra_latency_us * 1e-6


def step_seconds(compute: float, comm: float, overlap: float) -> float:
    """A step's time from its compute and communication times (the time model)."""
    return max(compute, comm) + (1 - overlap) * min(compute, comm)


def comm_seconds(units: list[Unit], config: ZeroPPConfig, cluster: Cluster, precision: str) -> float:
    """Seconds one step's collectives take on ``cluster`` (rank 0's bytes; ranks differ by padding only)."""
    by_kind = step_bytes(units, config, cluster.world, cluster.gpus_per_node, 0, precision)
    return sum(collective_seconds(k, *v, cluster, config) for k, v in by_kind.items())


def compute_seconds(units: list[Unit], config: ZeroPPConfig, cluster: Cluster, workload: Workload) -> float:
    """The model's FLOPs at ``efficiency`` x peak, plus the quantization kernels' bytes and the second-moment
    correction's at the device memory's bandwidth (they run on the compute stream, between the layers and before the
    update; the correction's where the optimizer keeps Adam's two states)."""
    flops = step_flops(units, workload) / (cluster.peak_tflops * 1e12 * workload.efficiency)
    kernels = kernel_bytes(units, config, cluster.world, cluster.gpus_per_node, workload.precision)
    moved = 0
    if workload.optimizer_states >= 2:  # no Adam: nothing is lowered ("auto" leaves it alone)
        moved += correction_bytes(units, config, cluster.world, cluster.gpus_per_node, workload.precision)
    return flops + kernels / ((cluster.kernel_gbps or cluster.hbm_gbps) * 1e9) + moved / (cluster.hbm_gbps * 1e9)


def step_flops(units: list[Unit], workload: Workload) -> float:
    """FLOPs one GPU computes per optimizer step (the time model)."""
    return (8 if workload.activation_checkpointing else 6) * parameters(units) * workload.tokens_per_gpu


def memory_parts(
    units: list[Unit], config: ZeroPPConfig, cluster: Cluster, workload: Workload, n_embd: int
) -> dict[str, float]:
    """Bytes per GPU by part: the sharded parameters, gradients and optimizer state; hpZ's copy (1/R of the weights,
    kept from a unit's forward to its backward); two units unsharded (the one computing and the one prefetched); the
    quantized collectives' buffers (:func:`~lightning_zeropp.costs.collective_buffers`);
    activations (``34 x tokens x width`` bytes per layer, as Korthikanti et al. count them with attention scores
    fused away; with checkpointing, one layer's plus every layer's input); the feedback residual, the second-moment
    correction's noise estimates (none where the optimizer keeps fewer than Adam's two states: "auto" skips it) and
    weight deltas' copies (``strategy.persistent_memory``).

    With tensor parallelism t (``config``'s): ``units`` are the tensor-parallel pieces
    (:func:`~lightning_zeropp.costs.tensor_parallel_units`), sharded over the W / t data-parallel ranks;
    ``workload``'s tokens are the group's, and a layer's activations ``tokens x width x (10 + 24 / t)`` bytes (the
    same authors' count with tensor parallelism and no sequence parallelism: what attention and the MLP hold is split,
    what the norms, the residual and the dropout masks hold is not)."""
    stored, e, _ = ELEMENT_BYTES[workload.precision]
    W, N = cluster.world, cluster.gpus_per_node
    plan = resolve(config, job_topology(config, W, N, 0), workload.precision)
    t, D, R = plan.tensor_parallel_size, plan.world_size, plan.hpz_partition_size  # D: the data-parallel ranks
    S = plan.ranks_per_node if plan.hybrid else D
    shard = sum(sum(u.shards(S)) for u in units)
    layers = max(len(units) - 1, 1)
    T = workload.tokens_per_gpu
    per_layer = T * n_embd * (10 * t + 24) // t
    activations = per_layer + (layers * 2 * T * n_embd if workload.activation_checkpointing else layers * per_layer)
    biggest = sorted((u.numel for u in units), reverse=True)[:2]
    out = {
        "parameters": shard * stored,
        "gradients": shard * stored,
        "optimizer": shard * 4 * workload.optimizer_states,
        "hpz_copy": sum(sum(u.shards(D)) * (D // R) for u in units) * e if 1 < R < D else 0,
        "unsharded_units": sum(biggest) * e * 2,
        "collective_buffers": collective_buffers(units, config, W, N),
        "activations": activations,
    }
    out.update(persistent_memory(units, config, W, N, workload.precision))
    if workload.optimizer_states < 2 and not plan.gradients.second_moment_strict:  # no Adam: "auto" leaves it alone
        out["second_moment_noise"] = 0
    return out


def check_tensor_parallel(tensor_parallel_size: object, cluster: Cluster) -> None:
    """Refuses a tensor-parallel size the strategy would refuse on ``cluster``: not an int >= 1 that divides the GPUs
    per node (its groups would span nodes, and their activations' all-reduces cross them)."""
    t, N = tensor_parallel_size, cluster.gpus_per_node
    if not (isinstance(t, int) and not isinstance(t, bool) and t >= 1 and N % t == 0):
        raise ValueError(f"planner: `tensor_parallel_size={t!r}` must be an int >= 1 that divides gpus_per_node={N}"
                         " (tensor parallelism stays inside a node): use one of"
                         f" {tensor_parallel_sizes(cluster)}.")  # fmt: skip


def tensor_parallel_sizes(cluster: Cluster) -> list[int]:
    """Every tensor-parallel size the cluster allows: the divisors of its GPUs per node."""
    return [t for t in range(1, cluster.gpus_per_node + 1) if cluster.gpus_per_node % t == 0]


def predict(
    units: list[Unit],
    cluster: Cluster,
    workload: Workload,
    configs: dict[str, dict] | None = None,
    n_embd: int = 0,
    tensor_parallel_size: int = 1,
) -> list[Row]:
    """One :class:`Row` per configuration (default :data:`CONFIGS`), the speedups against the first; with
    ``tensor_parallel_size`` t > 1, each configuration with ``tensor_parallel_size=t`` (one the strategy refuses
    raises its ValueError: HSDP, weight deltas), on the model's tensor-parallel pieces (the time model).
    ``n_embd`` 0: no width, so no activations in the memory and, with t > 1, no activation all-reduces (a note on
    each row says so)."""
    t = tensor_parallel_size
    check_tensor_parallel(t, cluster)
    local = tensor_parallel_units(units, t)
    group = replace(workload, tokens_per_gpu=t * workload.tokens_per_gpu)  # every GPU computes on its group's tokens
    layers = max(len(units) - 1, 1)
    tp_bytes, all_reduces = activation_all_reduce_bytes(
        layers, workload.tokens_per_gpu, n_embd, t, workload.precision, workload.activation_checkpointing
    )
    tp_s = tensor_parallel_seconds(tp_bytes, all_reduces, cluster, t)
    rows = []
    for name, kwargs in (configs or CONFIGS).items():
        config = ZeroPPConfig(**kwargs, **({"tensor_parallel_size": t} if t > 1 else {}))
        by_kind = step_bytes(local, config, cluster.world, cluster.gpus_per_node, 0, workload.precision)
        comm = sum(collective_seconds(k, *v, cluster, config) for k, v in by_kind.items())
        flops = step_flops(local, group)
        compute = compute_seconds(local, config, cluster, group)
        step = step_seconds(compute + tp_s, comm, workload.overlap)
        memory = memory_parts(local, config, cluster, group, n_embd)
        total = sum(memory.values())
        rows.append(
            Row(
                config=name,
                memory_gib={k: v / 2**30 for k, v in memory.items()} | {"total": total / 2**30},
                fits=total <= cluster.gpu_memory_gib * 2**30,
                inter_node_gb=sum(v[1] for v in by_kind.values()) / 1e9,
                intra_node_gb=sum(v[0] for v in by_kind.values()) / 1e9,
                bytes_by_kind=by_kind,
                compute_s=compute,
                comm_s=comm,
                step_s=step,
                tflops_per_gpu=flops / step / 1e12 * (6 / 8 if workload.activation_checkpointing else 1),
                notes=["no model width: the activations' all-reduces are left out"] if t > 1 and not n_embd else [],
                tensor_parallel_size=t,
                tensor_parallel_gb=tp_bytes / 1e9,
                tensor_parallel_s=tp_s,
            )
        )
    for row in rows:
        row.speedup = rows[0].step_s / row.step_s
    return rows
