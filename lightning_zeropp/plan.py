"""``python -m lightning_zeropp.plan``: what ZeRO-3, HSDP and ZeRO++ would cost on a cluster you cannot rent.

Given a model (its units' shapes: the example GPT's sizes, a litgpt config name, or a parameter count), a cluster and
a workload, it prints per configuration the memory per GPU by part, whether it fits, the bytes each GPU sends per step
inside and across nodes (exact: :mod:`lightning_zeropp.costs`, the ledger's arithmetic), and the predicted compute,
communication and step time, with the speedup over ZeRO-3.

The time model, stated:

- compute: ``6 x parameters x tokens`` FLOPs per GPU (8x with activation checkpointing: the forward runs twice) at
  ``efficiency x peak``, plus the quantization kernels' reads and writes at the device memory's bandwidth;
- a collective over all ranks (FSDP's all-gathers and reduce-scatter, qwZ's all-gather) runs as a ring: the link
  into each node carries ``(W - 1)`` shards, every GPU's own link ``(W - 1)`` shards, concurrently, so it takes the
  longer of the two, plus one latency per ring step; an all-to-all (qgZ's hops, weight deltas) or an all-reduce on
  the rails (HSDP) sends what the ledger counts, all of a node's GPUs sharing the node's inter-node link; collectives
  inside a node (hpZ, HSDP's gathers) use the GPUs' own links;
- overlap: FSDP2 prefetches the next unit's all-gather and reduces the last unit's gradients while the current unit
  computes, so a step takes ``max(compute, comm) + (1 - overlap) x min(compute, comm)``.

``efficiency`` and ``overlap`` are the model's two free parameters; their defaults are the values fitted on the
paper's end-to-end table (``benchmarks/plan_check.py --paper``, RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .config import ZeroPPConfig
from .core import HSDP_ARGUMENTS
from .costs import (
    ELEMENT_BYTES,
    Unit,
    collective_buffers,
    gpt_units,
    kernel_bytes,
    parameters,
    persistent_memory,
    step_bytes,
)

CONFIGS: dict[str, dict[str, Any]] = {
    "zero3": dict(quantize_weights=False, hpz_partition_size=1, quantize_gradients=False),
    "hsdp": dict(HSDP_ARGUMENTS),
    "zeropp": {},
    "zeropp+ef": dict(gradient_error_feedback=True),
    "zeropp+deltas": dict(weight_deltas=True),
}
"""The configurations every plan compares, by the names the README and the benchmarks use."""

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
    rings and its reduce-scatter with twice a ring's bytes (measured: RESULTS.md, the link/ledger arithmetic)."""

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

    def __post_init__(self) -> None:
        if self.backend not in ("nccl", "gloo"):
            raise ValueError(f"plan: `backend={self.backend!r}` must be 'nccl' or 'gloo'.")
        for name in ("nodes", "gpus_per_node"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"plan: `{name}={getattr(self, name)!r}` must be an int >= 1.")
        for name in ("inter_gbps", "intra_gbps", "gpu_memory_gib", "peak_tflops", "hbm_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"plan: `{name}={getattr(self, name)!r}` must be > 0.")

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class Workload:
    """Tokens each GPU processes per optimizer step, the precision, the optimizer's state per parameter (Adam: 2
    fp32 values), activation checkpointing, and the model's width for the activation estimate."""

    tokens_per_gpu: int
    precision: str = "bf16-mixed"
    optimizer_states: int = 2
    activation_checkpointing: bool = True
    efficiency: float = EFFICIENCY
    overlap: float = OVERLAP


@dataclass
class Row:
    """One configuration's plan."""

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


# ------------------------------------------------------------------------------------------------ time
def collective_seconds(kind: str, intra: int, inter: int, calls: int, cluster: Cluster, config: ZeroPPConfig) -> float:
    """Seconds one step's ``calls`` collectives of ``kind`` take, from the bytes one GPU sends (module docstring)."""
    N, W = cluster.gpus_per_node, cluster.world
    inter_Bps, intra_Bps = cluster.inter_gbps * 1e9 / 8, cluster.intra_gbps * 1e9 / 8
    lat_inter, lat_intra = cluster.inter_latency_us * 1e-6, cluster.intra_latency_us * 1e-6
    if kind in RING_KINDS and inter:  # a ring over all W ranks: shard = inter / (W - N) bytes per peer
        shard = inter / (W - N)
        wire = shard * (W - 1) * (2 if cluster.backend == "gloo" and kind == "gradient_reduce_scatter" else 1)
        return max(wire / inter_Bps, wire / intra_Bps) + calls * (W - 1) * lat_inter
    if kind in RING_KINDS and not inter:  # a ring inside the node (HSDP, or one node)
        return intra / intra_Bps + calls * (N - 1) * lat_intra
    seconds = intra / intra_Bps + (N * inter) / inter_Bps
    return seconds + calls * ((lat_inter if inter else 0.0) + (lat_intra if intra else 0.0))


def step_seconds(compute: float, comm: float, overlap: float) -> float:
    """A step's time from its compute and communication times (module docstring)."""
    return max(compute, comm) + (1 - overlap) * min(compute, comm)


def comm_seconds(units: list[Unit], config: ZeroPPConfig, cluster: Cluster, precision: str) -> float:
    """Seconds one step's collectives take on ``cluster`` (rank 0's bytes; ranks differ by padding only)."""
    by_kind = step_bytes(units, config, cluster.world, cluster.gpus_per_node, 0, precision)
    return sum(collective_seconds(k, *v, cluster, config) for k, v in by_kind.items())


def compute_seconds(units: list[Unit], config: ZeroPPConfig, cluster: Cluster, workload: Workload) -> float:
    """The model's FLOPs at ``efficiency`` x peak, plus the quantization kernels' bytes at the device memory's
    bandwidth (they run on the compute stream, between the layers)."""
    flops = step_flops(units, workload) / (cluster.peak_tflops * 1e12 * workload.efficiency)
    moved = kernel_bytes(units, config, cluster.world, cluster.gpus_per_node, workload.precision)
    return flops + moved / (cluster.hbm_gbps * 1e9)


def step_flops(units: list[Unit], workload: Workload) -> float:
    """FLOPs one GPU computes per optimizer step (module docstring)."""
    return (8 if workload.activation_checkpointing else 6) * parameters(units) * workload.tokens_per_gpu


def memory_parts(
    units: list[Unit], config: ZeroPPConfig, cluster: Cluster, workload: Workload, n_embd: int
) -> dict[str, float]:
    """Bytes per GPU by part: the sharded parameters, gradients and optimizer state; hpZ's copy (1/R of the weights,
    kept from a unit's forward to its backward); two units unsharded (the one computing and the one prefetched); the
    quantized collectives' buffers (:func:`~lightning_zeropp.costs.collective_buffers`);
    activations (``34 x tokens x width`` bytes per layer, as Korthikanti et al. count them with attention scores
    fused away; with checkpointing, one layer's plus every layer's input); the feedback residual and weight deltas'
    copies (``strategy.persistent_memory``)."""
    stored, e, _ = ELEMENT_BYTES[workload.precision]
    W, N = cluster.world, cluster.gpus_per_node
    _, R = config.resolve(W, N)
    S = N if config.hybrid else W
    shard = sum(sum(u.shards(S)) for u in units)
    layers = max(len(units) - 1, 1)
    T = workload.tokens_per_gpu
    per_layer = 34 * T * n_embd
    activations = per_layer + (layers * 2 * T * n_embd if workload.activation_checkpointing else layers * per_layer)
    biggest = sorted((u.numel for u in units), reverse=True)[:2]
    out = {
        "parameters": shard * stored,
        "gradients": shard * stored,
        "optimizer": shard * 4 * workload.optimizer_states,
        "hpz_copy": sum(sum(u.shards(W)) * (W // R) for u in units) * e if 1 < R < W else 0,
        "unsharded_units": sum(biggest) * e * 2,
        "collective_buffers": collective_buffers(units, config, W, N),
        "activations": activations,
    }
    out.update(persistent_memory(units, config, W, N, workload.precision))
    return out


def plan(
    units: list[Unit], cluster: Cluster, workload: Workload, configs: dict[str, dict] | None = None, n_embd: int = 0
) -> list[Row]:
    """One :class:`Row` per configuration (default :data:`CONFIGS`), the speedups against the first."""
    rows = []
    for name, kwargs in (configs or CONFIGS).items():
        config = ZeroPPConfig(**kwargs)
        by_kind = step_bytes(units, config, cluster.world, cluster.gpus_per_node, 0, workload.precision)
        comm = sum(collective_seconds(k, *v, cluster, config) for k, v in by_kind.items())
        flops = step_flops(units, workload)
        compute = compute_seconds(units, config, cluster, workload)
        step = step_seconds(compute, comm, workload.overlap)
        memory = memory_parts(units, config, cluster, workload, n_embd)
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
            )
        )
    for row in rows:
        row.speedup = rows[0].step_s / row.step_s
    return rows


OPT_IN_MARGIN = 1.10
"""An opt-in (error feedback, weight deltas) is recommended over the defaults only when it is this much faster: each
costs memory, and weight deltas' forward weights trail the exact ones by their INT4 rounding."""


def recommend(rows: list[Row]) -> str:
    """The configuration to use, and why: the fastest that fits, the defaults unless an opt-in beats them by
    :data:`OPT_IN_MARGIN`."""
    fitting = {r.config: r for r in rows if r.fits}
    if not fitting:
        return "none fits: more GPUs, activation checkpointing or CPU offload (cpu_offload=True)"
    best = min(fitting.values(), key=lambda r: r.step_s)
    default = fitting.get("zeropp")
    if best.config.startswith("zeropp+") and default is not None and best.step_s * OPT_IN_MARGIN > default.step_s:
        best = default
    bound = "communication" if best.comm_s > best.compute_s else "compute"
    why = [f"{best.speedup:.2f}x zero3's step", f"{bound}-bound", f"{best.memory_gib['total']:.1f} GiB per GPU"]
    unfit = [r.config for r in rows if not r.fits]
    if unfit:
        why.append(f"{', '.join(unfit)} does not fit")
    return f"{best.config} ({'; '.join(why)})"


# ------------------------------------------------------------------------------------------------ models
def model_units(args: argparse.Namespace) -> tuple[list[Unit], int, str]:
    """The units, the width and a description of the model the arguments name."""
    if args.litgpt:
        return _litgpt_units(args.litgpt)
    if args.params is not None:
        d = args.n_embd or _width_for(args.params, args.n_layer)
        layers = args.n_layer or max(1, round(args.params / (12 * d * d)))
        units = gpt_units(args.vocab, args.block_size, layers, d)
        return units, d, f"GPT, {layers} layers x {d} wide ({parameters(units) / 1e9:.2f}B parameters)"
    units = gpt_units(args.vocab, args.block_size, args.n_layer or 4, args.n_embd or 256)
    return units, args.n_embd or 256, f"example GPT ({parameters(units) / 1e6:.2f}M parameters)"


def _width_for(params: float, layers: int | None) -> int:
    """A width (multiple of 128) for ``params`` parameters: ``12 L d^2`` with ``L = d / 128`` when not given."""
    if layers:
        return max(128, round(math.sqrt(params / (12 * layers)) / 128) * 128)
    return max(128, round((params * 128 / 12) ** (1 / 3) / 128) * 128)


def _litgpt_units(name: str) -> tuple[list[Unit], int, str]:
    try:
        import torch
        from litgpt import GPT, Config
    except ImportError:
        raise SystemExit("plan: `--litgpt` needs litgpt installed (pip install litgpt).") from None
    from .costs import units_of

    config = Config.from_name(name)
    with torch.device("meta"):
        model = GPT(config)
    units = units_of(model)
    return units, config.n_embd, f"litgpt {name} ({parameters(units) / 1e9:.2f}B parameters)"


# ------------------------------------------------------------------------------------------------ output
MEMORY_GROUPS = {
    "sharded state": ("parameters", "gradients", "optimizer"),
    "hpZ copy": ("hpz_copy",),
    "feedback / deltas": ("error_feedback", "weight_deltas_node_copy", "weight_deltas_tracked_copy"),
    "activations, buffers": ("activations", "unsharded_units", "collective_buffers"),
}
"""How the table groups the memory parts (the JSON keeps each part)."""


def table(rows: list[Row]) -> str:
    head = ["config", "GiB per GPU", *MEMORY_GROUPS, "fits", "inter GB/GPU", "intra GB/GPU", "compute s", "comm s",
            "step s", "speedup"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        groups = [sum(r.memory_gib[p] for p in parts) for parts in MEMORY_GROUPS.values()]
        cells = [r.config, f"{r.memory_gib['total']:.2f}", *[f"{g:.2f}" for g in groups], "yes" if r.fits else "NO",
                 f"{r.inter_node_gb:.3f}", f"{r.intra_node_gb:.3f}", f"{r.compute_s:.3f}", f"{r.comm_s:.3f}",
                 f"{r.step_s:.3f}", f"{r.speedup:.2f}x"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(units: list[Unit], cluster: Cluster, workload: Workload, path: Path, title: str) -> None:
    """Step time against inter-node bandwidth for every configuration (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bandwidths = [cluster.inter_gbps * f for f in (1 / 16, 1 / 8, 1 / 4, 1 / 2, 1, 2, 4, 8)]
    series: dict[str, list[float]] = {}
    for bw in bandwidths:
        at = Cluster(**{**asdict(cluster), "inter_gbps": bw})
        for row in plan(units, at, workload):
            series.setdefault(row.config, []).append(row.step_s)
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, times in series.items():
        ax.plot(bandwidths, times, marker="o", label=name, linestyle="--" if name.endswith("+ef") else "-")
    ax.axvline(cluster.inter_gbps, color="grey", linestyle=":", label=f"{cluster.inter_gbps:g} Gbit/s")
    ax.set(xscale="log", yscale="log", xlabel="inter-node bandwidth per node (Gbit/s)", ylabel="step time (s)")
    ax.set_title(title.replace(" on ", "\non ", 1), fontsize=9)  # two lines: it fits the figure
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lightning_zeropp.plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    m = p.add_argument_group("model (default: the example GPT's demo size)")
    m.add_argument("--params", type=float, default=None, help="parameter count of a GPT (e.g. 7e9)")
    m.add_argument("--n-layer", type=int, default=None, help="layers (units); with --params: else derived")
    m.add_argument("--n-embd", type=int, default=None, help="width; with --params: else derived")
    m.add_argument("--vocab", type=int, default=256, help="vocabulary (default: 256, the example's bytes)")
    m.add_argument("--block-size", type=int, default=128, help="positions (default: 128)")
    m.add_argument("--litgpt", default=None, help="a litgpt config name (needs litgpt), e.g. pythia-1b")
    c = p.add_argument_group("cluster")
    c.add_argument("--nodes", type=int, default=2)
    c.add_argument("--gpus-per-node", type=int, default=8)
    c.add_argument("--inter-gbps", type=float, default=100.0, help="inter-node bandwidth per node, Gbit/s")
    c.add_argument("--intra-gbps", type=float, default=2400.0, help="intra-node bandwidth per GPU, Gbit/s")
    c.add_argument("--inter-latency-us", type=float, default=5.0)
    c.add_argument("--intra-latency-us", type=float, default=2.0)
    c.add_argument("--gpu-memory-gib", type=float, default=80.0)
    c.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak per GPU (H100: 989)")
    c.add_argument("--hbm-gbps", type=float, default=3350.0, help="device memory bandwidth per GPU, GB/s (H100: 3350)")
    w = p.add_argument_group("workload")
    w.add_argument("--tokens", type=int, default=4096, help="tokens per GPU per optimizer step")
    w.add_argument("--precision", default="bf16-mixed", choices=sorted(ELEMENT_BYTES))
    w.add_argument("--optimizer-states", type=int, default=2, help="fp32 values per parameter (Adam: 2, SGD: 1)")
    w.add_argument("--no-activation-checkpointing", action="store_true")
    w.add_argument("--efficiency", type=float, default=EFFICIENCY, help="compute's fraction of peak (fitted)")
    w.add_argument("--overlap", type=float, default=OVERLAP, help="share of the shorter of compute/comm hidden")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None, help="a PNG of step time against inter-node bandwidth")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[Row]:
    args = parse_args(argv)
    units, width, described = model_units(args)
    cluster = Cluster(args.nodes, args.gpus_per_node, args.inter_gbps, args.intra_gbps, args.inter_latency_us,
                      args.intra_latency_us, args.gpu_memory_gib, args.peak_tflops, hbm_gbps=args.hbm_gbps)  # fmt: skip
    workload = Workload(args.tokens, args.precision, args.optimizer_states, not args.no_activation_checkpointing,
                        args.efficiency, args.overlap)  # fmt: skip
    rows = plan(units, cluster, workload, n_embd=width)
    title = (f"{described} on {cluster.nodes} x {cluster.gpus_per_node} GPUs, {cluster.inter_gbps:g} Gbit/s between"
             f" nodes, {workload.tokens_per_gpu} tokens per GPU")  # fmt: skip
    print(title + "\n")
    print(table(rows))
    print(f"\nrecommended: {recommend(rows)}")
    if args.json:
        args.json.write_text(json.dumps({"model": described, "cluster": asdict(cluster), "workload": asdict(workload),
                                         "rows": [asdict(r) for r in rows]}, indent=2))  # fmt: skip
        print(f"wrote {args.json}")
    if args.plot:
        plot(units, cluster, workload, args.plot, title)
        print(f"wrote {args.plot}")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
