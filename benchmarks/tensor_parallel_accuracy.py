"""Does ZeRO++ with tensor parallelism train as well as Lightning's exact 2-D run? A small Llama, paired over seeds.

:class:`~lightning_zeropp.testing.models.TinyLlama` at byte level (the standard library's source as bytes, never
downloaded), under torch's usual tensor-parallel plan (``parallelize_llama``: colwise / rowwise projections, the tied
embedding and head split over the vocabulary, the norms SequenceParallel), then ``fully_shard`` on every block and the
root over the data-parallel dimension: one ``configure_model``, run unchanged under two strategies on ``--world`` CPU
gloo ranks, t = 2:

    model_parallel  Lightning's ModelParallelStrategy(data_parallel_size=world / 2, tensor_parallel_size=2): the
                    exact 2-D run, the baseline
    zeropp-vectors  ZeroPPStrategy(tensor_parallel_size=2, ranks_per_node=--ranks-per-node) with its defaults:
                    on the default 4 ranks as 2 nodes x 2 (r/t = 1) qwZ INT8 weights across nodes and qgZ's one
                    INT4 hop across nodes, AdamW's second-moment correction on the matrices, norm gains and biases
                    reduced exactly (``gradient_quantization_scope="auto"``: "matrices" with tensor parallelism;
                    pinned, as its runs were made)

and, with ``--configs``, ``zeropp-matrices`` (every gradient quantized: the defaults from 2026-12-07 09:55 until
19:10, pinned as its runs were made), ``zeropp`` (the defaults until 2026-12-07 09:55, pinned as its runs were made:
the correction on every parameter), ``zeropp-exact`` (the strategy with quantization off: bit-identical to the
baseline when the strategy adds nothing but its quantization, a control) and ``zeropp-no-smc`` (without AdamW's
second-moment correction: what the correction, which lengthens Adam's steps by the noise it takes out of ``v``, adds
to the quantization's own gap; its runs predate the exact vectors). ``--world 8 --ranks-per-node 4`` is 2 nodes x 4
(r/t = 2: qgZ's INT8 hop inside a node, then INT4 across); give it its own ``--json``.

The model (``--size``, default ``small``): vocabulary 256 (bytes), 4 blocks of dimension 128, 8 query heads and 4
key/value heads of 16, SwiGLU hidden 344, sequences of 128 bytes; 758,912 parameters (``tiny``: dimension 16, 1 block,
sequences of 16, 6,320 parameters, for tests). Training: AdamW (0.9, 0.95; weight decay 0.1 on the matrices but the
embedding), linear warm-up then cosine to 10% over the run, fp32, batch 8 sequences per data-parallel rank. The
learning rate and warm-up are ``convergence.py``'s regimes: lr 1e-3 after 10 steps (the default, "aggressive"), or
``--lr 3e-4 --warmup 30`` ("calm", the regime of the 1-D study's verdicts); one file holds both, each paired within
itself.

Same initial weights and the same data order for both strategies at a seed: every rank builds the model after
``torch.manual_seed(seed)``, and the training windows are drawn from the corpus (the first 8 MB, its last 5% held
out) by a permutation seeded with the seed, built once here and handed to the ranks; the Trainer's sampler splits them
over the data-parallel ranks without shuffling. Validation: ``--val-windows`` held-out windows, every ``steps /
evals`` steps and at the end, the mean over all of them.

Report, per configuration against ``model_parallel`` at the same seed: the paired relative gap ``(run - base) / base``
of the final validation loss and of the mean training loss (rank 0's) over the second half of the steps; per seed,
their mean, standard error (std over seeds / sqrt(seeds)) and resolution (2 SE). Goal (issue 60): the defaults'
final validation loss within 0.1% of the exact run at 100 steps, met when the mean gap and its resolution lie within it
(``convergence.verdict``: met / NOT met / undecided).

Results: a markdown table on stdout; ``--json`` (default ``benchmarks/data/accuracy/tensor_parallel.json``) holds
``meta``, ``runs`` (one per configuration, seed, regime and steps: the settings, ``train_curve`` and ``val_curve`` as
``[steps done, loss]``, seconds, the strategy's description of its collectives) and ``summary``. It is rewritten after
every run (with its manifest, ``record.py``), and a rerun with the same ``--json`` skips the runs done: the study can
be stopped and continued.

    nice -n 5 python benchmarks/tensor_parallel_accuracy.py             # 3 seeds x 2 configurations, 100 steps
    nice -n 5 python benchmarks/tensor_parallel_accuracy.py --lr 3e-4 --warmup 30      # the same, calm
    nice -n 5 python benchmarks/tensor_parallel_accuracy.py --configs model_parallel zeropp-exact   # the control
    python benchmarks/tensor_parallel_accuracy.py --report-only         # the tables of the runs recorded

Duration, on this machine (2 cores): a run of 100 steps takes about 1.5-2.5 minutes on 4 ranks and 2.5-3.5 on 8
when nothing else runs, up to 15-25 minutes beside a test suite; so the default study (6 runs) about 15 minutes. The
page (``docs/results/tensor_parallel_accuracy.md``) gives each configuration's minutes per run.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback
from torch.utils.data import DataLoader, TensorDataset

from lightning_zeropp.testing.models import LlamaModule

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
EXAMPLE = ROOT / "examples" / "gpt"
for _path in (BENCH, EXAMPLE):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import record  # noqa: E402
from convergence import add_run, conflicts, halves, load, mean_se, paired, pending, std, verdict  # noqa: E402
from data import ByteWindows, load_corpus  # noqa: E402  (examples/gpt/data.py: the byte corpus)

DEFAULT_JSON = BENCH / "data" / "accuracy" / "tensor_parallel.json"
T = 2  # tensor-parallel size
BASE = "model_parallel"
CONFIGS = ("model_parallel", "zeropp", "zeropp-exact", "zeropp-no-smc", "zeropp-matrices", "zeropp-vectors")
DEFAULT_CONFIGS = ["model_parallel", "zeropp-vectors"]
GOAL = 0.001  # |relative gap of the final validation loss vs the exact 2-D run| (issue 60)
SIZES = {
    "small": dict(vocab_size=256, n_layer=4, dim=128, n_head=8, n_kv_head=4, ffn_hidden=344, max_seq_len=128),
    "tiny": dict(vocab_size=256, n_layer=1, dim=16, n_head=2, n_kv_head=2, ffn_hidden=24, max_seq_len=16),
}
"""TinyLlama's shapes; each sequence is ``max_seq_len`` bytes (even: sequence parallelism splits it over t = 2)."""
CORPUS_BYTES = 8_000_000  # the demo's max_bytes: the first 8 MB of the standard library's source
VAL_FRACTION = 0.05
BATCH = 8  # sequences per data-parallel rank and step
WEIGHT_DECAY = 0.1
# What a run must share with the runs it is paired with (besides its key); a resumed file is checked against them.
SETUP = ("world", "ranks_per_node", "size", "model", "batch", "evals", "val_windows", "lr", "warmup")

Curve = list[list[float]]  # [steps done, loss]


# ----------------------------------------------------------------------------------------------- the ranks
class Llama(LlamaModule):
    """The package's Llama as a user of ModelParallelStrategy writes it (``LlamaModule``: the Llama plan over the
    tensor-parallel dimension, then ``fully_shard`` on every block and the root over the data-parallel one), with a
    validation loss and AdamW as the example GPT's: warm-up, then cosine to 10% at ``steps``."""

    def __init__(self, seed: int, model: dict[str, int], lr: float, warmup: int, steps: int) -> None:
        super().__init__(lr=lr, seed=seed, model=model)  # the seed: the same initial weights on every rank, both runs
        self.warmup, self.steps = warmup, steps

    def validation_step(self, batch, batch_idx):
        # each rank's mean over its batches, then the mean over the ranks (the two of a tensor-parallel group agree)
        self.log("val/loss", self.loss(batch), sync_dist=True)

    def configure_optimizers(self):
        decay, no_decay = [], []
        for name, p in self.named_parameters():  # as the example GPT: decay the matrices, not norms or the embedding
            (decay if p.dim() >= 2 and "embed" not in name else no_decay).append(p)
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.lr,
            betas=(0.9, 0.95),
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self.schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def schedule(self, step: int) -> float:
        """The learning rate's factor at ``step``: linear warm-up, then cosine from 1 to 0.1 at the last step."""
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.steps - self.warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


class Curves(Callback):
    """This rank's training loss after each step and the validation loss (all ranks') at each check, as
    ``[steps done, loss]``."""

    def __init__(self) -> None:
        self.train: Curve = []
        self.val: Curve = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.train.append([trainer.global_step, float(outputs["loss"])])

    def on_validation_end(self, trainer, pl_module):
        self.val.append([trainer.global_step, float(trainer.callback_metrics["val/loss"])])


def strategy(config: str, world: int, ranks_per_node: int):
    """The strategy of configuration ``config`` on ``world`` ranks."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_zeropp import ZeroPPStrategy

    if config == "model_parallel":
        return ModelParallelStrategy(data_parallel_size=world // T, tensor_parallel_size=T)
    if config == "zeropp":  # the defaults until 2026-12-07 09:55, as their runs were made
        return ZeroPPStrategy(tensor_parallel_size=T, ranks_per_node=ranks_per_node, second_moment_scope="all",
                              gradient_quantization_scope="all")  # fmt: skip
    if config == "zeropp-exact":
        return ZeroPPStrategy(
            tensor_parallel_size=T, ranks_per_node=ranks_per_node, quantize_weights=False, quantize_gradients=False
        )
    if config == "zeropp-no-smc":  # as its runs were made
        return ZeroPPStrategy(tensor_parallel_size=T, ranks_per_node=ranks_per_node, second_moment_correction=False,
                              gradient_quantization_scope="all")  # fmt: skip
    if config == "zeropp-matrices":  # every gradient quantized (the defaults until 2026-12-07 19:10), as run
        return ZeroPPStrategy(tensor_parallel_size=T, ranks_per_node=ranks_per_node, second_moment_scope="matrices",
                              gradient_quantization_scope="all")  # fmt: skip
    if config == "zeropp-vectors":
        return ZeroPPStrategy(tensor_parallel_size=T, ranks_per_node=ranks_per_node, second_moment_scope="matrices",
                              gradient_quantization_scope="matrices")  # fmt: skip
    raise ValueError(f"unknown configuration {config!r}: one of {', '.join(CONFIGS)}")


def _worker(rank: int, world: int, config: str, settings: dict[str, Any], data: dict[str, Any]) -> dict:
    """One run on this rank: its training loss per step, the validation loss at each check, the description of the
    strategy's collectives (ZeRO++'s)."""
    from lightning_zeropp.testing.distributed import lightning_trainer

    steps, curves = settings["steps"], Curves()
    chosen = strategy(config, world, settings["ranks_per_node"])
    module = Llama(settings["seed"], settings["model"], settings["lr"], settings["warmup"], steps)
    trainer = lightning_trainer(
        world, chosen, max_steps=steps, precision="32-true", callbacks=[curves], limit_val_batches=None,
        val_check_interval=steps // settings["evals"], check_val_every_n_epoch=None,
    )  # fmt: skip
    trainer.fit(
        module,
        DataLoader(TensorDataset(*data["train"]), batch_size=BATCH, shuffle=False),
        DataLoader(TensorDataset(*data["val"]), batch_size=BATCH, shuffle=False),
    )
    comms = getattr(chosen, "comms", None)
    return {"train_curve": curves.train, "val_curve": curves.val, "describe": comms.describe() if comms else None}


# ----------------------------------------------------------------------------------------------- data
def corpus_windows(seq: int, max_bytes: int = CORPUS_BYTES) -> tuple[Any, Any]:
    """The corpus's training and held-out windows of ``seq`` bytes and their next bytes (``ByteWindows``)."""
    corpus = load_corpus(max_bytes=max_bytes)
    split = int(corpus.numel() * (1 - VAL_FRACTION))
    return ByteWindows(corpus[:split], seq), ByteWindows(corpus[split:], seq)


def _stacked(windows: Any, indices: Any) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, targets = zip(*(windows[int(i)] for i in indices), strict=True)
    return torch.stack(tokens), torch.stack(targets)


def seed_data(train: Any, held: Any, seed: int, steps: int, data_parallel: int, val_windows: int) -> dict[str, Any]:
    """The windows of one seed: ``steps * BATCH * data_parallel`` training windows drawn by a permutation seeded
    with ``seed`` (the Trainer's sampler deals them to the data-parallel ranks in turn), and the first
    ``val_windows`` held-out ones; each as (tokens, next tokens)."""
    need = steps * BATCH * data_parallel
    if need > len(train) or val_windows > len(held):
        raise SystemExit(
            f"{steps} steps of {BATCH} x {data_parallel} windows and {val_windows} held-out ones need {need} and"
            f" {val_windows}; the corpus has {len(train)} and {len(held)}"
        )
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))[:need]
    return {"train": _stacked(train, order), "val": _stacked(held, range(val_windows))}


# ----------------------------------------------------------------------------------------------- statistics
def summarize(runs: list[dict]) -> list[dict[str, Any]]:
    """Per (regime, steps): the baseline's spread of its final validation loss, and each other configuration's
    paired gaps against it (final validation loss; mean training loss per half), with the goal's verdict."""
    done = [r for r in runs if "error" not in r and r.get("val_curve")]
    groups: dict[tuple[str, int], dict[str, dict[int, dict]]] = {}
    for r in done:
        groups.setdefault((r["regime"], r["steps"]), {}).setdefault(r["config"], {})[r["seed"]] = r
    out = []
    for (regime, steps), by_config in groups.items():
        base = by_config.get(BASE, {})
        finals = [r["val_curve"][-1][1] for r in base.values()]
        entry: dict[str, Any] = {
            "regime": regime,
            "steps": steps,
            BASE: {
                "seeds": sorted(base),
                "final_val_loss": {"mean": mean_se(finals)[0], "std": std(finals)},
                "minutes": sum(r["seconds"] for r in base.values()) / len(base) / 60 if base else None,
            },
            "configs": [],
        }
        for name, rs in sorted(by_config.items()):
            if name == BASE:
                continue
            half = {s: halves(r["train_curve"], steps) for s, r in rs.items()}
            base_half = {s: halves(r["train_curve"], steps) for s, r in base.items()}
            final = paired(
                {s: r["val_curve"][-1][1] for s, r in rs.items()}, {s: r["val_curve"][-1][1] for s, r in base.items()}
            )
            entry["configs"].append({
                "config": name,
                "seeds": sorted(set(rs) & set(base)),
                "unpaired_seeds": sorted(set(rs) - set(base)),
                "final_gap": final,
                "first_half_gap": paired({s: h[0] for s, h in half.items()}, {s: h[0] for s, h in base_half.items()}),
                "second_half_gap": paired({s: h[1] for s, h in half.items()}, {s: h[1] for s, h in base_half.items()}),
                "goal": GOAL,
                "verdict": verdict(final, GOAL),
                "minutes": sum(r["seconds"] for r in rs.values()) / len(rs) / 60,
            })  # fmt: skip
        out.append(entry)
    return out


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.3%}"


def report(summary: list[dict[str, Any]]) -> str:
    """The summary as markdown, one section per (regime, steps)."""
    lines = []
    for entry in summary:
        f = entry[BASE]["final_val_loss"]
        lines.append(f"\n### {entry['regime']}, {entry['steps']} steps\n")
        if f["mean"] is not None:
            spread = "n/a" if f["std"] is None else f"{f['std']:.4f}"
            lines.append(f"{BASE} final validation loss: mean {f['mean']:.4f}, std over seeds {spread}\n")
        lines.append(
            f"Gaps: (config - {BASE}) / {BASE} at the same seed; mean, SE over seeds; resolution = 2 SE.\n\n"
            "| config | seeds | final validation gap per seed | mean | SE | second-half training gap per seed | mean |"
            f" SE | goal: final within {GOAL:.1%} | minutes/run |\n|---|---|---|---|---|---|---|---|---|---|"
        )
        for c in entry["configs"]:
            fg, sg = c["final_gap"], c["second_half_gap"]
            per = lambda g: ", ".join(f"{s}: {_pct(v)}" for s, v in g["per_seed"]) or "n/a"  # noqa: E731
            lines.append(
                f"| {c['config']} | {len(c['seeds'])} | {per(fg)} | {_pct(fg['mean'])} | {_pct(fg['se'])} |"
                f" {per(sg)} | {_pct(sg['mean'])} | {_pct(sg['se'])} | {c['verdict']} | {c['minutes']:.1f} |"
            )
            if c["unpaired_seeds"]:
                lines.append(f"\n{c['config']}: seeds {c['unpaired_seeds']} have no {BASE} run (left out)")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- main
def run(config: str, seed: int, args: argparse.Namespace, data: dict[str, Any]) -> dict[str, Any]:
    from lightning_zeropp.spawn import run_local_ranks

    settings = {"seed": seed, "steps": args.steps, "evals": args.evals, "ranks_per_node": args.ranks_per_node,
                "model": SIZES[args.size], "lr": args.lr, "warmup": args.warmup}  # fmt: skip
    start = time.perf_counter()
    results = run_local_ranks(_worker, args.world, config, settings, data, timeout=args.timeout)
    seconds = time.perf_counter() - start
    first = results[0]
    return {"seconds": seconds, "train_curve": first["train_curve"], "val_curve": first["val_curve"],
            "describe": first["describe"]}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="every configuration runs at each")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps per run")
    parser.add_argument("--evals", type=int, default=5, help="validation checks along the run (a divisor of --steps)")
    parser.add_argument("--val-windows", type=int, default=256, help="held-out windows each validation averages")
    parser.add_argument("--world", type=int, default=4, help="CPU ranks (t = 2: world / 2 data-parallel ranks)")
    parser.add_argument("--ranks-per-node", type=int, default=2, help="ranks per emulated node (ZeRO++'s)")
    parser.add_argument("--size", choices=list(SIZES), default="small", help="TinyLlama's shape")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    parser.add_argument("--warmup", type=int, default=10, help="linear warm-up steps")
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=DEFAULT_CONFIGS, help="in this order")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="the study file; its runs done are skipped")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds a run may take before its ranks die")
    parser.add_argument("--report-only", action="store_true", help="print the tables of the --json's runs")
    args = parser.parse_args(argv)
    if args.report_only:
        print(report(summarize(load(args.json)["runs"])))
        return
    if not 1 <= args.evals <= args.steps or args.steps % args.evals:
        parser.error("--evals must divide --steps (the last validation is at the last step)")
    if args.world % T or args.world % args.ranks_per_node or args.world // args.ranks_per_node < 2:
        parser.error(f"--world {args.world} must be a multiple of {T} and of --ranks-per-node, with 2 nodes or more")
    if args.steps < 2:
        parser.error("--steps must be 2 or more (the gaps compare the second half of the run)")
    args.model = SIZES[args.size]
    args.batch = BATCH
    regime = f"lr{args.lr:g}-warmup{args.warmup}"
    data = load(args.json)
    runs: list[dict] = data["runs"]
    setup = {k: getattr(args, k) for k in SETUP}
    plan = [(c, s, regime, args.steps) for s in args.seeds for c in args.configs]  # seed by seed
    clash = conflicts(plan, runs, setup)
    if clash:
        parser.error(f"{args.json} holds these runs with other settings; use another --json:\n  " + "\n  ".join(clash))
    todo = pending(plan, runs)  # each invocation's command is in the manifest (record.write)
    print(f"{len(plan)} runs planned, {len(plan) - len(todo)} done already, {len(todo)} to run", file=sys.stderr)

    def save() -> None:
        data["summary"] = summarize(runs)
        record.write(args.json, data, None if argv is None else [__file__, *argv])

    windows = corpus_windows(args.model["max_seq_len"]) if todo else None
    for config, seed, _, _ in todo:
        started = time.perf_counter()
        result: dict[str, Any] = {"config": config, "seed": seed, "regime": regime, "steps": args.steps, **setup}
        try:
            result.update(
                run(config, seed, args, seed_data(*windows, seed, args.steps, args.world // T, args.val_windows))
            )
        except RuntimeError as err:  # keep the other runs; a rerun tries this one again
            print(err, file=sys.stderr)
            result.update(error=str(err)[-3000:], seconds=time.perf_counter() - started)
        add_run(runs, result)
        print(f"{config} seed {seed}: {(time.perf_counter() - started) / 60:.1f} min", file=sys.stderr)
        save()
    if todo:
        save()
    mine = [r for r in runs if (r["regime"], r["steps"]) == (regime, args.steps)]
    print(report(summarize(mine)))
    print(f"wrote {args.json}" if todo else f"nothing to run: every run is in {args.json}")


if __name__ == "__main__":
    main()
