"""``python -m lightning_zeropp.planner``: what ZeRO-3, HSDP, quantized HSDP and ZeRO++ would cost on a cluster you
cannot rent.

Given a model (its units' shapes: the example GPT's sizes, a litgpt config name, or a parameter count), a cluster and
a workload, it prints per configuration the memory per GPU by part, whether it fits, the bytes each GPU sends per step
inside and across nodes (exact: :mod:`lightning_zeropp.costs`, the ledger's arithmetic), and the predicted compute,
communication and step time, with the speedup over ZeRO-3.

The time model, stated:

- compute: ``6 x parameters x tokens`` FLOPs per GPU (8x with activation checkpointing: the forward runs twice) at
  ``efficiency x peak``, plus the quantization kernels' and the second-moment correction's reads and writes at the
  device memory's bandwidth;
- a collective over all ranks (FSDP's all-gathers and reduce-scatter, qwZ's all-gather) runs as a ring: the link
  into each node carries ``(W - 1)`` shards, every GPU's own link ``(W - 1)`` shards, concurrently, so it takes the
  longer of the two, plus one latency per ring step; an all-to-all (qgZ's hops, weight deltas) or an all-reduce on
  the rails (HSDP; quantized HSDP's reduce-scatter and all-gather) sends what the ledger counts, all of a node's GPUs
  sharing the node's inter-node link; collectives
  inside a node (hpZ, HSDP's gathers) use the GPUs' own links;
- overlap: FSDP2 prefetches the next unit's all-gather and reduces the last unit's gradients while the current unit
  computes, so a step takes ``max(compute, comm) + (1 - overlap) x min(compute, comm)``;
- tensor parallelism (``--tensor-parallel-size`` t, inside the node; ``auto`` compares every t that divides the node):
  the same global batch, so a group of t GPUs computes on t x the tokens per GPU with its pieces of the weights
  (:func:`~lightning_zeropp.costs.tensor_parallel_units`); ZeRO++ runs on the W / t data-parallel ranks, N / t per
  node, the t groups (one per tensor-parallel position) at once, sharing the node's link; the activations' all-reduces
  (:func:`~lightning_zeropp.costs.activation_all_reduce_bytes`) stay in the node, on each GPU's own link, and add to
  the compute (the next matrix multiply waits for them), reported apart from the data-parallel bytes. Not modeled:
  the split matrix multiplies' lower efficiency, sequence parallelism (activations as Megatron counts them without).

``efficiency`` and ``overlap`` are the model's two free parameters; their defaults are the values fitted on the
paper's end-to-end table (``benchmarks/plan_check.py --paper``, docs/results/planner.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NoReturn

from .costs import ELEMENT_BYTES, Unit, gpt_units, parameters
from .prediction import CONFIGS, EFFICIENCY, OVERLAP, Cluster, Row, Workload, predict, tensor_parallel_sizes
from .recommendation import MARGIN, Verdict, choose_tensor_parallel, compare_tensor_parallel, verdict_text

# ------------------------------------------------------------------------------------------------ kernels
# The kernels the defaults launch, as benchmarks/kernels.py names its rows: qwZ's INT8 quantize and dequantize on
# parameter-aligned blocks, qgZ's swizzle-quantize, INT8 -> INT4 re-quantization and INT4 dequantize-reduce.
DEFAULT_KERNELS = ("quantize int8 param-blocks", "dequantize int8 param-blocks", "swizzle_quantize int8",
                   "dequantize_reduce_quantize 8->4", "dequantize_reduce int4")  # fmt: skip
MEASURED_FROM_MB = 12.0
"""Rows of at least this many MB count (a 7B layer's per-rank shard is 12.65 MB): smaller ones are launch-bound."""


def measured_kernels(path: Path) -> tuple[float, str]:
    """(GB/s, where it came from) of the defaults' kernels in a table ``benchmarks/kernels.py --json`` wrote on a GPU:
    their bytes over their device time, summed over the rows of :data:`DEFAULT_KERNELS` at >= 12 MB. Raises
    :class:`InputError` for a file that is not such a table, a table timed with the launcher inside (written before
    device time was measured apart), or one whose device waited for the host."""
    try:
        table = json.loads(Path(path).read_text())
        rows = table["rows"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise InputError(f"--kernels {path}: not a table of benchmarks/kernels.py --json ({err})") from None
    if not rows or "device_s" not in rows[0]:
        raise InputError(f"--kernels {path}: its times include the launcher (no device_s column); rerun"
                         " benchmarks/kernels.py --json on the GPU, which measures device time apart")  # fmt: skip
    used = [r for r in rows if r["kernel"] in DEFAULT_KERNELS and r["size_mb"] >= MEASURED_FROM_MB]
    missing = sorted(set(DEFAULT_KERNELS) - {r["kernel"] for r in used})
    if missing:
        raise InputError(f"--kernels {path}: no rows of {', '.join(missing)} at >= {MEASURED_FROM_MB:g} MB; rerun"
                         " benchmarks/kernels.py with its default sizes")  # fmt: skip
    starved = sorted({r["kernel"] for r in used if r.get("starved")})
    if starved:
        raise InputError(f"--kernels {path}: the device waited for the host in {', '.join(starved)} (device time"
                         " not measured); rerun benchmarks/kernels.py")  # fmt: skip
    gbps = sum(r["bytes_moved"] for r in used) / sum(r["device_s"] for r in used) / 1e9
    return gbps, f"{table.get('device', 'a GPU')}, {path}"


# ------------------------------------------------------------------------------------------------ models
DEMO = dict(n_layer=4, n_embd=256, vocab=256, block_size=128)
"""The example GPT's demo size (``examples/gpt``: bytes as tokens), planned when no model is given."""

LLM_VOCAB, LLM_BLOCK = 50304, 4096
"""A real model's vocabulary (GPT-2's, padded to a multiple of 64) and positions, when ``--params`` or a shape is
given without them: a 256-entry vocabulary would leave out the largest unit, the embedding."""

PARAMS_TOLERANCE = 0.10
"""How far the model planned may be from ``--params``: its shape is whole layers of a width that is a multiple of
128, or given."""


_SUFFIXES = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}


def parameter_count(text: str) -> float:
    """``--params``: a number (``7e9``, ``1300000000``) or one with a suffix, as models are named (``7B``, ``1.3B``,
    ``350M``, ``70b``)."""
    value = text.strip().replace("_", "")
    scale = _SUFFIXES.get(value[-1:].upper(), 1.0) if value else 1.0
    number = value[:-1] if scale != 1.0 else value
    try:
        count = float(number) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a parameter count; use a number (7e9) or one with K, M, B or T (7B, 1.3B, 350M)"
        ) from None
    return count  # its range is checked with the other arguments' (``RULES``)


class InputError(ValueError):
    """An argument the planner cannot use; the message names it and the fix."""


@dataclass
class Model:
    """The model planned: its units, width (for the activations), vocabulary and positions, and where it came from
    (``"demo"``, ``"params"``, ``"shape"`` or ``"litgpt"``)."""

    units: list[Unit]
    width: int
    description: str
    source: str
    vocab: int
    block_size: int
    layers: int


def model_of(args: argparse.Namespace) -> Model:
    """The model the arguments name (``--litgpt``, ``--params`` with or without a shape, a shape, or the demo), or
    :class:`InputError` naming the conflict."""
    shape = [f"--{k.replace('_', '-')}" for k in ("params", "n_layer", "n_embd", "vocab", "block_size")
             if getattr(args, k) is not None]  # fmt: skip
    if args.litgpt:
        if shape:
            raise InputError(f"--litgpt {args.litgpt} takes the model's shape from litgpt's config: drop"
                             f" {', '.join(shape)}")  # fmt: skip
        return _litgpt_model(args.litgpt)
    if args.params is None and args.n_layer is None and args.n_embd is None:
        vocab, block = args.vocab or DEMO["vocab"], args.block_size or DEMO["block_size"]
        units = gpt_units(vocab, block, DEMO["n_layer"], DEMO["n_embd"])
        described = (f"the example's demo GPT, {DEMO['n_layer']} layers x {DEMO['n_embd']} wide, vocabulary {vocab},"
                     f" {block} positions ({_count(parameters(units))})")  # fmt: skip
        return Model(units, DEMO["n_embd"], described, "demo", vocab, block, DEMO["n_layer"])
    vocab, block = args.vocab or LLM_VOCAB, args.block_size or LLM_BLOCK
    layers, width = args.n_layer, args.n_embd
    if args.params is None and not (layers and width):
        given, missing = ("--n-layer", "--n-embd") if layers else ("--n-embd", "--n-layer")
        raise InputError(f"{given} alone is half a shape: add {missing}, or --params to derive it")
    if args.params is not None and not (layers and width):
        layers, width = _derive_shape(args.params, layers, width, vocab + block)
    units = gpt_units(vocab, block, layers, width)
    count = parameters(units)
    described = f"GPT, {layers} layers x {width} wide, vocabulary {vocab}, {block} positions ({_count(count)})"
    if args.params is not None:
        if abs(count / args.params - 1) > PARAMS_TOLERANCE:
            fix = ("pass --n-layer and --n-embd that make it" if args.n_layer and args.n_embd else
                   "pass --n-layer and --n-embd (and --vocab, --block-size) for a model of this size")  # fmt: skip
            raise InputError(f"--params {_sci(args.params)}: the shape {layers} layers x {width} wide (vocabulary"
                             f" {vocab}, {block} positions) has {_count(count)}, more than {PARAMS_TOLERANCE:.0%}"
                             f" away: {fix}")  # fmt: skip
        return Model(units, width, described, "params", vocab, block, layers)
    return Model(units, width, described, "shape", vocab, block, layers)


def _sci(x: float) -> str:
    """``x`` as a user would type it: 7e9, 1.3e9, 70e9 as 7e10."""
    return f"{x:.4g}".replace("e+0", "e").replace("e+", "e")


def _count(n: float) -> str:
    """``n`` parameters, in words: 7.08B parameters."""
    return f"{n / 1e9:.2f}B parameters" if n >= 1e9 else f"{n / 1e6:.2f}M parameters"


def _derive_shape(params: float, layers: int | None, width: int | None, embedded: int) -> tuple[int, int]:
    """Layers and width (a multiple of 128) of a GPT of ``params`` parameters: ``12 L d^2`` in the blocks and
    ``embedded x d`` in the embeddings (vocabulary and positions); ``L = d / 128`` (as Llama's 7B and 13B) when neither
    is given."""
    if width is None and layers:
        exact = (-embedded + math.sqrt(embedded**2 + 48 * layers * params)) / (24 * layers)
        return layers, max(128, round(exact / 128) * 128)
    if width is None:
        width = max(128, round((params * 128 / 12) ** (1 / 3) / 128) * 128)
    return max(1, round((params - embedded * width) / (12 * width * width))), width


def _litgpt_model(name: str) -> Model:
    try:
        import torch
        from litgpt import GPT, Config
    except ImportError:
        raise InputError(f"--litgpt {name} needs litgpt installed (pip install litgpt), or describe the model with"
                         " --params / --n-layer and --n-embd") from None  # fmt: skip
    from .costs import units_of

    try:
        config = Config.from_name(name)
    except ValueError:  # litgpt's message lists every name it knows: too long for one line
        raise InputError(f"--litgpt {name}: litgpt has no config of that name (its names: litgpt.config.name_to_config,"
                         " e.g. pythia-1b, Llama-2-7b-hf)") from None  # fmt: skip
    with torch.device("meta"):
        model = GPT(config)
    units = units_of(model)
    count = _count(parameters(units))
    described = (f"litgpt {name}, {config.n_layer} layers x {config.n_embd} wide, vocabulary"
                 f" {config.padded_vocab_size}, {config.block_size} positions ({count})")  # fmt: skip
    return Model(units, config.n_embd, described, "litgpt", config.padded_vocab_size, config.block_size, config.n_layer)


# ------------------------------------------------------------------------------------------------ output
MEMORY_GROUPS = {
    "sharded state": ("parameters", "gradients", "optimizer"),
    "hpZ copy": ("hpz_copy",),
    "feedback / deltas": (
        "error_feedback",
        "second_moment_noise",
        "weight_deltas_node_copy",
        "weight_deltas_tracked_copy",
    ),
    "activations, buffers": ("activations", "unsharded_units", "collective_buffers"),
}
"""How the table groups the memory parts (the JSON keeps each part)."""


def table(rows: list[Row], tensor_parallel: bool = False) -> str:
    """The rows as a Markdown table; ``tensor_parallel``: with the activations' all-reduces inside the node (GB per GPU
    per step, and seconds), beside the data-parallel columns, not in them."""
    tp = (lambda *cells: list(cells)) if tensor_parallel else (lambda *cells: [])
    head = ["config", "GiB per GPU", *MEMORY_GROUPS, "fits", "inter GB/GPU", "intra GB/GPU", *tp("TP GB/GPU"),
            "compute s", "comm s", *tp("TP s"), "step s", "speedup"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        groups = [sum(r.memory_gib[p] for p in parts) for parts in MEMORY_GROUPS.values()]
        cells = [r.config, f"{r.memory_gib['total']:.2f}", *[f"{g:.2f}" for g in groups], "yes" if r.fits else "NO",
                 f"{r.inter_node_gb:.3f}", f"{r.intra_node_gb:.3f}", *tp(f"{r.tensor_parallel_gb:.3f}"),
                 f"{r.compute_s:.3f}", f"{r.comm_s:.3f}", *tp(f"{r.tensor_parallel_s:.3f}"), f"{r.step_s:.3f}",
                 f"{r.speedup:.2f}x"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(
    units: list[Unit],
    cluster: Cluster,
    workload: Workload,
    path: Path,
    title: str,
    configs: dict | None = None,
    n_embd: int = 0,
    tensor_parallel_size: int = 1,
) -> None:
    """Step time against inter-node bandwidth for every configuration (default :data:`CONFIGS`; log-log), with
    ``tensor_parallel_size``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bandwidths = [cluster.inter_gbps * f for f in (1 / 16, 1 / 8, 1 / 4, 1 / 2, 1, 2, 4, 8)]
    series: dict[str, list[float]] = {}
    for bw in bandwidths:
        at = Cluster(**{**asdict(cluster), "inter_gbps": bw})
        for row in predict(units, at, workload, configs, n_embd, tensor_parallel_size):
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


# ------------------------------------------------------------------------------------------------ arguments
GPUS: dict[str, dict[str, float]] = {
    "V100": dict(gpu_memory_gib=32.0, peak_tflops=125.0, hbm_gbps=900.0, intra_gbps=1200.0),
    "A100": dict(gpu_memory_gib=80.0, peak_tflops=312.0, hbm_gbps=2039.0, intra_gbps=2400.0),
    "H100": dict(gpu_memory_gib=80.0, peak_tflops=989.0, hbm_gbps=3350.0, intra_gbps=3600.0),
    "H200": dict(gpu_memory_gib=140.0, peak_tflops=989.0, hbm_gbps=4800.0, intra_gbps=3600.0),
}
"""``--gpu``: the SXM parts' datasheet figures. Memory: the datasheet's GB read as GiB, as the parts report it (an "80
GB" A100 has 80 GiB), H200's 141 GB as 140 GiB; peak: dense fp16/bf16 tensor TFLOP/s, no sparsity (V100: fp16, it has
no bf16); HBM: GB/s; ``intra_gbps``: NVLink per GPU and direction in Gbit/s (NVLink 2, 3, 4: 150, 300, 450 GB/s)."""

GPU = "H100"
"""The ``--gpu`` preset when none is given (the figures the planner used before it had presets, NVLink aside)."""

RULES: dict[str, tuple[Any, str]] = {
    "params": (lambda v: v >= 1, "a parameter count >= 1, e.g. 7e9 or 7B"),
    "n_layer": (lambda v: v >= 1, "a number of layers >= 1 (leave it out to derive it from --params)"),
    "n_embd": (lambda v: v >= 1, "a width >= 1 (leave it out to derive it from --params)"),
    "vocab": (lambda v: v >= 1, "a vocabulary size >= 1, e.g. 50304"),
    "block_size": (lambda v: v >= 1, "a number of positions >= 1, e.g. 4096"),
    "nodes": (lambda v: v >= 1, "a number of nodes >= 1"),
    "gpus_per_node": (lambda v: v >= 1, "a number of GPUs per node >= 1, e.g. 8"),
    "inter_gbps": (lambda v: v > 0, "Gbit/s > 0 into each node, e.g. 400 per InfiniBand NDR port"),
    "intra_gbps": (lambda v: v > 0, "Gbit/s > 0 per GPU inside a node, e.g. 3600 (NVLink 4)"),
    "inter_latency_us": (lambda v: v >= 0, "microseconds >= 0"),
    "intra_latency_us": (lambda v: v >= 0, "microseconds >= 0"),
    "gpu_memory_gib": (lambda v: v > 0, "GiB > 0 per GPU, e.g. 80"),
    "peak_tflops": (lambda v: v > 0, "dense TFLOP/s > 0 per GPU, e.g. 989"),
    "hbm_gbps": (lambda v: v > 0, "GB/s > 0 per GPU, e.g. 3350"),
    "tokens": (lambda v: v >= 1, "tokens per GPU per optimizer step >= 1, e.g. 4096"),
    "optimizer_states": (lambda v: v >= 0, "fp32 values per parameter >= 0 (Adam: 2, SGD with momentum: 1)"),
    "efficiency": (lambda v: 0 < v <= 1, "a fraction of peak in (0, 1], e.g. 0.645"),
    "overlap": (lambda v: 0 <= v <= 1, "a fraction in [0, 1]"),
    "margin": (lambda v: v >= 0, "a fraction >= 0, e.g. 0.1 for a tenth"),
}
"""Each numeric argument's valid values and what to pass instead, checked before anything is planned."""

TENSOR_PARALLEL_AUTO = "auto"
"""``--tensor-parallel-size auto``: compare every size that divides the node and recommend one."""


def tensor_parallel_size(text: str) -> int | str:
    """``--tensor-parallel-size``: a whole number (checked against ``--gpus-per-node`` with the other arguments) or
    ``auto``."""
    if text.strip().lower() == TENSOR_PARALLEL_AUTO:
        return TENSOR_PARALLEL_AUTO
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; use a whole number that divides --gpus-per-node"
                                         " (1: no tensor parallelism) or auto") from None  # fmt: skip


class _Parser(argparse.ArgumentParser):
    """Errors in one line on stderr, exit code 2: the usage above them would bury the line that matters."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


class _ShowDefaults:
    """Adds arguments to a parser or group (``target``), each one's default after its help unless it has none."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = self.target.add_argument(*args, **kwargs)
        if action.help and action.default is not None and action.default is not False:
            action.help += " (default: %(default)s)"
        return action


def parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m lightning_zeropp.planner",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    shown = _ShowDefaults(p)
    m = _ShowDefaults(p.add_argument_group("model (none given: the example's 3.26M demo GPT, which is not your model)"))
    m.add_argument("--params", type=parameter_count, help="parameter count of a GPT: 7e9, 7B, 1.3B, 350M; its shape is"
                   " derived (layers = width / 128) unless given; beside --n-layer and --n-embd, a check: they must"
                   f" make it within {PARAMS_TOLERANCE:.0%}%")  # fmt: skip
    m.add_argument("--n-layer", type=int, help="layers (units); with --n-embd, the shape; with --params, the width is"
                   " derived")  # fmt: skip
    m.add_argument("--n-embd", type=int, help="width; with --n-layer, the shape; with --params, the layers are derived")
    m.add_argument("--vocab", type=int, help=f"vocabulary (default: {LLM_VOCAB} for --params or a shape; the demo's"
                   f" {DEMO['vocab']} bytes without)")  # fmt: skip
    m.add_argument("--block-size", type=int, help=f"positions (default: {LLM_BLOCK} for --params or a shape; the"
                   f" demo's {DEMO['block_size']} without)")  # fmt: skip
    m.add_argument("--litgpt", help="a litgpt config name, e.g. pythia-1b (needs litgpt); alone: it is the shape")
    c = _ShowDefaults(p.add_argument_group("cluster"))
    c.add_argument("--nodes", type=int, default=2, help="nodes (machines) in the job")
    c.add_argument("--gpus-per-node", type=int, default=8, help="GPUs (ranks) per node")
    c.add_argument("--gpu", choices=sorted(GPUS), default=GPU, help="memory, peak, HBM and NVLink presets: "
                   + "; ".join(f"{k}: {v['gpu_memory_gib']:g} GiB, {v['peak_tflops']:g} TFLOP/s, {v['hbm_gbps']:g}"
                               f" GB/s, {v['intra_gbps']:g} Gbit/s" for k, v in GPUS.items())
                   + "; the four flags below override it")  # fmt: skip
    c.add_argument("--gpu-memory-gib", type=float, help="memory per GPU, GiB (default: --gpu's)")
    c.add_argument("--peak-tflops", type=float, help="dense bf16/fp16 peak per GPU, TFLOP/s (default: --gpu's)")
    c.add_argument("--hbm-gbps", type=float, help="device memory bandwidth per GPU, GB/s (default: --gpu's)")
    c.add_argument(
        "--kernels",
        type=Path,
        help="the quantization kernels' measured speed: the JSON"
        " benchmarks/kernels.py --json wrote on your GPU (default: they run at --hbm-gbps, an upper bound)",
    )
    c.add_argument("--intra-gbps", type=float, help="intra-node bandwidth per GPU and direction, Gbit/s (default:"
                   " --gpu's NVLink)")  # fmt: skip
    c.add_argument("--inter-gbps", type=float, default=100.0, help="inter-node bandwidth per node (all its NICs),"
                   " Gbit/s; 8 x 400G InfiniBand: 3200")  # fmt: skip
    c.add_argument("--inter-latency-us", type=float, default=5.0, help="per message between nodes, microseconds")
    c.add_argument("--intra-latency-us", type=float, default=2.0, help="per message inside a node, microseconds")
    w = _ShowDefaults(p.add_argument_group("workload"))
    w.add_argument("--tokens", type=int, default=4096, help="tokens per GPU per optimizer step")
    w.add_argument("--precision", default="bf16-mixed", choices=sorted(ELEMENT_BYTES), help="Lightning's precision")
    w.add_argument(
        "--optimizer-states",
        type=int,
        default=2,
        help="fp32 values per parameter (Adam: 2, SGD: 1; below 2: no second moment to correct)",
    )
    w.add_argument("--no-activation-checkpointing", action="store_true", help="predict without it (default: with)")
    w.add_argument("--efficiency", type=float, default=EFFICIENCY, help="compute's fraction of peak (fitted on the"
                   " paper's V100 table: measure yours)")  # fmt: skip
    w.add_argument("--overlap", type=float, default=OVERLAP, help="share of the shorter of compute/comm hidden"
                   " (fitted as above)")  # fmt: skip
    shown.add_argument("--tensor-parallel-size", type=tensor_parallel_size, default=1, help="tensor parallelism"
                       " inside each node (Megatron-style: each layer split over groups of this many GPUs, ZeRO++"
                       " over the groups); auto: compare every size that divides --gpus-per-node and recommend"
                       " one")  # fmt: skip
    shown.add_argument("--margin", type=float, default=MARGIN, help="a configuration is recommended over a simpler one"
                   " only when its step is more than this fraction shorter")  # fmt: skip
    shown.add_argument("--json", type=Path, help="write the predictions and the verdict to this file")
    shown.add_argument("--plot", type=Path, help="a PNG of step time against inter-node bandwidth (needs matplotlib)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments, checked (:data:`RULES`, the output files' folders, the plot's matplotlib), the ``--gpu``
    preset filled in where no flag overrides it; ``args.defaults`` names those the command line left out."""
    p = parser()
    args = p.parse_args(argv)
    unset = object()  # argparse fills in a default only where the namespace lacks the attribute
    given = p.parse_args(argv, argparse.Namespace(**{k: unset for k in vars(args)}))
    args.defaults = {k for k, v in vars(given).items() if v is unset}
    for name, value in GPUS[args.gpu].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
            if "gpu" not in args.defaults:  # the preset the user chose, not a default
                args.defaults.discard(name)
    for name, (valid, fix) in RULES.items():
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and valid(value)):
            p.error(f"--{name.replace('_', '-')}={_sci(value)}: must be {fix}")
    t, N = args.tensor_parallel_size, args.gpus_per_node
    if t != TENSOR_PARALLEL_AUTO and (t < 1 or N % t):
        sizes = ", ".join(str(d) for d in range(1, N + 1) if N % d == 0)
        p.error(f"--tensor-parallel-size={t}: must be a size >= 1 that divides --gpus-per-node={N} (tensor"
                f" parallelism stays inside a node): use one of {sizes}, or auto")  # fmt: skip
    for flag in ("json", "plot"):
        path = getattr(args, flag)
        if path is not None and not path.parent.is_dir():
            p.error(f"--{flag} {path}: the folder {path.parent} does not exist: create it or write elsewhere")
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        p.error(f"--plot {args.plot} needs matplotlib (pip install matplotlib): install it or drop --plot")
    return args


def header(args: argparse.Namespace, model: Model, cluster: Cluster, workload: Workload) -> str:
    """Every assumption the predictions rest on, a ``*`` after each one left at its default."""
    c, w = cluster, workload
    shown = {
        "nodes": f"{c.nodes} node" + "s" * (c.nodes > 1), "gpus_per_node": f"{c.gpus_per_node} GPUs", "gpu": args.gpu,
        "gpu_memory_gib": f"{c.gpu_memory_gib:g} GiB", "peak_tflops": f"{c.peak_tflops:g} TFLOP/s",
        "hbm_gbps": f"{c.hbm_gbps:g} GB/s", "inter_gbps": f"{c.inter_gbps:g} Gbit/s",
        "intra_gbps": f"{c.intra_gbps:g} Gbit/s", "inter_latency_us": f"{c.inter_latency_us:g} us",
        "intra_latency_us": f"{c.intra_latency_us:g} us", "tokens": f"{w.tokens_per_gpu} tokens",
        "precision": w.precision, "optimizer_states": f"{w.optimizer_states} fp32 optimizer values",
        "no_activation_checkpointing": "activation checkpointing" + ("" if w.activation_checkpointing else " off"),
        "efficiency": f"efficiency {w.efficiency:g}", "overlap": f"overlap {w.overlap:g}",
        "margin": f"verdict margin {args.margin:.0%}",
        "vocab": f"vocabulary {model.vocab}", "block_size": f"{model.block_size} positions",
    }  # fmt: skip
    v = {k: text + ("*" if k in args.defaults or getattr(args, k) is None else "") for k, text in shown.items()}
    lines = []
    if model.source == "demo":
        lines.append(f"NOTE: no model given, so this plans the example's demo model, {_count(parameters(model.units))}:"
                     " pass --params or --litgpt for yours")  # fmt: skip
    described = model.description
    if model.source in ("params", "shape"):
        asked = f", --params {_sci(args.params)}" if model.source == "params" else ""
        described = (f"GPT, {model.layers} layers x {model.width} wide, {v['vocab']}, {v['block_size']}"
                     f" ({_count(parameters(model.units))}{asked})")  # fmt: skip
    lines += [
        f"model:    {described}",
        f"cluster:  {v['nodes']} x {v['gpus_per_node']} = {c.world} GPUs, {v['gpu']}: {v['gpu_memory_gib']},"
        f" {v['peak_tflops']} dense, {v['hbm_gbps']} HBM per GPU",
        "kernels:  "
        + (
            f"{c.kernel_gbps:.0f} GB/s by device time, measured ({args.kernels_source})"
            if c.kernel_gbps
            else "at the HBM bandwidth: assumed, an upper bound (--kernels FILE: a table benchmarks/kernels.py --json"
            " wrote on your GPU)"
        ),
        f"links:    {v['inter_gbps']} into each node ({v['inter_latency_us']}), {v['intra_gbps']} per GPU inside a"
        f" node ({v['intra_latency_us']})",
        f"workload: {v['tokens']} per GPU per step, {v['precision']}, {v['optimizer_states']} per parameter,"
        f" {v['no_activation_checkpointing']}",
        f"time:     {v['efficiency']} of peak, {v['overlap']} (fitted on the paper's V100 table: measure yours);"
        f" {v['margin']}",
        "          * = a default: check it against your job",
    ]
    t = args.tensor_parallel_size
    if t != 1:  # asked for: without it, the header is what it was before tensor parallelism was planned
        sizes = tensor_parallel_sizes(c) if t == TENSOR_PARALLEL_AUTO else [t]
        which = (f"auto: each size that divides the node ({', '.join(map(str, sizes))}) planned and one recommended"
                 if t == TENSOR_PARALLEL_AUTO else f"{t} inside each node, ZeRO++ over {c.world // t} data-parallel"
                 f" ranks, {c.gpus_per_node // t} per node")  # fmt: skip
        lines[-1:-1] = [
            f"tensor:   {which}; a group of t GPUs computes on t x {w.tokens_per_gpu} tokens (the same global batch);"
            " each layer's activations all-reduced inside the node (Megatron-style: 2 forward, 2 backward, 2 more"
            " with checkpointing's recompute); a static model: the split matrix multiplies' efficiency and sequence"
            " parallelism are not in it"
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[Row]:
    args = parse_args(argv)
    try:
        model = model_of(args)
        kernel_gbps, args.kernels_source = measured_kernels(args.kernels) if args.kernels else (None, None)
        cluster = Cluster(args.nodes, args.gpus_per_node, args.inter_gbps, args.intra_gbps, args.inter_latency_us,
                          args.intra_latency_us, args.gpu_memory_gib, args.peak_tflops,
                          hbm_gbps=args.hbm_gbps, kernel_gbps=kernel_gbps)  # fmt: skip
        workload = Workload(args.tokens, args.precision, args.optimizer_states, not args.no_activation_checkpointing,
                            args.efficiency, args.overlap)  # fmt: skip
        asked, auto = args.tensor_parallel_size, args.tensor_parallel_size == TENSOR_PARALLEL_AUTO
        sizes = tensor_parallel_sizes(cluster) if auto else [asked]
        by_size, unplanned, verdicts = compare_tensor_parallel(model.units, cluster, workload, sizes, args.margin,
                                                               workload.optimizer_states >= 2, model.width)  # fmt: skip
        choice = choose_tensor_parallel(verdicts, by_size, cluster, args.margin) if auto else verdicts[asked]
    except ValueError as e:  # InputError, or a check deeper down (ZeroPPConfig, costs): one line, no traceback
        parser().error(str(e).replace("\n", " "))
    print(header(args, model, cluster, workload) + "\n")
    for t in sizes:
        if auto:
            print(f"tensor_parallel_size={t}:")
        print(table(by_size[t], tensor_parallel=asked != 1))
        for line in unplanned[t]:
            print(f"not planned: {line}")
        if auto:
            print()
    print(("" if auto else "\n") + verdict_text(choice))
    rows = [r for t in sizes for r in by_size[t]]
    if args.json:
        tp = {"tensor_parallel_size": asked} if asked != 1 else {}
        args.json.write_text(json.dumps({"model": model.description, "cluster": asdict(cluster),
                                         "workload": asdict(workload), "margin": args.margin, **tp,
                                         "rows": [_json(r, asked != 1) for r in rows],
                                         "recommendation": _json(choice, asked != 1),
                                         "not_planned": [f"tensor_parallel_size={t}: {u}" if auto else u
                                                         for t in sizes for u in unplanned[t]]}, indent=2))  # fmt: skip
        print(f"wrote {args.json}")
    if args.plot:
        t = choice.tensor_parallel_size
        title = (f"{model.description} on {cluster.nodes} x {cluster.gpus_per_node} GPUs, {cluster.inter_gbps:g}"
                 f" Gbit/s between nodes, {workload.tokens_per_gpu} tokens per GPU"
                 + (f", tensor parallel {t}" if t > 1 else ""))  # fmt: skip
        configs = {r.config: CONFIGS[r.config] for r in by_size[t]}
        plot(model.units, cluster, workload, args.plot, title, configs, model.width, t)
        print(f"wrote {args.plot}")
    return rows


def _json(item: Row | Verdict, tensor_parallel: bool) -> dict[str, Any]:
    """A row or the verdict as the JSON holds it: without the tensor-parallel fields where none was asked for (the
    file as it was before tensor parallelism was planned)."""
    out = asdict(item)
    return out if tensor_parallel else {k: v for k, v in out.items() if not k.startswith("tensor_parallel")}


if __name__ == "__main__":
    main(sys.argv[1:])
