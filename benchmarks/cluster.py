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

Topologies (``--topologies``, default ``2x2``): ``NODESxRANKS`` runs the example GPT over all ranks as above, against
ZeRO-3; ``NODESxRANKStT`` runs a Llama with tensor parallelism t inside each node (``benchmarks/llama_tp.py``: torch's
usual plan, then ``fully_shard`` over the data-parallel dimension, one ``configure_model`` for both strategies) with
``--tp-configs``: ZeRO++'s defaults, ``ZeroPPStrategy(tensor_parallel_size=t)`` (ranks per node from the launch),
against ``model_parallel``, Lightning's ``ModelParallelStrategy(data_parallel_size=RANKS * NODES / t,
tensor_parallel_size=t)`` on the same mesh. Every configuration of every topology runs in each round, so the ratios
of a t-row are paired with ``model_parallel``'s repeats of the same rounds:

    sudo python benchmarks/cluster.py --topologies 2x4t2 2x4t4 --repeats 5 \\
        --json benchmarks/data/slow_link/cluster_2d.json

The figure is drawn for 1-D topologies only.
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
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

import record  # noqa: E402
from comm_volume import CONFIGS as ZEROPP_CONFIGS  # noqa: E402
from comm_volume import TENSOR_PARALLEL_CONFIGS, parse_topology  # noqa: E402
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
    "zeropp_quantized_vectors": dict(gradient_quantization_scope="all"),  # cluster_vectors.json's pair, set outright
}
STRATEGIES = {**ZEROPP_CONFIGS, **CANDIDATES}
CONFIG_NAMES = (*STRATEGIES, FSDP_BASELINE)  # hsdp among them: the baseline users would pick instead
NODES, DEVICES = 2, 2
# A communication-bound setting: the demo's model (3.26M parameters, ~6.5 MB in bf16) and a micro-batch small
# enough that on 2 shared CPU cores the step is dominated by moving weights and gradients between the nodes.
MODEL = dict(block_size=64, n_layer=4, n_head=4, n_embd=256, warmup_steps=2)
BATCH_SIZE = 1
# With tensor parallelism (topologies NODESxRANKStT): a Llama under torch's usual plan, sequences as long as the GPT's,
# batch 1 per data-parallel rank, bf16-mixed; FSDP gathers bf16 weights and reduces fp32 gradients under both
# strategies (Lightning's tensor-parallel example's policy; benchmarks/llama_tp.py). 8 ranks share the machine's cores,
# so a step carries a large fixed cost (every tensor-parallel collective waits for its ranks to be scheduled) and the
# link's share of it grows with the model: the Llama is 6.59M parameters (4 blocks of 384), about twice the GPT, the
# largest whose runs of both topologies fit a study of 5 rounds in about an hour on 2 cores.
TP_BASELINE = "model_parallel"  # Lightning's ModelParallelStrategy with the same data- and tensor-parallel sizes
TP_CONFIG_NAMES = (*TENSOR_PARALLEL_CONFIGS, TP_BASELINE)
LLAMA = dict(vocab_size=256, n_layer=4, dim=384, n_head=8, n_kv_head=4, ffn_hidden=1024, max_seq_len=64,
             param_dtype="bfloat16", reduce_dtype="float32")  # fmt: skip
_ENV_DROP = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR",
             "MASTER_PORT", "GLOO_SOCKET_IFNAME")  # fmt: skip


@dataclass(frozen=True)
class Topology:
    """A job's layout on the emulated cluster: ``nodes`` x ``ranks_per_node`` ranks (node-major), each layer of the
    model split over ``tensor_parallel_size`` consecutive ranks of a node (1: none; the example GPT runs there)."""

    nodes: int = NODES
    ranks_per_node: int = DEVICES
    tensor_parallel_size: int = 1

    @classmethod
    def parse(cls, text: str) -> Topology:
        """``NODESxRANKS`` or ``NODESxRANKStT`` (``2x2``, ``2x4t2``); raises ValueError naming what does not fit."""
        try:
            nodes, per_node, t = parse_topology(text)
        except ValueError:
            raise ValueError(f"topology {text!r}: write NODESxRANKS or NODESxRANKStT, e.g. 2x2 or 2x4t2") from None
        if nodes != NODES:
            raise ValueError(f"topology {text!r}: the emulated cluster has {NODES} nodes")
        if t < 1 or per_node < 1 or per_node % t:
            raise ValueError(f"topology {text!r}: the tensor-parallel size {t} must divide the {per_node} ranks a node")
        return cls(nodes, per_node, t)

    @property
    def name(self) -> str:
        t = self.tensor_parallel_size
        return f"{self.nodes}x{self.ranks_per_node}" + (f"t{t}" if t > 1 else "")

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // self.tensor_parallel_size

    @property
    def baseline(self) -> str:
        """The configuration every ratio of this topology is paired with."""
        return "zero3" if self.tensor_parallel_size == 1 else TP_BASELINE

    def tokens_per_step(self, batch_size: int, seq: int) -> int:
        """Tokens one optimizer step trains on: each data-parallel rank's batch (a tensor-parallel group shares one)."""
        return self.data_parallel_size * batch_size * seq


DEFAULT_TOPOLOGY = Topology()


def entry(name: str, topology: Topology) -> Path:
    """The script each node runs for configuration ``name``."""
    if topology.tensor_parallel_size > 1:
        return BENCH / "llama_tp.py"
    return BENCH / "fsdp_baseline.py" if name == FSDP_BASELINE else ROOT / "examples" / "gpt" / "train.py"


def strategy_config(name: str, topology: Topology) -> dict:
    """The ``trainer.strategy`` of configuration ``name`` on ``topology``; ValueError for a name it does not run."""
    t = topology.tensor_parallel_size
    if name == (FSDP_BASELINE if t == 1 else TP_BASELINE):
        return {
            "class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
            "init_args": {"data_parallel_size": topology.data_parallel_size, "tensor_parallel_size": t},
        }
    configs = STRATEGIES if t == 1 else TENSOR_PARALLEL_CONFIGS
    if name not in configs:
        known = ", ".join(CONFIG_NAMES if t == 1 else TP_CONFIG_NAMES)
        raise ValueError(f"configuration {name!r} does not run on topology {topology.name}: one of {known}")
    # ranks_per_node is left to the launch (devices per node), as a user's multi-node job leaves it
    return {
        "class_path": "lightning_zeropp.ZeroPPStrategy",
        "init_args": dict(configs[name], **({"tensor_parallel_size": t} if t > 1 else {})),
    }


def run_config(
    name: str, probe_dir: Path, interface: str, steps: int, model: dict, batch_size: int,
    topology: Topology = DEFAULT_TOPOLOGY,
) -> dict:  # fmt: skip
    """The LightningCLI config of one run (the same file on both nodes; the interface differs by env only)."""
    return {
        "seed_everything": 1234,
        "trainer": {
            "accelerator": "cpu",
            "devices": topology.ranks_per_node,
            "num_nodes": topology.nodes,
            "strategy": strategy_config(name, topology),
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
    timeout: float = 900, topology: Topology = DEFAULT_TOPOLOGY,
) -> list[list[dict]]:  # fmt: skip
    """Runs one training job across the two nodes; returns each global rank's probe rows. Raises with the logs."""
    workdir.mkdir(parents=True, exist_ok=True)
    probe_dir = workdir / "probe"
    script = entry(name, topology)
    procs, logs = [], []
    for node in range(topology.nodes):
        config = workdir / f"node{node}.yaml"
        config.write_text(yaml.safe_dump(run_config(name, probe_dir, cluster.interfaces[node], steps, model,
                                                    batch_size, topology)))  # fmt: skip
        log = workdir / f"node{node}.log"
        logs.append(log)
        with log.open("w") as out:
            cmd = [sys.executable, str(script), "fit", "--config", str(config)]
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
    """Speedup and byte ratios of each row against its topology's baseline at the same rate (``zero3``; with tensor
    parallelism ``model_parallel``), speedups paired by repeat, under the keys ``speedup_vs_<baseline>``,
    ``speedup_vs_<baseline>_interval``, ``link_ratio_vs_<baseline>`` and ``ledger_ratio_vs_<baseline>`` (``None``
    where either has no ledger: ModelParallelStrategy keeps none)."""
    for row in rows:
        name = row.get("baseline", "zero3")
        base = next(r for r in rows if r["config"] == name and r["rate"] == row["rate"]
                    and r.get("topology") == row.get("topology"))  # fmt: skip
        speedup, interval = paired_ratio(base["step_s_repeats"], row["step_s_repeats"])
        row[f"speedup_vs_{name}"], row[f"speedup_vs_{name}_interval"] = speedup, interval
        row[f"link_ratio_vs_{name}"] = row["link_tx_bytes_per_step"] / base["link_tx_bytes_per_step"]
        ledger, base_ledger = row["ledger_inter_bytes_per_step"], base["ledger_inter_bytes_per_step"]
        row[f"ledger_ratio_vs_{name}"] = None if ledger is None or base_ledger is None else ledger / base_ledger
        row["link_over_ledger"] = None if ledger is None else row["link_tx_bytes_per_step"] / ledger


def _mb(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 1e6:.3f}"


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def table(rows: list[dict]) -> str:
    repeats = len(rows[0]["step_s_repeats"]) if rows else 0
    lines = [
        f"| topology | link | config | step s (median [min, max] of {repeats}) | tokens/s | against"
        " | speedup (paired) | ledger inter MB/step | link MB/step | ledger ratio | link ratio | link / ledger |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        link = "unshaped" if r["rate"] is None else f"{r['rate']:g} Mbit/s"
        name = r.get("baseline", "zero3")
        (lo, hi), (slo, shi) = r["step_s_interval"], r[f"speedup_vs_{name}_interval"]
        lines.append(
            f"| {r.get('topology', DEFAULT_TOPOLOGY.name)} | {link} | {r['config']}"
            f" | {r['step_s']:.3f} [{lo:.3f}, {hi:.3f}] | {r['tokens_per_s']:.0f}"
            f" | {name} | {r[f'speedup_vs_{name}']:.2f}x [{slo:.2f}, {shi:.2f}]"
            f" | {_mb(r['ledger_inter_bytes_per_step'])} | {_mb(r['link_tx_bytes_per_step'])}"
            f" | {_ratio(r[f'ledger_ratio_vs_{name}'])} | {_ratio(r[f'link_ratio_vs_{name}'])}"
            f" | {_ratio(r['link_over_ledger'])} |"
        )
    return "\n".join(lines)


def parse_rate(text: str) -> float | None:
    return None if text == "unshaped" else float(text)


def llama_parameters(shape: dict) -> int:
    """The number of parameters of the Llama of ``shape`` (``LLAMA``'s keys; the tied head counted once)."""
    from lightning_zeropp.testing.models import TinyLlama

    keys = ("vocab_size", "n_layer", "dim", "n_head", "n_kv_head", "ffn_hidden", "max_seq_len")
    return sum(p.numel() for p in TinyLlama(**{k: shape[k] for k in keys}).parameters())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", nargs="+", default=["200"], help="Mbit/s per direction, or 'unshaped'")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay on each veth end (needs netem)")
    topologies_help = "NODESxRANKS (the example GPT) or NODESxRANKStT (the Llama, tensor-parallel size T)"
    parser.add_argument("--topologies", nargs="+", default=[DEFAULT_TOPOLOGY.name], help=topologies_help)
    configs_help = "what the NODESxRANKS topologies run (zero3 among them)"
    parser.add_argument("--configs", nargs="+", default=[*ZEROPP_CONFIGS, FSDP_BASELINE], choices=CONFIG_NAMES,
                        help=configs_help)  # fmt: skip
    tp_help = f"what the NODESxRANKStT topologies run ({TP_BASELINE} among them)"
    parser.add_argument("--tp-configs", nargs="+", default=["zeropp", TP_BASELINE], choices=TP_CONFIG_NAMES,
                        help=tp_help)  # fmt: skip
    parser.add_argument("--steps", type=int, default=14, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=4, help="first steps left out of the figures")
    parser.add_argument(
        "--repeats", type=int, default=3, help="interleaved rounds of all configurations (>= 3 for an interval)"
    )
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE, help="sequences per rank per step")
    parser.add_argument("--block-size", type=int, default=MODEL["block_size"], help="tokens per sequence (both models)")
    parser.add_argument("--n-embd", type=int, default=MODEL["n_embd"], help="model width")
    parser.add_argument("--n-layer", type=int, default=MODEL["n_layer"], help="transformer blocks")
    parser.add_argument("--llama-dim", type=int, default=LLAMA["dim"], help="the Llama's width")
    parser.add_argument("--llama-ffn", type=int, default=LLAMA["ffn_hidden"], help="the Llama's SwiGLU hidden size")
    parser.add_argument("--llama-layers", type=int, default=LLAMA["n_layer"], help="the Llama's blocks")
    probe_help = "time each cross-node collective alone at each rate, for plan_check.py (benchmarks/link_probe.py)"
    parser.add_argument("--probe-link", action="store_true", help=probe_help)
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    parser.add_argument("--png", type=Path, default=None, help="figure of the table; default: the JSON's path, .png")
    parser.add_argument("--keep-logs", type=Path, default=None, help="keep every run's configs, logs and probes here")
    args = parser.parse_args(argv)
    try:
        topologies = list(dict.fromkeys(Topology.parse(t) for t in args.topologies))
    except ValueError as err:
        parser.error(str(err))
    flat = [t for t in topologies if t.tensor_parallel_size == 1]
    split = [t for t in topologies if t.tensor_parallel_size > 1]
    if flat and "zero3" not in args.configs:
        parser.error("--configs must include zero3 (the baseline of every ratio)")
    if split and TP_BASELINE not in args.tp_configs:
        parser.error(f"--tp-configs must include {TP_BASELINE} (the baseline of every tensor-parallel ratio)")
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
    llama = dict(LLAMA, dim=args.llama_dim, ffn_hidden=args.llama_ffn, n_layer=args.llama_layers,
                 max_seq_len=args.block_size)  # fmt: skip
    jobs = [(t, name) for t in topologies for name in (args.configs if t in flat else args.tp_configs)]
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
            runs: dict[tuple[Topology, str], list] = {job: [] for job in jobs}
            for repeat in range(args.repeats):
                for topology, name in jobs:
                    port += 1  # a fresh port per job: no TIME_WAIT sockets from the previous one
                    label = name if topology in flat else f"{topology.name}-{name}"
                    workdir = base / (f"{rate_text}mbit" if rate else rate_text) / f"{label}-{repeat}"
                    started = time.monotonic()
                    runs[topology, name].append(launch(cluster, name, workdir, port, args.steps,
                                                       model if topology in flat else llama, args.batch_size,
                                                       topology=topology))  # fmt: skip
                    print(f"[{rate_text}] {topology.name} {name} #{repeat}: {time.monotonic() - started:.0f}s",
                          file=sys.stderr)  # fmt: skip
            for topology, name in jobs:
                tokens = topology.tokens_per_step(args.batch_size, args.block_size)
                row = summarize(name, runs[topology, name], args.warmup, tokens)
                rows.append(dict(row, rate=rate, delay_ms=args.delay_ms, topology=topology.name,
                                 nodes=topology.nodes, ranks_per_node=topology.ranks_per_node,
                                 tensor_parallel_size=topology.tensor_parallel_size,
                                 baseline=topology.baseline))  # fmt: skip
    add_ratios(rows)
    print(table(rows))
    meta = {"command": " ".join(["python", "benchmarks/cluster.py", *(argv or sys.argv[1:])]),
            "topologies": [t.name for t in topologies], "batch_size": args.batch_size, "steps": args.steps,
            "warmup": args.warmup, "link_probe": probed}  # fmt: skip
    if flat:
        meta["model"] = model
    if split:
        meta["llama"], meta["llama_parameters"] = llama, llama_parameters(llama)
    if args.json:
        record.write(args.json, {"meta": meta, "rows": rows}, None if argv is None else [__file__, *argv])
        print(f"wrote {args.json}")
    png = args.png or (args.json.with_suffix(".png") if args.json and not split else None)
    if png and split:
        print("benchmarks/cluster.py: no figure: it is drawn for 1-D topologies only", file=sys.stderr)
    elif png and try_plot(cluster_png, {"meta": meta, "rows": rows}, png):
        print(f"wrote {png}")


if __name__ == "__main__":
    main()
