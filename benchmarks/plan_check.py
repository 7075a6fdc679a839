"""The planner (``python -m lightning_zeropp.planner``) checked against what it predicts.

``--paper``: the paper's end-to-end table (384 V100 GPUs, 24 nodes x 16; 18B-138B GPT models; 1K and 2K tokens per
GPU; 1 or 8 InfiniBand connections of 100 Gbit/s per node; baseline ZeRO-3 and ZeRO++ TFLOP/s per GPU). The planner's
two free parameters, compute efficiency and overlap, are fitted on two of its 16 speedups (``--fit``); the other 14
are predicted. Stated hardware: V100 peak 120 TFLOP/s (the paper's figure), 32 GiB, HBM2 900 GB/s, NVSwitch 150 GB/s
per GPU per direction (1200 Gbit/s), fp16 mixed precision (bytes as bf16-mixed). The models' shapes are not in the
paper's table: each is a GPT of the example's structure with the width below and ``L = P / (12 d^2)`` layers,
vocabulary 50304, 2048 positions.

``--bytes FILE``: the planner's bytes per kind against the ledgers ``benchmarks/comm_volume.py`` measured (the same
example GPT, every configuration and topology there): equal, or the kinds that differ.

    python benchmarks/plan_check.py --paper [--json benchmarks/data/planner/plan_paper.json]
    python benchmarks/plan_check.py --bytes benchmarks/data/bytes_per_step/comm_volume.json
    python benchmarks/plan_check.py --cluster benchmarks/data/slow_link/cluster_plan.json

``--memory [CONFIG ...]``: the planner's memory per rank against the peak resident memory a CPU run adds (the
example GPT at 4 x 1024, 4 ranks as 2 x 2, AdamW, bf16-mixed).

``--cluster FILE``: predicted step times on the emulated two-node cluster (``benchmarks/cluster.py``, which must
have run the configurations on the unshaped link too: that run's step is the configuration's compute) against the
measured ones.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import record  # noqa: E402

# (parameters, width): 12 L d^2 = P gives 40, 60, 72 and 76 layers
MODELS = {"18B": (18e9, 6144), "49B": (49e9, 8192), "91B": (91e9, 10240), "138B": (138e9, 12288)}
# (model, tokens per GPU, IB connections): (baseline TFLOP/s, ZeRO++ TFLOP/s), from the paper's table
PAPER = {
    ("138B", 2048, 1): (19.96, 37.90), ("138B", 2048, 8): (47.55, 55.30),
    ("138B", 1024, 1): (11.25, 21.81), ("138B", 1024, 8): (34.19, 44.38),
    ("91B", 2048, 1): (19.99, 38.06), ("91B", 2048, 8): (47.74, 56.26),
    ("91B", 1024, 1): (11.27, 21.93), ("91B", 1024, 8): (34.49, 44.36),
    ("49B", 2048, 1): (20.06, 38.08), ("49B", 2048, 8): (48.05, 56.24),
    ("49B", 1024, 1): (11.27, 21.95), ("49B", 1024, 8): (34.54, 44.46),
    ("18B", 2048, 1): (25.98, 46.40), ("18B", 2048, 8): (47.31, 53.65),
    ("18B", 1024, 1): (14.15, 30.57), ("18B", 1024, 8): (31.27, 37.87),
}  # fmt: skip
FIT = [("138B", 2048, 1), ("18B", 1024, 8)]


def paper_rows() -> list[dict]:
    """Per table row: FLOPs per GPU and both configurations' communication seconds (which do not depend on the two
    fitted parameters), from the planner's model."""
    from lightning_zeropp.config import ZeroPPConfig
    from lightning_zeropp.costs import gpt_units, kernel_bytes, step_bytes
    from lightning_zeropp.prediction import CONFIGS, Cluster, Workload, collective_seconds, step_flops

    rows = []
    units_of = {name: gpt_units(50304, 2048, round(p / (12 * d * d)), d) for name, (p, d) in MODELS.items()}
    configs = {name: ZeroPPConfig(**CONFIGS[name]) for name in ("zero3", "zeropp")}
    # the bytes depend on the model alone (not on the tokens or the links): once per model
    by_kind = {(m, n): step_bytes(units_of[m], c, 384, 16, 0, "bf16-mixed") for m in MODELS for n, c in configs.items()}
    moved = {(m, n): kernel_bytes(units_of[m], c, 384, 16) for m in MODELS for n, c in configs.items()}
    for (model, tokens, ib), (base, zpp) in PAPER.items():
        cluster = Cluster(24, 16, 100.0 * ib, 1200.0, gpu_memory_gib=32.0, peak_tflops=120.0, hbm_gbps=900.0)
        workload = Workload(tokens, "bf16-mixed")
        comm = {
            name: sum(collective_seconds(k, *v, cluster, config) for k, v in by_kind[model, name].items())
            for name, config in configs.items()
        }
        kernels = {name: moved[model, name] / (cluster.hbm_gbps * 1e9) for name in configs}
        flops = step_flops(units_of[model], workload)
        rows.append(dict(model=model, tokens=tokens, ib=ib, paper_base=base, paper_zeropp=zpp,
                         paper_speedup=zpp / base, flops=flops, comm=comm, kernels=kernels))  # fmt: skip
    return rows


def predict(row: dict, efficiency: float, overlap: float) -> tuple[float, float, float]:
    """``(baseline TFLOP/s, ZeRO++ TFLOP/s, speedup)`` of one row at the two parameters (6PT FLOPs, as the paper
    counts; the compute time has the recomputation's 8PT)."""

    def step(name: str) -> float:
        compute = row["flops"] / (120e12 * efficiency) + row["kernels"][name]
        comm = row["comm"][name]
        return max(compute, comm) + (1 - overlap) * min(compute, comm)

    t0, t1 = step("zero3"), step("zeropp")
    useful = row["flops"] * 6 / 8
    return useful / t0 / 1e12, useful / t1 / 1e12, t0 / t1


def fit(rows: list[dict], keys: list[tuple]) -> tuple[float, float]:
    """The (efficiency, overlap) on a grid that best predicts the speedups of the rows ``keys`` names (least
    squares of the relative errors)."""
    chosen = [r for r in rows if (r["model"], r["tokens"], r["ib"]) in keys]
    grid_e = [i / 200 for i in range(10, 201)]
    grid_o = [i / 100 for i in range(0, 101)]

    def loss(e: float, o: float) -> float:
        return sum((predict(r, e, o)[2] / r["paper_speedup"] - 1) ** 2 for r in chosen)

    return min(itertools.product(grid_e, grid_o), key=lambda eo: loss(*eo))


def check_paper(fit_keys: list[tuple], json_path: Path | None, command: list[str] | None = None) -> None:
    """The paper's table against the planner's predictions; ``command``: the argv ``json_path``'s manifest entry
    records (``record.write``; ``None``: ``sys.argv``)."""
    rows = paper_rows()
    e, o = fit(rows, fit_keys)
    print(f"fitted on {', '.join(f'{m} {t // 1024}K {ib} IB' for m, t, ib in fit_keys)}: efficiency {e:.3f},"
          f" overlap {o:.2f}\n")  # fmt: skip
    print(
        "| model | tokens/GPU | IB | paper baseline -> ZeRO++ TFLOP/s | predicted | paper speedup | predicted |"
        " error | |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    within = 0
    for r in rows:
        b, z, s = predict(r, e, o)
        err = s / r["paper_speedup"] - 1
        fitted = (r["model"], r["tokens"], r["ib"]) in fit_keys
        within += abs(err) <= 0.20 and not fitted
        r.update(predicted_base=b, predicted_zeropp=z, predicted_speedup=s, error=err, fitted=fitted)
        print(f"| {r['model']} | {r['tokens'] // 1024}K | {r['ib']} | {r['paper_base']:.2f} -> {r['paper_zeropp']:.2f}"
              f" | {b:.2f} -> {z:.2f} | {r['paper_speedup']:.2f}x | {s:.2f}x | {err:+.1%} |"
              f" {'fitted' if fitted else ''} |")  # fmt: skip
    print(f"\npredicted within 20%: {within} of {len(rows) - len(fit_keys)} (goal: 14 of 14)")
    if json_path:
        record.write(json_path, {"efficiency": e, "overlap": o, "fit": fit_keys, "rows": rows}, command)
        print(f"wrote {json_path}")


def check_bytes(path: Path) -> int:
    """The planner's bytes per kind (rank 0) against each row of a ``comm_volume.py`` JSON; returns the mismatches."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from comm_volume import CONFIGS, MODEL

    from lightning_zeropp.config import ZeroPPConfig
    from lightning_zeropp.costs import gpt_units, persistent_memory, step_bytes

    units = gpt_units(256, MODEL["block_size"], MODEL["n_layer"], MODEL["n_embd"])
    bad = 0
    for row in json.loads(path.read_text()):
        world, per_node = row["nodes"] * row["ranks_per_node"], row["ranks_per_node"]
        config = ZeroPPConfig(**CONFIGS[row["config"]], ranks_per_node=per_node)
        planned = {k: [v[0], v[1]] for k, v in step_bytes(units, config, world, per_node, 0).items()}
        measured = row["per_kind"]
        memory = persistent_memory(units, config, world, per_node)
        same = planned == measured and (row.get("persistent_memory") in (None, memory))
        bad += not same
        detail = "" if same else f": planned {planned} {memory}, measured {measured} {row.get('persistent_memory')}"
        print(f"{row['nodes']}x{per_node} {row['config']}: {'equal' if same else 'DIFFERENT'}{detail}")
    return bad


PROBE_CLASS = {"all_gather": "weight_all_gather", "reduce_scatter": "gradient_reduce_scatter",
               "all_to_all": "gradient_all_to_all_inter", "all_reduce": "gradient_all_reduce"}  # fmt: skip
"""Each ``benchmarks/link_probe.py`` collective, as the planner's kind that runs it."""


def _probe_class(kind: str) -> str:
    """The probed collective a step's ledger kind runs as (``link_probe.py``'s names)."""
    if kind == "gradient_all_reduce":
        return "all_reduce"
    if kind == "gradient_reduce_scatter":
        return "reduce_scatter"
    return "all_gather" if "all_gather" in kind else "all_to_all"


def _probe_bytes(probe: str, size: int) -> tuple[int, int]:
    """(intra, inter) bytes the ledger counts on one rank for one probe call of ``size`` bytes (2 x 2 ranks)."""
    if probe in ("all_gather", "reduce_scatter"):  # over all 4 ranks: one peer inside the node, two outside
        return size, 2 * size
    return 0, size // 2 if probe == "all_to_all" else size  # a rail's other rank: half the send buffer; the buffer


def fit_link(points: list[list[float]], probe: str) -> tuple[float, float]:
    """(Gbit/s, latency in us) that make the planner's :func:`~lightning_zeropp.prediction.collective_seconds` of
    ``probe`` pass through its two measured points (latency held at 0 if the two points ask for less)."""
    from lightning_zeropp.config import ZeroPPConfig
    from lightning_zeropp.prediction import Cluster, collective_seconds

    kind, config = PROBE_CLASS[probe], ZeroPPConfig(ranks_per_node=2)

    def model(size: int, gbps: float, latency_us: float) -> float:
        cluster = Cluster(2, 2, gbps, gbps, latency_us, latency_us, backend="gloo")
        return collective_seconds(kind, *_probe_bytes(probe, size), 1, cluster, config)

    (s1, t1), (s2, t2) = points
    a1, a2 = model(s1, 8e-9, 0.0), model(s2, 8e-9, 0.0)  # bytes at 1 B/s: the seconds per (1 / rate)
    b = model(s1, 1e9, 1e6) - model(s1, 1e9, 0.0)  # latencies per call, at 1 s each
    inverse_rate = (t2 - t1) / (a2 - a1)
    latency = (t1 - a1 * inverse_rate) / b if b else 0.0
    if latency < 0:  # the small call was relatively faster than a latency allows: rate alone, least squares
        inverse_rate, latency = (a1 * t1 + a2 * t2) / (a1 * a1 + a2 * a2), 0.0
    return 8e-9 / inverse_rate, latency * 1e6


def compute_from_step(step: float, comm: float, overlap: float) -> float:
    """The compute that :func:`~lightning_zeropp.prediction.step_seconds` composes with ``comm`` into ``step`` at
    ``overlap`` (its inverse in the compute; 0 where the step is shorter than the communication alone)."""
    if step >= comm + (1 - overlap) * comm:  # compute >= comm: the step is compute plus the unhidden communication
        return step - (1 - overlap) * comm
    return max(0.0, (step - comm) / (1 - overlap)) if overlap < 1 else min(step, comm)


def cluster_measurements(path: Path, probe_fit: bool = False, latency_us: float = 50.0) -> tuple[list[dict], dict]:
    """What the check composes, from a ``cluster.py`` JSON: per configuration and shaped rate, the measured step, the
    configuration's step on the unshaped link, its collectives predicted there, and a function of the link's
    efficiency (the share of the nominal rate gloo gets across nodes) giving its collectives at the shaped rate.

    The link: across nodes, the nominal rate x efficiency and ``latency_us`` per message; inside a node (loopback)
    and on the unshaped link, what each collective got there alone (``link_probe.py``: timed at two sizes, no
    training, the planner's model of that collective fitted through the two points, :func:`fit_link`).
    ``probe_fit``: across nodes too, each collective's fit at that rate (x efficiency), as a user would feed the
    planner nccl-tests' figures for a real fabric. Returns the rows and the probe's fits."""
    from comm_volume import CONFIGS

    from lightning_zeropp.config import ZeroPPConfig
    from lightning_zeropp.costs import gpt_units, step_bytes
    from lightning_zeropp.prediction import Cluster, collective_seconds

    data = json.loads(path.read_text())
    model = data["meta"]["model"]
    probes = data["meta"].get("link_probe") or {}
    if "unshaped" not in probes:
        raise SystemExit(f"plan_check: {path} has no link probe at the unshaped rate; run cluster.py with --probe-link"
                         " --rates unshaped ...")  # fmt: skip
    fits = {rate: {probe: fit_link(points, probe) for probe, points in by_probe.items()}
            for rate, by_probe in probes.items()}  # fmt: skip
    units = gpt_units(256, model["block_size"], model["n_layer"], model["n_embd"])

    def comm(config: ZeroPPConfig, rate: float | None, efficiency: float = 1.0) -> float:
        inside = fits["unshaped"]
        total = 0.0
        for kind, (intra, inter, calls) in step_bytes(units, config, 4, 2, 0, "bf16-mixed").items():
            probe = _probe_class(kind)
            if rate is not None and not probe_fit:
                gbps, lat = rate / 1e3, latency_us
            else:
                gbps, lat = fits["unshaped" if rate is None else f"{rate:g}"][probe]
            if rate is not None:
                gbps *= efficiency
            cluster = Cluster(2, 2, gbps, inside[probe][0], lat, inside[probe][1], backend="gloo")
            total += collective_seconds(kind, intra, inter, calls, cluster, config)
        return total

    out = []
    for name in dict.fromkeys(r["config"] for r in data["rows"]):
        config = ZeroPPConfig(**CONFIGS[name], ranks_per_node=2)
        rows = {r["rate"]: r for r in data["rows"] if r["config"] == name}
        if None not in rows:
            raise SystemExit(f"plan_check: {path} has no unshaped run of {name} (its compute); run cluster.py with"
                             " --rates unshaped ...")  # fmt: skip
        unshaped_comm = comm(config, None)
        for rate, row in sorted((r, v) for r, v in rows.items() if r is not None):
            out.append(dict(config=name, rate_mbit=rate, measured_s=row["step_s"], unshaped_s=rows[None]["step_s"],
                            unshaped_comm_s=unshaped_comm,
                            comm_at=functools.partial(comm, config, rate)))  # fmt: skip
    return out, fits


def predict_cluster(row: dict, efficiency: float, overlap: float) -> tuple[float, float, float]:
    """``(compute, comm, step)`` seconds of one :func:`cluster_measurements` row: the compute from the unshaped step
    at ``overlap``, the shaped link's collectives at ``efficiency``, composed by the planner's
    :func:`~lightning_zeropp.prediction.step_seconds`."""
    from lightning_zeropp.prediction import step_seconds

    compute = compute_from_step(row["unshaped_s"], row["unshaped_comm_s"], overlap)
    seconds = row["comm_at"](efficiency)
    return compute, seconds, step_seconds(compute, seconds, overlap)


def fit_cluster(rows: list[dict]) -> tuple[float, float]:
    """The (link efficiency, overlap) on a grid that best predicts the step times of ``rows`` (least squares of the
    relative errors): efficiency 0.1-1.5 in steps of 0.005, overlap 0-1 in steps of 0.01. A fit on the
    efficiency grid's edge is refused: the link is outside what the grid can say."""
    grid_e = [i / 200 for i in range(20, 301)]
    grid_o = [i / 100 for i in range(0, 101)]
    comms = {e: [r["comm_at"](e) for r in rows] for e in grid_e}  # the link's part does not depend on the overlap
    from lightning_zeropp.prediction import step_seconds

    def loss(e: float, o: float) -> float:
        total = 0.0
        for r, seconds in zip(rows, comms[e]):
            compute = compute_from_step(r["unshaped_s"], r["unshaped_comm_s"], o)
            total += (step_seconds(compute, seconds, o) / r["measured_s"] - 1) ** 2
        return total

    efficiency, overlap = min(itertools.product(grid_e, grid_o), key=lambda eo: loss(*eo))
    if efficiency in (grid_e[0], grid_e[-1]):
        raise SystemExit(f"plan_check: the link's efficiency fits at the grid's edge ({efficiency:g} of the nominal"
                         " rate): check the link's shaping and the rates in the JSON")  # fmt: skip
    return efficiency, overlap


def _calibration_rows(rows: list[dict], calibrate: str) -> list[dict]:
    """The rows ``calibrate`` names: ``rate:R`` (every configuration at R Mbit/s) or ``config:NAME`` (one
    configuration at every rate)."""
    what, _, value = calibrate.partition(":")
    if what == "rate":
        try:
            chosen = [r for r in rows if r["rate_mbit"] == float(value)]
        except ValueError:
            message = f"plan_check: --calibrate {calibrate!r}: use rate:MBIT with a number, e.g. rate:200"
            raise SystemExit(message) from None
    elif what == "config":
        chosen = [r for r in rows if r["config"] == value]
    else:
        raise SystemExit(f"plan_check: --calibrate {calibrate!r}: use rate:MBIT (e.g. rate:200) or config:NAME"
                         " (e.g. config:zero3)")  # fmt: skip
    if not chosen or len(chosen) == len(rows):
        raise SystemExit(f"plan_check: --calibrate {calibrate!r} names {len(chosen)} of the {len(rows)} rows; it must"
                         " leave some rows to predict and fit on at least one")  # fmt: skip
    return chosen


def check_cluster(
    path: Path,
    overlap: float,
    probe_fit: bool = False,
    latency_us: float = 50.0,
    calibrate: str | None = None,
    calibrate_from: list[Path] | None = None,
) -> list[dict]:
    """Predicted step time on the emulated two-node cluster against ``benchmarks/cluster.py``'s measurements.

    Compute: each configuration's step time on the unshaped link, less its collectives predicted there (composed at
    the overlap). Each shaped rate's step is predicted from that compute and the step's bytes per kind
    (:func:`~lightning_zeropp.costs.step_bytes`, equal to the ledger) at the link's rate, composed with the
    planner's overlap (:func:`cluster_measurements` has the link). ``calibrate``: the link's efficiency and the
    overlap fitted (:func:`fit_cluster`) on the rows it names (``rate:200``, ``config:zero3``), the other rows
    predicted from them; without it, efficiency 1 (the nominal rate) and ``overlap``. ``calibrate_from``: the two
    fitted on every row of other ``cluster.py`` runs and every row of this one predicted from them."""
    rows, fits = cluster_measurements(path, probe_fit, latency_us)
    efficiency, chosen, chosen_count = 1.0, [], 0
    if calibrate and calibrate_from:
        raise SystemExit("plan_check: --calibrate and --calibrate-from: choose one")
    if calibrate:
        chosen = _calibration_rows(rows, calibrate)
        efficiency, overlap = fit_cluster(chosen)
        chosen_count = len(chosen)
    elif calibrate_from:
        other = [r for f in calibrate_from for r in cluster_measurements(f, probe_fit, latency_us)[0]]
        efficiency, overlap = fit_cluster(other)
        calibrate, chosen_count = "every row of " + ", ".join(map(str, calibrate_from)), len(other)
    out = []
    for r in rows:
        compute, seconds, predicted = predict_cluster(r, efficiency, overlap)
        out.append(dict(config=r["config"], rate_mbit=r["rate_mbit"], compute_s=compute, comm_s=seconds,
                        predicted_s=predicted, measured_s=r["measured_s"], error=predicted / r["measured_s"] - 1,
                        fitted=r in chosen))  # fmt: skip
    print("| rate | " + " | ".join(f"{p} Mbit/s, us" for p in PROBE_CLASS) + " |")
    print("|---|" + "---|" * len(PROBE_CLASS))
    for rate, by_probe in fits.items():
        cells = " | ".join(f"{by_probe[p][0] * 1e3:.1f}, {by_probe[p][1]:.0f}" if p in by_probe else "n/a"
                           for p in PROBE_CLASS)  # fmt: skip
        print(f"| {rate} | {cells} |")
    print()
    if calibrate:
        print(f"fitted on {calibrate} ({chosen_count} rows): link efficiency {efficiency:.3f}, overlap {overlap:.2f}\n")
    print("| link | config | compute s (unshaped run) | predicted comm s | predicted step s | measured step s"
          " | error | |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in out:
        print(f"| {r['rate_mbit']:g} Mbit/s | {r['config']} | {r['compute_s']:.3f} | {r['comm_s']:.3f} |"
              f" {r['predicted_s']:.3f} | {r['measured_s']:.3f} | {r['error']:+.1%} |"
              f" {'fitted' if r['fitted'] else ''} |")  # fmt: skip
    within = sum(abs(r["error"]) <= 0.15 for r in out)
    held_out = [r for r in out if not r["fitted"]]
    link = "the probe's fitted rates" if probe_fit else "nominal rates"
    print(f"\nwithin 15%: {within} of {len(out)} (overlap {overlap:g}, {link} x {efficiency:.3f})")
    if calibrate:
        print(f"predicted (not fitted) within 15%: {sum(abs(r['error']) <= 0.15 for r in held_out)} of"
              f" {len(held_out)}")  # fmt: skip
    return out


MEMORY_MODEL = dict(block_size=64, n_layer=4, n_embd=1024)  # 50M parameters: the state outweighs the runtime's noise


def _memory_rank(rank: int, world: int, per_node: int, name: str, steps: int) -> dict:
    """One rank of a CPU run: the example GPT built on the meta device, ``steps`` AdamW steps in bf16-mixed, one
    sequence of 64 tokens; its resident memory before the model exists and at its peak (bytes)."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    import torch
    from comm_volume import CONFIGS
    from lightning.pytorch import Trainer
    from model import GPTModule
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_zeropp import ZeroPPStrategy
    from lightning_zeropp.testing.memory import peak_rss

    strategy = ZeroPPStrategy(ranks_per_node=per_node, **CONFIGS[name])
    trainer = Trainer(accelerator="cpu", devices=world, strategy=strategy, precision="bf16-mixed", max_steps=steps,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=0, num_sanity_val_steps=0, use_distributed_sampler=False)  # fmt: skip
    tokens = torch.randint(0, 256, (1, MEMORY_MODEL["block_size"] + 1))
    baseline = peak_rss()
    with trainer.init_module(empty_init=True):
        module = GPTModule(n_head=MEMORY_MODEL["n_embd"] // 128, **MEMORY_MODEL)
        module.configure_model()
    trainer.fit(module, DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=1))
    return {"baseline": baseline, "peak": peak_rss(), "persistent": strategy.persistent_memory}


def check_memory(configs: list[str], steps: int) -> list[dict]:
    """The planner's memory per rank against the peak resident memory a CPU run adds (4 ranks as 2 x 2). glibc is
    told to give every freed block of 64 KiB or more back at once, so the peak follows what is allocated, not what the
    allocator keeps."""
    from lightning_zeropp.config import ZeroPPConfig
    from lightning_zeropp.costs import gpt_units
    from lightning_zeropp.prediction import Cluster, Workload, memory_parts
    from lightning_zeropp.spawn import run_local_ranks

    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # read when the rank processes start
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", "0")
    units = gpt_units(256, MEMORY_MODEL["block_size"], MEMORY_MODEL["n_layer"], MEMORY_MODEL["n_embd"])
    cluster = Cluster(2, 2, 1.0, 1.0)
    workload = Workload(MEMORY_MODEL["block_size"], "bf16-mixed", 2, activation_checkpointing=False)
    out = []
    for name in configs:
        from comm_volume import CONFIGS

        config = ZeroPPConfig(**CONFIGS[name], ranks_per_node=2)
        parts = memory_parts(units, config, cluster, workload, MEMORY_MODEL["n_embd"])
        results = run_local_ranks(_memory_rank, 4, 2, name, steps, sys_path=[str(ROOT / "examples" / "gpt"),
                                  str(ROOT / "benchmarks")], timeout=1200)  # fmt: skip
        measured = [r["peak"] - r["baseline"] for r in results]
        planned = sum(parts.values())
        out.append(dict(config=name, planned=planned, parts=parts, measured=measured,
                        errors=[planned / m - 1 for m in measured]))  # fmt: skip
        shown = ", ".join(f"{k} {v / 1e6:.0f}" for k, v in parts.items() if v)
        print(f"{name}: planned {planned / 1e6:.0f} MB ({shown}); measured peak - baseline per rank"
              f" {', '.join(f'{m / 1e6:.0f}' for m in measured)} MB; errors"
              f" {', '.join(f'{e:+.1%}' for e in out[-1]['errors'])}")  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--paper", action="store_true", help="the paper's 16 speedups")
    parser.add_argument("--fit", nargs="+", default=[f"{m}:{t}:{ib}" for m, t, ib in FIT],
                        help="the rows to fit on, MODEL:TOKENS:IB (default: %(default)s)")  # fmt: skip
    parser.add_argument("--bytes", type=Path, default=None, help="a comm_volume.py JSON to check the bytes against")
    parser.add_argument("--cluster", type=Path, default=None, help="a cluster.py JSON with an unshaped rate")
    parser.add_argument("--overlap", type=float, default=None, help="default: the planner's (the paper fit's)")
    parser.add_argument("--probe-fit", action="store_true", help="the link probe's fits across nodes, not the nominal")
    parser.add_argument("--latency-us", type=float, default=50.0, help="per message across nodes (nominal link)")
    parser.add_argument("--calibrate", default=None,
                        help="fit the link's efficiency and the overlap on these rows (rate:200, config:zero3) and"
                             " predict the others")  # fmt: skip
    parser.add_argument("--calibrate-from", type=Path, nargs="+", default=None,
                        help="fit the efficiency and the overlap on every row of other cluster.py runs")  # fmt: skip
    parser.add_argument("--memory", nargs="*", default=None, help="configurations for the memory check (CPU runs)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    command = None if argv is None else [__file__, *argv]  # the manifest's (record.write; None: sys.argv)
    if args.memory is not None:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        rows = check_memory(args.memory or ["zero3", "zeropp", "hsdp"], steps=2)
        if args.json:
            record.write(args.json, rows, command)
        return
    if args.bytes:
        sys.exit(1 if check_bytes(args.bytes) else 0)
    if args.cluster:
        from lightning_zeropp.prediction import OVERLAP

        sys.path.insert(0, str(ROOT / "benchmarks"))
        overlap = OVERLAP if args.overlap is None else args.overlap
        rows = check_cluster(args.cluster, overlap, args.probe_fit, args.latency_us, args.calibrate,
                             args.calibrate_from)  # fmt: skip
        if args.json:
            record.write(args.json, rows, command)
        return
    keys = [(m, int(t), int(ib)) for m, t, ib in (k.split(":") for k in args.fit)]
    check_paper(keys, args.json, command)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
