"""End-to-end step time of ZeRO-3, HSDP and each ZeRO++ technique on a real (emulated) slow link between two nodes.

Two network namespaces on this machine are the nodes; one veth pair shaped with ``tc`` is the only link between
them; loopback inside each namespace is the fast intra-node fabric (``benchmarks/netns.py``). Each node runs the
example exactly as a multi-node job does: ``python examples/gpt/train.py fit`` once per node with ``NODE_RANK``,
``MASTER_ADDR`` (node 0's veth address), ``MASTER_PORT`` and ``GLOO_SOCKET_IFNAME`` (the node's veth end);
Lightning's launcher starts the node's 2 local ranks (``num_nodes=2``, ``devices=2``). The training code does not
know it is emulated; a ``StepProbe`` callback (``benchmarks/step_probe.py``) records per-step timestamps, losses,
the ledger's totals and, on each node's first rank, the veth's byte counters.

Steady state: the first ``--warmup`` steps are dropped; a repeat's step time is the median of its remaining steps'
durations on rank 0; link bytes per step are node 0's veth counters over the window from the end of the warm-up to
the last step, divided by its steps. Configurations run interleaved (one of each, then the next repeat) so a change
in the machine's load hits all of them alike.

Step times on this testbed move by 10-20% between runs of the same code, so one run decides nothing. A configuration's
step time is the median over its repeats, with the interval from the smallest to the largest repeat (for the median
of the repeats' distribution it covers 1 - 2**(1 - R): 75% at 3 repeats, 94% at 5). A speedup is paired: repeat r of
a configuration against repeat r of ZeRO-3, run in the same round, so the load both saw is alike; its median and
interval are those of the R paired ratios. Two configurations differ when their intervals do not overlap. Needs root.

    sudo python benchmarks/cluster.py [--rates 50 200 1000 unshaped] [--repeats 3] \\
        [--json benchmarks/data/slow_link/cluster.json]

With ``--json`` a figure of the table (step time and speedup per configuration and link rate) goes beside it
(``--png``; again from the JSON alone:
``python benchmarks/plots.py cluster benchmarks/data/slow_link/cluster.json out.png``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

import record  # noqa: E402
from comm_volume import CONFIGS as ZEROPP_CONFIGS  # noqa: E402
from netns import TwoNodeCluster, exit_on_signals, missing_requirements  # noqa: E402
from plots import cluster_png, try_plot  # noqa: E402

FSDP_BASELINE = "fsdp"  # Lightning's ModelParallelStrategy, fully_shard per block (benchmarks/fsdp_baseline.py)
# The long-run accuracy candidates (benchmarks/convergence.py's zeropp+rot, zeropp+sr, zeropp+ef1, zeropp-qgz8,
# zeropp+smc) and ZeRO++ without the second-moment correction: their step time beside the defaults'. Not
# comm_volume.py's rows: rotation, rounding and the second-moment correction send the defaults' bytes, kind by kind;
# the INT8 hop sends twice the defaults' cross-node gradient bytes.
CANDIDATES = {
    "zeropp_rot": dict(gradient_rotation="hadamard"),
    "zeropp_sr": dict(gradient_rounding="stochastic"),
    "zeropp_qgz8": dict(gradient_bits=8),  # the inter-node gradient hop in INT8: 1.195x the defaults' cross-node bytes
    "zeropp_smc": dict(second_moment_correction=True),  # what "auto" (the default) does here; the same bytes
    "zeropp_nosmc": dict(second_moment_correction=False),  # ZeRO++ without the correction (the defaults before it)
}
STRATEGIES = {**ZEROPP_CONFIGS, **CANDIDATES}
CONFIG_NAMES = (*STRATEGIES, FSDP_BASELINE)  # hsdp among them: the baseline users would pick instead
NODES, DEVICES = 2, 2
# A communication-bound setting: the demo's model (3.26M parameters, ~6.5 MB in bf16) and a micro-batch small
# enough that on 2 shared CPU cores the step is dominated by moving weights and gradients between the nodes.
MODEL = dict(block_size=64, n_layer=4, n_head=4, n_embd=256, warmup_steps=2)
BATCH_SIZE = 1
_ENV_DROP = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR",
             "MASTER_PORT", "GLOO_SOCKET_IFNAME")  # fmt: skip


def run_config(name: str, probe_dir: Path, interface: str, steps: int, model: dict, batch_size: int) -> dict:
    """The LightningCLI config of one run (the same file on both nodes; the interface differs by env only)."""
    if name == FSDP_BASELINE:
        strategy = {
            "class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
            "init_args": {"data_parallel_size": NODES * DEVICES, "tensor_parallel_size": 1},
        }
    else:
        strategy = {
            "class_path": "lightning_zeropp.ZeroPPStrategy",
            "init_args": dict(STRATEGIES[name]),
        }
    return {
        "seed_everything": 1234,
        "trainer": {
            "accelerator": "cpu",
            "devices": DEVICES,
            "num_nodes": NODES,
            "strategy": strategy,
            "precision": "bf16-mixed",
            "max_steps": steps,
            "limit_val_batches": 0,
            "num_sanity_val_steps": 0,
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "callbacks": [
                {"class_path": "step_probe.StepProbe", "init_args": {"out_dir": str(probe_dir), "interface": interface}}
            ],
        },
        "model": dict(model),
        "data": {"batch_size": batch_size, "max_bytes": 2_000_000},
    }


def node_env(cluster: TwoNodeCluster, node: int, port: int) -> dict[str, str]:
    """What a multi-node launcher sets, and nothing that would make Lightning think of SLURM or torchelastic."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "PL_")) and
           k not in _ENV_DROP}  # fmt: skip
    env.update(
        NODE_RANK=str(node),
        MASTER_ADDR=cluster.addresses[0],
        MASTER_PORT=str(port),
        GLOO_SOCKET_IFNAME=cluster.interfaces[node],
        OMP_NUM_THREADS="1",  # 4 ranks on a few cores: one thread each, as Lightning would pick
        PYTHONPATH=os.pathsep.join([str(ROOT), str(BENCH), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        PYTHONUNBUFFERED="1",
    )
    return env


def launch(
    cluster: TwoNodeCluster, name: str, workdir: Path, port: int, steps: int, model: dict, batch_size: int,
    timeout: float = 900,
) -> list[list[dict]]:  # fmt: skip
    """Runs one training job across the two nodes; returns each global rank's probe rows. Raises with the logs."""
    workdir.mkdir(parents=True, exist_ok=True)
    probe_dir = workdir / "probe"
    entry = BENCH / "fsdp_baseline.py" if name == FSDP_BASELINE else ROOT / "examples" / "gpt" / "train.py"
    procs, logs = [], []
    for node in range(NODES):
        config = workdir / f"node{node}.yaml"
        config.write_text(yaml.safe_dump(run_config(name, probe_dir, cluster.interfaces[node], steps, model,
                                                    batch_size)))  # fmt: skip
        log = workdir / f"node{node}.log"
        logs.append(log)
        with log.open("w") as out:
            cmd = [sys.executable, str(entry), "fit", "--config", str(config)]
            procs.append(cluster.popen(node, cmd, node_env(cluster, node, port), cwd=workdir, stdout=out,
                                       stderr=subprocess.STDOUT))  # fmt: skip
    deadline = time.monotonic() + timeout
    failed = None
    while any(p.poll() is None for p in procs) and failed is None:
        if time.monotonic() > deadline:
            failed = f"still running after {timeout:.0f}s"
        failed = failed or next((f"node {i} exited with {p.returncode}" for i, p in enumerate(procs) if p.poll()), None)
        time.sleep(0.2)
    failed = failed or next((f"node {i} exited with {p.returncode}" for i, p in enumerate(procs) if p.returncode), None)
    if failed:
        cluster.close_processes()
        tails = "\n".join(f"--- {log}\n" + "\n".join(log.read_text().splitlines()[-30:]) for log in logs)
        raise RuntimeError(f"cluster run {name!r}: {failed}\n{tails}")
    ranks = sorted(probe_dir.glob("rank*.jsonl"), key=lambda p: int(p.stem[4:]))
    return [[json.loads(line) for line in p.read_text().splitlines()] for p in ranks]


def probe_link(cluster: TwoNodeCluster, port: int, timeout: float = 300) -> dict:
    """Seconds per call of each collective the step runs across nodes, alone on the link, at two sizes
    (``benchmarks/link_probe.py``; the training's layout: 2 ranks per node)."""
    procs = []
    for node in range(NODES):
        for local in range(DEVICES):
            env = dict(node_env(cluster, node, port), RANK=str(node * DEVICES + local), WORLD_SIZE=str(NODES * DEVICES))
            procs.append(cluster.popen(node, [sys.executable, str(BENCH / "link_probe.py")], env,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))  # fmt: skip
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("link probe failed:\n" + "\n".join(outs))
    return json.loads(outs[0].strip().splitlines()[-1])


def _per_step(warmup: int):
    def per_step(rows: list[dict], key: str) -> float | None:
        """A counter's growth per step from the end of the warm-up to the last step (``None``: not recorded)."""
        return (rows[-1][key] - rows[warmup][key]) / (len(rows) - 1 - warmup) if key in rows[-1] else None

    return per_step


def _kind_per_step(rows: list[dict], kind: str, warmup: int) -> float:
    def inter(row: dict) -> int:
        return row["ledger_by_kind"].get(kind, [0, 0])[1]

    return (inter(rows[-1]) - inter(rows[warmup])) / (len(rows) - 1 - warmup)


def summarize(name: str, runs: list[list[list[dict]]], warmup: int, tokens_per_step: int) -> dict:
    """Steady-state figures of one configuration over its repeats (see the module docstring)."""
    durations, repeats, ledger_inter, ledger_intra, tx, rx, losses = [], [], [], [], [], [], []
    by_kind: dict[str, list[float]] = {}
    for ranks in runs:
        rank0 = ranks[0]
        times = [r["time"] for r in rank0]  # row k: end of step k (row 0: start of training)
        steps = [b - a for a, b in zip(times[warmup:-1], times[warmup + 1 :], strict=True)]
        durations += steps
        repeats.append(statistics.median(steps))
        per_step = _per_step(warmup)

        node0 = [rows for rows in ranks if rows[0]["node_rank"] == 0]
        if "ledger_inter_bytes" in rank0[0]:  # node 0's ranks together: what node 0 sends to node 1
            ledger_inter.append(sum(per_step(rows, "ledger_inter_bytes") for rows in node0))
            ledger_intra.append(sum(per_step(rows, "ledger_intra_bytes") for rows in node0))
            for kind in rank0[-1]["ledger_by_kind"]:
                by_kind.setdefault(kind, []).append(sum(_kind_per_step(rows, kind, warmup) for rows in node0))
        tx.append(per_step(rank0, "tx_bytes"))
        rx.append(per_step(rank0, "rx_bytes"))
        losses += [r["loss"] for rows in ranks for r in rows[1:]]
    step_s = statistics.median(repeats)
    return {
        "config": name,
        "step_s": step_s,
        "step_s_interval": [min(repeats), max(repeats)],
        "step_s_repeats": repeats,
        "step_s_all": durations,
        "tokens_per_s": tokens_per_step / step_s,
        "ledger_inter_bytes_per_step": statistics.mean(ledger_inter) if ledger_inter else None,
        "ledger_intra_bytes_per_step": statistics.mean(ledger_intra) if ledger_intra else None,
        "ledger_inter_bytes_per_step_by_kind": {k: statistics.mean(v) for k, v in by_kind.items()},
        "link_tx_bytes_per_step": statistics.mean(tx),
        "link_rx_bytes_per_step": statistics.mean(rx),
        "losses_finite": all(loss == loss and abs(loss) != float("inf") for loss in losses),
        "last_loss": runs[-1][0][-1]["loss"],
    }


def paired_ratio(base: list[float], other: list[float]) -> tuple[float, list[float]]:
    """``base[r] / other[r]`` over the repeats run in the same round: the median and ``[min, max]``."""
    if len(base) != len(other):
        raise ValueError(f"paired repeats differ in number: {len(base)} and {len(other)}")
    ratios = [b / o for b, o in zip(base, other)]
    return statistics.median(ratios), [min(ratios), max(ratios)]


def intervals_overlap(a: list[float], b: list[float]) -> bool:
    """Whether two ``[low, high]`` intervals share a point (then the two figures are not told apart)."""
    return a[0] <= b[1] and b[0] <= a[1]


def add_ratios(rows: list[dict]) -> None:
    """Speedup and byte ratios of each row against ``zero3`` at the same rate (speedups paired by repeat)."""
    for row in rows:
        base = next(r for r in rows if r["config"] == "zero3" and r["rate"] == row["rate"])
        speedup, interval = paired_ratio(base["step_s_repeats"], row["step_s_repeats"])
        row["speedup_vs_zero3"], row["speedup_vs_zero3_interval"] = speedup, interval
        row["link_ratio_vs_zero3"] = row["link_tx_bytes_per_step"] / base["link_tx_bytes_per_step"]
        ledger = row["ledger_inter_bytes_per_step"]
        row["ledger_ratio_vs_zero3"] = None if ledger is None else ledger / base["ledger_inter_bytes_per_step"]
        row["link_over_ledger"] = None if ledger is None else row["link_tx_bytes_per_step"] / ledger


def _mb(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 1e6:.3f}"


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def table(rows: list[dict]) -> str:
    repeats = len(rows[0]["step_s_repeats"]) if rows else 0
    lines = [
        f"| link | config | step s (median [min, max] of {repeats}) | tokens/s | speedup vs zero3 (paired)"
        " | ledger inter MB/step | link MB/step | ledger ratio | link ratio | link / ledger |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        link = "unshaped" if r["rate"] is None else f"{r['rate']:g} Mbit/s"
        (lo, hi), (slo, shi) = r["step_s_interval"], r["speedup_vs_zero3_interval"]
        lines.append(
            f"| {link} | {r['config']} | {r['step_s']:.3f} [{lo:.3f}, {hi:.3f}] | {r['tokens_per_s']:.0f}"
            f" | {r['speedup_vs_zero3']:.2f}x [{slo:.2f}, {shi:.2f}]"
            f" | {_mb(r['ledger_inter_bytes_per_step'])} | {_mb(r['link_tx_bytes_per_step'])}"
            f" | {_ratio(r['ledger_ratio_vs_zero3'])} | {_ratio(r['link_ratio_vs_zero3'])}"
            f" | {_ratio(r['link_over_ledger'])} |"
        )
    return "\n".join(lines)


def parse_rate(text: str) -> float | None:
    return None if text == "unshaped" else float(text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", nargs="+", default=["200"], help="Mbit/s per direction, or 'unshaped'")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay on each veth end (needs netem)")
    parser.add_argument("--configs", nargs="+", default=[*ZEROPP_CONFIGS, FSDP_BASELINE], choices=CONFIG_NAMES)
    parser.add_argument("--steps", type=int, default=14, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=4, help="first steps left out of the figures")
    parser.add_argument(
        "--repeats", type=int, default=3, help="interleaved rounds of all configurations (>= 3 for an interval)"
    )
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE, help="sequences per rank per step")
    parser.add_argument("--block-size", type=int, default=MODEL["block_size"], help="tokens per sequence")
    parser.add_argument("--n-embd", type=int, default=MODEL["n_embd"], help="model width")
    parser.add_argument("--n-layer", type=int, default=MODEL["n_layer"], help="transformer blocks")
    probe_help = "time each cross-node collective alone at each rate, for plan_check.py (benchmarks/link_probe.py)"
    parser.add_argument("--probe-link", action="store_true", help=probe_help)
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    parser.add_argument("--png", type=Path, default=None, help="figure of the table; default: the JSON's path, .png")
    parser.add_argument("--keep-logs", type=Path, default=None, help="keep every run's configs, logs and probes here")
    args = parser.parse_args(argv)
    if "zero3" not in args.configs:
        parser.error("--configs must include zero3 (the baseline of every ratio)")
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: use 1 or more (3 or more for a step time's interval)")
    if args.repeats < 3:
        print(f"benchmarks/cluster.py: {args.repeats} repeat(s): the intervals need 3 or more", file=sys.stderr)
    if args.steps <= args.warmup + 1:
        parser.error("--steps must exceed --warmup by at least 2")
    reason = missing_requirements()
    if reason:
        sys.exit(f"benchmarks/cluster.py {reason}.")
    exit_on_signals()
    model = dict(MODEL, block_size=args.block_size, n_embd=args.n_embd, n_layer=args.n_layer)
    tokens_per_step = NODES * DEVICES * args.batch_size * args.block_size
    rows = []
    probed: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="zpp-cluster-") as tmp, TwoNodeCluster(rate_mbit=None) as cluster:
        base = args.keep_logs or Path(tmp)
        port = 29400
        for rate_text in args.rates:
            rate = parse_rate(rate_text)
            cluster.shape(rate, args.delay_ms)
            if args.probe_link:
                port += 1
                probed[rate_text] = probe_link(cluster, port)
                print(f"[{rate_text}] link probe: {json.dumps(probed[rate_text])}", file=sys.stderr)
            runs: dict[str, list] = {name: [] for name in args.configs}
            for repeat in range(args.repeats):
                for name in args.configs:
                    port += 1  # a fresh port per job: no TIME_WAIT sockets from the previous one
                    workdir = base / (f"{rate_text}mbit" if rate else rate_text) / f"{name}-{repeat}"
                    started = time.monotonic()
                    runs[name].append(launch(cluster, name, workdir, port, args.steps, model, args.batch_size))
                    print(f"[{rate_text}] {name} #{repeat}: {time.monotonic() - started:.0f}s", file=sys.stderr)
            for name in args.configs:
                row = summarize(name, runs[name], args.warmup, tokens_per_step)
                rows.append(dict(row, rate=rate, delay_ms=args.delay_ms))
    add_ratios(rows)
    print(table(rows))
    meta = {"command": " ".join(["python", "benchmarks/cluster.py", *(argv or sys.argv[1:])]), "model": model,
            "batch_size": args.batch_size, "steps": args.steps, "warmup": args.warmup,
            "link_probe": probed}  # fmt: skip
    if args.json:
        record.write(args.json, {"meta": meta, "rows": rows}, None if argv is None else [__file__, *argv])
        print(f"wrote {args.json}")
    png = args.png or (args.json.with_suffix(".png") if args.json else None)
    if png and try_plot(cluster_png, {"meta": meta, "rows": rows}, png):
        print(f"wrote {png}")


if __name__ == "__main__":
    main()
