"""The planner's verdict: which configuration of :data:`~lightning_zeropp.prediction.CONFIGS` to use, from
:func:`~lightning_zeropp.prediction.predict`'s rows, and why: memory first, then a step more than :data:`MARGIN`
shorter, nothing lossy on one node; every faster row that lost, with its reason; the Python, the LightningCLI YAML and
the launch lines that select it. With tensor parallelism, the same rule across the sizes that divide a node
(:func:`compare_tensor_parallel`, :func:`choose_tensor_parallel`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

from .commplan import resolve
from .config import ZeroPPConfig
from .costs import Unit
from .prediction import CONFIGS, Cluster, Row, Workload, predict
from .topology import Topology

LONG_RUN = "zeropp+qgz8"
"""The setting for long runs where the last fraction of a percent of loss matters and the optimizer is not
Adam-family (qgZ's inter-node hop in INT8, which removes most of the late loss gap of ZeRO++ without the second-moment
correction: docs/accuracy.md). It sends more than the defaults, so the verdict never picks it for speed; when the
verdict is ZeRO++, the planner says what it would cost instead."""

MARGIN = 0.10
"""How much shorter a configuration's predicted step must be than the current choice's (a fraction of the step)
before the verdict moves to it (``--margin``). :data:`CONFIGS` are in the order of what each costs beyond the one
before: HSDP memory (a node holds the whole state), quantized HSDP accuracy (its gradients cross nodes quantized),
ZeRO++ accuracy (its weights cross nodes quantized too; sharded over every rank again, it holds less than HSDP),
error feedback and weight deltas memory (and deltas' forward weights trail the exact ones by their INT4 rounding);
a predicted gain inside the time model's own error buys nothing for that."""

LABELS = {
    "zero3": "ZeRO-3 (FSDP2 full sharding; exact)",
    "hsdp": "HSDP (sharded inside each node, replicated across nodes; exact)",
    "qhsdp": "quantized HSDP (HSDP, its gradients all-reduced across nodes as INT4 then INT8; lossy)",
    "zeropp": "ZeRO++ (INT8 weights, hpZ, INT4 gradients across nodes; lossy)",
    "zeropp+ef": "ZeRO++ with gradient error feedback (lossy)",
    "zeropp+deltas": "ZeRO++ with INT4 weight deltas (lossy)",
    "zeropp+qgz8": "ZeRO++ with INT8 gradients across nodes (lossy; the long-run setting)",
}
"""What each of :data:`CONFIGS` is, in the verdict's words."""


@dataclass
class Verdict:
    """The configuration to use and why; ``config`` is ``None`` when none fits."""

    config: str | None
    label: str
    reason: str
    speedup: float
    margin: float
    passed_over: list[str]
    python: str = ""
    alias: str | None = None
    yaml: str = ""
    long_run: str = ""
    launch: tuple[str, ...] = ()
    tensor_parallel_size: int = 1
    tensor_parallel: str = ""
    """Why this tensor-parallel size, where the planner compared them (:func:`choose_tensor_parallel`)."""
    tensor_parallel_passed_over: list[str] = field(default_factory=list)


def lossy(name: str) -> bool:
    """Whether a configuration of :data:`CONFIGS` sends anything quantized (qwZ, qgZ, quantized HSDP or weight
    deltas) where its techniques are on: its plan on two nodes of two ranks."""
    config = ZeroPPConfig(**CONFIGS[name])
    ranks_per_node, hpz = config.resolve(4, 2)
    plan = resolve(config, Topology(4, ranks_per_node, 0, hpz))
    return plan.forward.kind != "exact" or plan.quantizes_gradients_at(0)


def verdict(rows: list[Row], cluster: Cluster, margin: float = MARGIN, adam: bool = True) -> Verdict:
    """The configuration to use, from :func:`predict`'s rows (in :data:`CONFIGS` order, the first ZeRO-3); ``adam``: the
    optimizer keeps Adam's two states (what the long-run advice depends on).

    Starting from the first that fits, each later one replaces the choice only if it fits and its step is more than
    ``margin`` shorter than the choice's (:data:`MARGIN`). On one node nothing crosses nodes, so nothing lossy is
    chosen: ZeRO++ would save no link time there and only add quantization error. Every row faster than the choice
    is listed with the reason it lost. The rows' tensor-parallel size (one for all) goes into the code it prints."""
    t = rows[0].tensor_parallel_size if rows else 1
    one_node = cluster.nodes == 1
    choice = None
    for row in rows:
        if row.fits and not (one_node and lossy(row.config)):
            if choice is None or choice.step_s > row.step_s * (1 + margin):
                choice = row
    if choice is None:
        need = min(r.memory_gib["total"] for r in rows)
        return Verdict(None, "nothing fits", f"the smallest needs {need:.1f} GiB per GPU of {cluster.gpu_memory_gib:g}:"
                       " more GPUs, fewer --tokens per GPU, activation checkpointing, or CPU offload"
                       " (cpu_offload=True, which the planner does not model)", 0.0, margin, [],
                       tensor_parallel_size=t)  # fmt: skip
    passed_over = []
    for row in rows:
        if row.step_s >= choice.step_s:
            continue
        faster = f"{row.config} is {choice.step_s / row.step_s - 1:.0%} faster,"
        if not row.fits:
            why = f"but needs {row.memory_gib['total']:.1f} GiB per GPU of {cluster.gpu_memory_gib:g}"
        elif one_node and lossy(row.config):
            why = "but lossy, and on one node there is no cross-node traffic for it to cut"
        else:
            lossier = lossy(row.config) and not lossy(choice.config)
            why = f"within the {margin:.0%} margin" + (", and lossy" if lossier else "")
        passed_over.append(f"{faster} {why}")
    bound = "communication" if choice.comm_s > choice.compute_s else "compute"
    if choice is rows[0]:
        reason = ["one node: nothing crosses nodes, so ZeRO++ would only add quantization error" if one_node else
                  f"nothing else that fits is more than {margin:.0%} faster"]  # fmt: skip
    else:
        reason = [f"{choice.speedup:.2f}x ZeRO-3's predicted step"]
        best = min((r for r in rows if r.fits and not lossy(r.config)), key=lambda r: r.step_s, default=None)
        if lossy(choice.config) and best is not None and best is not rows[0]:
            reason[0] += f" ({best.step_s / choice.step_s:.2f}x {best.config}'s, the fastest exact one)"
    reason += [f"{bound}-bound (compute {choice.compute_s:.3g} s, communication {choice.comm_s:.3g} s)",
               f"{choice.memory_gib['total']:.1f} of {cluster.gpu_memory_gib:g} GiB per GPU"]  # fmt: skip
    if t > 1:
        reason.append(f"tensor parallel {t}: {choice.tensor_parallel_gb:.3g} GB of activation all-reduces per GPU per"
                      f" step inside the node, {choice.tensor_parallel_s:.3g} s on the compute's path")  # fmt: skip
    if lossy(choice.config):
        reason.append("lossy: compare its loss curve with zero3's early in a run (docs/accuracy.md)")
    python, alias, yaml = strategy_code(choice.config, cluster, t)
    advice = long_run_advice(rows, choice, cluster.gpu_memory_gib, adam)
    name = label(choice.config, t, cluster.gpus_per_node)
    return Verdict(choice.config, name, "; ".join(reason), choice.speedup, margin, passed_over,
                   python, alias, yaml, advice, launch_lines(cluster), t)  # fmt: skip


def label(name: str, tensor_parallel_size: int = 1, gpus_per_node: int = 0) -> str:
    """What configuration ``name`` is (:data:`LABELS`), with tensor parallelism where ``tensor_parallel_size`` > 1
    (hpZ is off where it fills the node's ``gpus_per_node``: one data-parallel rank per node)."""
    words = LABELS.get(name, name)
    if tensor_parallel_size == 1:
        return words
    if tensor_parallel_size == gpus_per_node:
        words = words.replace("hpZ, ", "")
    return words + f", with tensor parallelism {tensor_parallel_size} inside each node"


def plannable(cluster: Cluster, tensor_parallel_size: int = 1) -> tuple[dict[str, dict], list[str]]:
    """The :data:`CONFIGS` the strategy runs on ``cluster`` with ``tensor_parallel_size``, and ``"name: why"`` for
    each it refuses (weight deltas need hpZ, which needs 2 or more GPUs per node; HSDP and weight deltas do not
    combine with tensor parallelism yet)."""
    configs, unplanned = {}, []
    extra = {"tensor_parallel_size": tensor_parallel_size} if tensor_parallel_size > 1 else {}
    for name, kwargs in CONFIGS.items():
        try:
            ZeroPPConfig(**kwargs, **extra).resolve(cluster.world, cluster.gpus_per_node)
            configs[name] = kwargs
        except ValueError as e:
            unplanned.append(f"{name}: {e}")
    return configs, unplanned


def compare_tensor_parallel(
    units: list[Unit],
    cluster: Cluster,
    workload: Workload,
    sizes: list[int],
    margin: float = MARGIN,
    adam: bool = True,
    n_embd: int = 0,
) -> tuple[dict[int, list[Row]], dict[int, list[str]], dict[int, Verdict]]:
    """Per tensor-parallel size of ``sizes``: the rows of what the strategy runs with it (:func:`plannable`), what it
    refuses, and the verdict among them."""
    rows, unplanned, verdicts = {}, {}, {}
    for t in sizes:
        configs, unplanned[t] = plannable(cluster, t)
        rows[t] = predict(units, cluster, workload, configs, n_embd=n_embd, tensor_parallel_size=t)
        verdicts[t] = verdict(rows[t], cluster, margin, adam)
    return rows, unplanned, verdicts


def choose_tensor_parallel(
    verdicts: dict[int, Verdict], rows: dict[int, list[Row]], cluster: Cluster, margin: float = MARGIN
) -> Verdict:
    """The tensor-parallel size to use, from each size's verdict (:func:`compare_tensor_parallel`), by the verdict's
    own rule: memory first, then time. From the smallest size whose choice fits, a larger one replaces it only if its
    choice fits and its step is more than ``margin`` shorter (a tensor-parallel plan is work on the model, and the time
    model leaves out what splitting the matrix multiplies costs). The result is that size's verdict, with why, and every
    faster size that lost."""

    def chosen(t: int) -> Row:
        return next(r for r in rows[t] if r.config == verdicts[t].config)

    choice = None
    for t in sorted(verdicts):
        if verdicts[t].config is None:
            continue
        if choice is None or chosen(choice).step_s > chosen(t).step_s * (1 + margin):
            choice = t
    caveat = "a static model: the split matrix multiplies' efficiency is not in it, so time a step at both sizes"
    if choice is None:
        need, t = min((r.memory_gib["total"], t) for t in rows for r in rows[t])
        why = f"nothing fits at any size; the smallest, with tensor_parallel_size={t}, needs {need:.1f} GiB per GPU"
        return replace(verdicts[t], tensor_parallel=why)
    row, passed_over = chosen(choice), []
    for t in sorted(verdicts):
        if t == choice:
            continue
        if verdicts[t].config is None:
            fastest = min(rows[t], key=lambda r: r.step_s)
            if fastest.step_s < row.step_s:
                need = min(r.memory_gib["total"] for r in rows[t])
                passed_over.append(f"t = {t} ({fastest.config}) would be {row.step_s / fastest.step_s - 1:.0%} faster,"
                                   f" but nothing fits: the smallest needs {need:.1f} GiB per GPU of"
                                   f" {cluster.gpu_memory_gib:g}")  # fmt: skip
        elif chosen(t).step_s < row.step_s:
            passed_over.append(f"t = {t} ({verdicts[t].config}) is {row.step_s / chosen(t).step_s - 1:.0%} faster,"
                               f" within the {margin:.0%} margin")  # fmt: skip
    base = verdicts.get(1)
    if choice == 1:
        why = (f"don't use it (t = 1): no tensor-parallel size that fits is more than {margin:.0%} faster" if
               len(verdicts) > 1 else "t = 1: one GPU per node, nothing to split")  # fmt: skip
    elif base is None or base.config is None:
        need = min(r.memory_gib["total"] for r in rows[1]) if 1 in rows else None
        why = f"t = {choice}: nothing fits without tensor parallelism" + (
            f" (t = 1 needs {need:.1f} GiB per GPU of {cluster.gpu_memory_gib:g})" if need is not None else ""
        )
        why += f"; predicted step {row.step_s:.3g} s ({verdicts[choice].config})"
    else:
        one = chosen(1)
        why = (f"t = {choice}: predicted step {row.step_s:.3g} s, {one.step_s / row.step_s:.2f}x t = 1's"
               f" ({base.config}, {one.step_s:.3g} s); cross-node GB per GPU {one.inter_node_gb:.3g} ->"
               f" {row.inter_node_gb:.3g}")  # fmt: skip
    return replace(verdicts[choice], tensor_parallel=f"{why}; {caveat}", tensor_parallel_passed_over=passed_over)


def launch_lines(cluster: Cluster) -> tuple[str, ...]:
    """How the job starts on ``cluster``: under SLURM (one task per GPU; the strategy reads SLURM's variables), or
    with torchrun on each node (the torchrun-style variables)."""
    nodes, gpus = cluster.nodes, cluster.gpus_per_node
    return (
        f"SLURM: srun --nodes {nodes} --ntasks-per-node {gpus} --gpus-per-node {gpus} python train.py",
        f"torchrun, on each node: torchrun --nnodes {nodes} --nproc-per-node {gpus} --node-rank <0..{nodes - 1}>"
        " --master-addr <node 0> --master-port 29500 train.py",
    )


def long_run_advice(rows: list[Row], choice: Row, gpu_memory_gib: float, adam: bool = True) -> str:
    """For a ZeRO++ verdict (the defaults, or with feedback or weight deltas), for runs where the last fraction of a
    percent of loss matters: with an Adam-family optimizer (``adam``), that the defaults already take qgZ's noise out
    of its second moment (nothing to add, nothing to predict); with another, what adding ``gradient_bits=8``
    (:data:`LONG_RUN`) would cost. "" for other verdicts, or where either row was not planned. ``gradient_bits=8``
    changes only the inter-node gradient hop, so its cost is the difference between the ``zeropp+qgz8`` and
    ``zeropp`` rows, added to the choice's."""
    by_name = {r.config: r for r in rows}
    long_run, base = by_name.get(LONG_RUN), by_name.get("zeropp")
    if long_run is None or base is None or choice is long_run or not choice.config.startswith("zeropp"):
        return ""
    if choice.inter_node_gb <= 0:  # nothing crosses nodes: nothing for it to change
        return ""
    if adam:
        return (
            "the defaults take qgZ's rounding noise out of Adam's second moment (second_moment_correction='auto'),"
            " which keeps the loss gap from growing with training, at no byte more: nothing to add (docs/accuracy.md)"
        )
    extra_s, extra_gb = long_run.step_s - base.step_s, long_run.inter_node_gb - base.inter_node_gb
    memory = choice.memory_gib["total"] + long_run.memory_gib["total"] - base.memory_gib["total"]
    words = (
        "if the last fraction of a percent of loss matters, add gradient_bits=8 (INT8 gradients across nodes; with an"
        " optimizer without Adam's second moment the defaults cannot correct qgZ's noise, docs/accuracy.md):"
        f" predicted step {extra_s / choice.step_s:+.0%} ({choice.step_s + extra_s:.3g} s),"
        f" cross-node bytes {(choice.inter_node_gb + extra_gb) / choice.inter_node_gb:.2f}x"
    )
    if memory > gpu_memory_gib:
        words += f"; but it needs {memory:.1f} GiB per GPU of {gpu_memory_gib:g}"
    return words


def strategy_code(name: str, cluster: Cluster, tensor_parallel_size: int = 1) -> tuple[str, str | None, str]:
    """The Python and the LightningCLI YAML that select configuration ``name`` of :data:`CONFIGS` on ``cluster``
    (with ``tensor_parallel_size``), and its registered short name (``strategy="zero3"``), if it has one."""
    from lightning.pytorch.strategies import StrategyRegistry

    from .strategy import ZeroPPStrategy

    kwargs = CONFIGS[name] | ({"tensor_parallel_size": tensor_parallel_size} if tensor_parallel_size > 1 else {})
    aliases = [k for k, v in StrategyRegistry.items() if v["strategy"] is ZeroPPStrategy and v["init_params"] == kwargs]
    arguments = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    python = (f"Trainer(num_nodes={cluster.nodes}, devices={cluster.gpus_per_node},"
              f" strategy=ZeroPPStrategy({arguments}))")  # fmt: skip
    yaml = [
        "trainer:",
        f"  num_nodes: {cluster.nodes}",
        f"  devices: {cluster.gpus_per_node}",
        "  strategy:",
        "    class_path: lightning_zeropp.ZeroPPStrategy",
    ]
    if kwargs:  # JSON's scalars are YAML's: true/false, numbers, quoted strings
        yaml += ["    init_args:", *(f"      {k}: {json.dumps(v)}" for k, v in kwargs.items())]
    return python, (aliases[0] if aliases else None), "\n".join(yaml)


def verdict_text(v: Verdict) -> str:
    """The verdict as the CLI prints it: the choice and why, what lost and why, the code that selects it."""
    if v.config is None:
        line = f"verdict: {v.label}: {v.reason}"
        return line + (f"\n  tensor parallel: {v.tensor_parallel}" if v.tensor_parallel else "")
    verb = "stay on" if v.config == next(iter(CONFIGS)) and v.tensor_parallel_size == 1 else "use"
    lines = [f"verdict: {verb} {v.label} [{v.config}]", f"  why: {v.reason}"]
    lines += [f"  not chosen: {p}" for p in v.passed_over]
    if v.tensor_parallel:
        lines.append(f"  tensor parallel: {v.tensor_parallel}")
        lines += [f"  not chosen: {p}" for p in v.tensor_parallel_passed_over]
    if v.long_run:
        lines.append(f"  long runs: {v.long_run}")
    lines += ["  python: from lightning_zeropp import ZeroPPStrategy", f"          {v.python}"]
    if v.tensor_parallel_size > 1:
        lines.append("          # configure_model: parallelize_module(..., self.device_mesh['tensor_parallel'], plan),"
                     " then fully_shard(..., mesh=self.device_mesh['data_parallel'])")  # fmt: skip
    if v.alias:
        lines.append(f'          # the same: strategy="{v.alias}", a name lightning_zeropp registers when imported')
    lines += ["  LightningCLI YAML:", *(f"    {line}" for line in v.yaml.splitlines())]
    if v.launch:
        lines += ["  launch:", *(f"    {line}" for line in v.launch)]
    return "\n".join(lines)
