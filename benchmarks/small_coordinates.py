"""What qgZ's INT4 hop does to small gradient coordinates, and what AdamW makes of it, step by step.

Gloo ranks emulating ``nodes x ranks_per_node`` (default 2 x 2) train the example GPT (a small shape: 2 layers,
n_embd 128, 4 heads, 64 bytes of context, 8 windows per rank; 0.43M parameters) on the standard library's source as
bytes, in a Fabric loop, 32-true, with the example's AdamW (betas 0.9 / 0.95, weight decay 0.1 on matrices) at a
constant lr 3e-4, ``ZeroPPStrategy()`` defaults, without and with ``gradient_error_feedback=True`` (the residual in
INT8 with a scale per block, the default, and in fp32).

Every gradient reduce-scatter qgZ runs is preceded by the exact reduce-scatter of a clone of its input (same groups,
same op, a throwaway ledger: training never sees it), and (qgZ output ``q``, exact output ``e``) of each unit's chunk
on each rank is compared in the unit's own quantization blocks (``UnitBlocks.gradients``: parameter-aligned blocks of
128; a coordinate is *small* where ``|e| < max |e| of its block / 8``, about where INT4's 7 levels round to 0; the
block maximum is that of the exact reduced gradient, while qgZ's scales come from each rank's and each node's partial
sums):

- zeroed: the share of coordinates with ``e != 0`` that arrive as exactly ``q == 0``;
- relative error ``|q - e| / |e|`` (L2 over the coordinates of a class), small coordinates and the rest;
- the same of the gradients summed over a group's steps (small: by the summed exact gradient): what a slow average
  of the gradients sees, and what error feedback corrects (it moves each step's loss into a later step);
- Adam: the update direction ``m_hat / (sqrt(v_hat) + eps)`` (lr and the decoupled weight decay left out: both are
  the same for both gradients) from the qgZ-fed moments (what the run's optimizer holds: nothing clips) stepped
  with ``q`` against the same moments stepped with ``e`` ("same state": this step's error alone), as the ratio of
  norms and the relative error; and against a shadow state fed with ``e`` from the start ("shadow": the error
  including what earlier steps left in the moments).

Sums are pooled over units, ranks and the steps of a group before the ratios are taken.

    python benchmarks/small_coordinates.py [--steps 30] [--topology 2x2] [--seed 1234] [--json FILE]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
EXAMPLE = ROOT / "examples" / "gpt"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import record  # noqa: E402

MODEL = dict(block_size=64, n_layer=2, n_head=4, n_embd=128)
CONFIGS = {
    "qgz": dict(),
    "qgz_feedback": dict(gradient_error_feedback=True),  # the residual's default width: INT8 codes, a scale per block
    "qgz_feedback_fp32": dict(gradient_error_feedback=True, error_feedback_bits=32),
    "qgz_sr": dict(gradient_rounding="stochastic"),
    "qgz_rot": dict(gradient_rotation="hadamard"),
    "qgz_int8": dict(gradient_bits=8),  # the inter-node hop in INT8: twice its bytes
}
LR, BETAS, EPS, BATCH = 3e-4, (0.9, 0.95), 1e-8, 8
MOMENTUM = 0.9  # the SGD shadows' (heavy ball, no dampening): an optimizer whose step is linear in the gradient
SMALL = 1 / 8  # a coordinate below this share of its block's largest is "small"
SUMS = (
    "count", "nonzero", "zeroed", "err2", "ref2",  # gradients
    "adam_q2", "adam_same2", "adam_same_diff2", "adam_shadow2", "adam_shadow_diff2",  # Adam directions
    "moved_nonzero", "adam_moved_err2", "adam_moved_ref2", "adam_moved_against",  # moved over a group of steps
    "sgd_moved_err2", "sgd_moved_ref2", "sgd_moved_against",
)  # fmt: skip


def step_groups(steps: int) -> list[tuple[int, int]]:
    """The table's groups of steps: 1-5, 6-15, 16-30, then every 15, the last one cut at ``steps``."""
    bounds = [(1, 5), (6, 15), (16, 30)] + [(lo, lo + 14) for lo in range(31, steps + 1, 15)]
    return [(lo, min(hi, steps)) for lo, hi in bounds if lo <= steps]


def block_ids(numel: int, starts: tuple[int, ...] | None, block_size: int):
    """Each element's block number: ``starts`` from a ``Blocks`` (parameter-aligned), or flat blocks of
    ``block_size`` where a unit has none."""
    import torch

    if starts is None:
        return torch.arange(numel) // block_size
    lengths = torch.tensor(starts[1:]) - torch.tensor(starts[:-1])
    return torch.repeat_interleave(torch.arange(len(lengths)), lengths)


def small_mask(exact, ids, share: float = SMALL):
    """Where ``|exact|`` is below ``share`` of the largest ``|exact|`` of its block (``ids``: each element's block)."""
    import torch

    mag = exact.abs()
    top = torch.zeros(int(ids.max()) + 1 if ids.numel() else 0, dtype=mag.dtype).scatter_reduce_(
        0, ids, mag, "amax", include_self=True
    )
    return mag < share * top[ids]


def coordinate_sums(q, e, small, adam: dict[str, Any] | None = None) -> dict[str, dict[str, float]]:
    """Sums of one comparison, by class ("small", "rest"): elements, nonzero exact, zeroed (``e != 0``, ``q == 0``),
    ``|q - e|^2``, ``|e|^2``, and with ``adam`` (the directions ``q``, ``same``, ``shadow`` of :class:`ShadowAdam`)
    the squared norms of the directions and of their differences."""
    out = {}
    for name, mask in (("small", small), ("rest", ~small)):
        qm, em = q[mask].double(), e[mask].double()
        row = {
            "count": float(mask.sum()),
            "nonzero": float((em != 0).sum()),
            "zeroed": float(((em != 0) & (qm == 0)).sum()),
            "err2": float((qm - em).square().sum()),
            "ref2": float(em.square().sum()),
        }
        if adam is not None:
            uq, us, uh = (adam[k][mask].double() for k in ("q", "same", "shadow"))
            row.update(
                adam_q2=float(uq.square().sum()),
                adam_same2=float(us.square().sum()),
                adam_same_diff2=float((uq - us).square().sum()),
                adam_shadow2=float(uh.square().sum()),
                adam_shadow_diff2=float((uq - uh).square().sum()),
            )
        out[name] = row
    return out


def moved_sums(moved: dict[str, Any], small) -> dict[str, dict[str, float]]:
    """Sums comparing how far each coordinate moved over a group of steps, by class: ``moved`` holds the summed
    update directions of Adam (``adam_q``: the run's moments, fed with qgZ's gradients; ``adam_shadow``: fed with the
    exact ones) and of SGD with momentum (``sgd_q``, ``sgd_shadow``). ``*_against`` counts the coordinates (of those
    the exact shadow moved) that moved the other way."""
    out = {}
    for name, mask in (("small", small), ("rest", ~small)):
        row: dict[str, float] = {}
        for opt in ("adam", "sgd"):
            mq, me = moved[f"{opt}_q"][mask].double(), moved[f"{opt}_shadow"][mask].double()
            row[f"{opt}_moved_err2"] = float((mq - me).square().sum())
            row[f"{opt}_moved_ref2"] = float(me.square().sum())
            row[f"{opt}_moved_against"] = float(((me != 0) & (mq * me < 0)).sum())
            if opt == "adam":
                row["moved_nonzero"] = float((me != 0).sum())
        out[name] = row
    return out


def ratios(sums: dict[str, dict[str, float]]) -> dict[str, float | None]:
    """The figures of pooled :func:`coordinate_sums`."""

    def div(a: float, b: float, root: bool = False) -> float | None:
        if not b:
            return None
        return (a / b) ** 0.5 if root else a / b

    s, r = sums["small"], sums["rest"]
    out = {
        "zeroed": div(s["zeroed"] + r["zeroed"], s["nonzero"] + r["nonzero"]),
        "zeroed_small": div(s["zeroed"], s["nonzero"]),
        "small_share": div(s["count"], s["count"] + r["count"]),
        "rel_err_small": div(s["err2"], s["ref2"], True),
        "rel_err_rest": div(r["err2"], r["ref2"], True),
        "rel_err": div(s["err2"] + r["err2"], s["ref2"] + r["ref2"], True),
    }
    for name, row in (("small", s), ("rest", r)):
        if "adam_q2" in row:
            out[f"adam_{name}_norm_ratio"] = div(row["adam_q2"], row["adam_same2"], True)
            out[f"adam_{name}_rel_err"] = div(row["adam_same_diff2"], row["adam_same2"], True)
            out[f"adam_{name}_shadow_norm_ratio"] = div(row["adam_q2"], row["adam_shadow2"], True)
            out[f"adam_{name}_shadow_rel_err"] = div(row["adam_shadow_diff2"], row["adam_shadow2"], True)
        if "adam_moved_ref2" in row:
            for opt in ("adam", "sgd"):
                out[f"{opt}_{name}_moved_rel_err"] = div(row[f"{opt}_moved_err2"], row[f"{opt}_moved_ref2"], True)
                out[f"{opt}_{name}_moved_against"] = div(row[f"{opt}_moved_against"], row["moved_nonzero"])
    return out


def pooled(rows: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    return {c: {k: sum(row[c].get(k, 0.0) for row in rows) for k in SUMS} for c in ("small", "rest")}


class ShadowAdam:
    """Adam's moments for one flat gradient chunk, twice: fed with qgZ's gradients (the run's optimizer) and with the
    exact ones (the shadow), and SGD's momentum buffers likewise (``MOMENTUM``: the contrast, an optimizer that does
    not divide each coordinate by its own gradient scale). :meth:`step` returns the update directions of this step:
    Adam's ``q``, ``same`` and ``shadow``, SGD's ``sgd_q`` and ``sgd_shadow``."""

    def __init__(self, numel: int, betas: tuple[float, float] = BETAS, eps: float = EPS) -> None:
        import torch

        self.b1, self.b2 = betas
        self.eps = eps
        self.t = 0
        self.m, self.v, self.ms, self.vs = (torch.zeros(numel, dtype=torch.float64) for _ in range(4))
        self.bq, self.bs = (torch.zeros(numel, dtype=torch.float64) for _ in range(2))

    def _moments(self, m, v, g):
        return self.b1 * m + (1 - self.b1) * g, self.b2 * v + (1 - self.b2) * g.square()

    def _direction(self, m, v):
        return (m / (1 - self.b1**self.t)) / ((v / (1 - self.b2**self.t)).sqrt() + self.eps)

    def step(self, q, e) -> dict[str, Any]:
        q, e = q.double(), e.double()
        self.t += 1
        m, v = self._moments(self.m, self.v, q)
        same = self._direction(*self._moments(self.m, self.v, e))
        self.ms, self.vs = self._moments(self.ms, self.vs, e)
        self.m, self.v = m, v
        self.bq, self.bs = MOMENTUM * self.bq + q, MOMENTUM * self.bs + e
        return {
            "q": self._direction(m, v), "same": same, "shadow": self._direction(self.ms, self.vs),
            "sgd_q": self.bq.clone(), "sgd_shadow": self.bs.clone(),
        }  # fmt: skip


class Recorder:
    """Wraps ``ZeroPPComms.reduce_scatter`` in this process: the exact reduce-scatter first (on a clone, with a
    throwaway ledger), then qgZ as the run has it; the comparison's sums by optimizer step and unit."""

    def __init__(self, groups: list[tuple[int, int]]) -> None:
        self.groups = groups
        self.steps: dict[int, dict[str, dict[str, dict[str, float]]]] = {}
        self._adam: dict[str, ShadowAdam] = {}
        self._ids: dict[tuple[str, int], Any] = {}
        # (group, unit) -> [sum of q, sum of e, block ids, {summed update directions}]
        self._summed: dict[tuple[int, str], list[Any]] = {}

    def install(self) -> None:
        import torch

        from lightning_zeropp import comm
        from lightning_zeropp.collectives import split_reduce_op
        from lightning_zeropp.ledger import CommLedger

        original = comm.ZeroPPComms.reduce_scatter
        recorder = self

        def reduce_scatter(self, output, input, fsdp_group, op, unit=None):
            if not self.quantizes_gradients():
                return original(self, output, input, fsdp_group, op, unit)
            base_op, premul = split_reduce_op(op)
            exact = torch.empty_like(output)
            comm.exact_reduce_scatter(
                exact, input.clone(), base_op, premul, self.ensure_groups(), CommLedger(self.topology)
            )
            original(self, output, input, fsdp_group, op, unit)
            recorder.add(self, unit, output.detach().reshape(-1).float(), exact.reshape(-1).float())

        comm.ZeroPPComms.reduce_scatter = reduce_scatter

    def add(self, comms, unit, q, e) -> None:
        name = unit.name if unit is not None else "<unit>"
        key = (name, q.numel())
        if key not in self._ids:
            blocks = unit.gradients(q.numel()) if unit is not None else None
            starts = blocks.starts if blocks is not None else None
            self._ids[key] = block_ids(q.numel(), starts, comms.config.gradient_block_size)
        adam = self._adam.setdefault(name, ShadowAdam(q.numel()))
        step = comms.steps + 1
        directions = adam.step(q, e)
        sums = coordinate_sums(q, e, small_mask(e, self._ids[key]), directions)
        self.steps.setdefault(step, {})[name] = sums
        group = next(i for i, (lo, hi) in enumerate(self.groups) if lo <= step <= hi)
        summed = self._summed.setdefault((group, name), [0.0, 0.0, self._ids[key], {}])
        summed[0], summed[1] = summed[0] + q.double(), summed[1] + e.double()
        moved = summed[3]
        for k, d in (("adam_q", directions["q"]), ("adam_shadow", directions["shadow"]),
                     ("sgd_q", directions["sgd_q"]), ("sgd_shadow", directions["sgd_shadow"])):  # fmt: skip
            moved[k] = moved.get(k, 0.0) + d

    def summed(self) -> dict[int, dict[str, dict[str, dict[str, float]]]]:
        """Per group of steps and unit: the sums comparing qgZ's gradients summed over the group's steps with the
        exact ones summed (small: by the summed exact gradient's blocks), what a slow average of the gradients sees
        and error feedback corrects; and how far each coordinate moved over the group under Adam and under SGD with
        momentum, fed with qgZ's gradients against fed with the exact ones (:func:`moved_sums`)."""
        out: dict[int, dict[str, dict[str, dict[str, float]]]] = {}
        for (group, name), (q, e, ids, moved) in self._summed.items():
            small = small_mask(e, ids)
            sums = coordinate_sums(q, e, small)
            for c, row in moved_sums(moved, small).items():
                sums[c].update(row)
            out.setdefault(group, {})[name] = sums
        return out


def quiet() -> None:
    import logging
    import warnings

    for name in ("lightning.pytorch", "lightning.fabric", "lightning_zeropp"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def _worker(
    rank: int, world_size: int, per_node: int, strategy_kwargs: dict, steps: int, model: dict, seed: int
) -> dict:
    quiet()
    import torch
    import torch.nn.functional as F
    from data import ByteWindows, load_corpus
    from lightning.fabric import Fabric
    from model import GPTModule

    from lightning_zeropp.fabric import ZeroPPStrategy

    recorder = Recorder(step_groups(steps))
    recorder.install()
    torch.manual_seed(seed)  # the initial weights (the data are the corpus's first windows, in order)
    windows = ByteWindows(load_corpus(max_bytes=world_size * steps * BATCH * (model["block_size"] + 1)),
                          model["block_size"])  # fmt: skip
    fabric = Fabric(accelerator="cpu", devices=world_size, precision="32-true",
                    strategy=ZeroPPStrategy(ranks_per_node=per_node, **strategy_kwargs))  # fmt: skip
    fabric.launch()
    module = GPTModule(**model, learning_rate=LR, warmup_steps=0)
    module.configure_model()
    module = fabric.setup_module(module)
    optimizer = fabric.setup_optimizers(module.configure_optimizers()["optimizer"])  # constant lr: no scheduler
    losses = []
    for step in range(steps):
        first = (step * world_size + rank) * BATCH
        x, y = (torch.stack(t) for t in zip(*(windows[i] for i in range(first, first + BATCH)), strict=True))
        loss = F.cross_entropy(module(x).float().view(-1, 256), y.reshape(-1))
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(fabric.all_reduce(loss.detach(), reduce_op="mean")))
    params = sum(p.numel() for p in module.parameters())
    return {"steps": recorder.steps, "summed": recorder.summed(), "losses": losses, "params": params}


def measure(steps: int, nodes: int, per_node: int, model: dict, configs: list[str], seed: int = 1234) -> list[dict]:
    from lightning_zeropp.spawn import run_local_ranks

    rows = []
    for config in configs:
        results = run_local_ranks(
            _worker, nodes * per_node, per_node, CONFIGS[config], steps, model, seed,
            sys_path=[str(EXAMPLE)], timeout=1800,
        )  # fmt: skip
        per_step = []
        for step in range(1, steps + 1):
            units = [u for r in results for u in r["steps"].get(step, {}).values()]
            per_step.append(pooled(units))
        units = sorted({u for r in results for s in r["steps"].values() for u in s})
        per_unit = {
            u: ratios(pooled([r["steps"][s][u] for r in results for s in r["steps"] if u in r["steps"][s]]))
            for u in units
        }
        groups = []
        late_summed = []  # the groups of the second half's steps, for "late"
        for i, (lo, hi) in enumerate(step_groups(steps)):
            group_sums = [u for r in results for u in r["summed"].get(i, {}).values()]
            if lo > steps // 2:
                late_summed += group_sums
            summed = ratios(pooled(group_sums))
            groups.append(
                {
                    "steps": [lo, hi],
                    **ratios(pooled(per_step[lo - 1 : hi])),
                    "summed_rel_err_small": summed["rel_err_small"],
                    "summed_rel_err_rest": summed["rel_err_rest"],
                    "summed_small_share": summed["small_share"],
                    **{k: v for k, v in summed.items() if "_moved_" in k},
                }
            )
        rows.append(
            {
                "config": config,
                "strategy": CONFIGS[config],
                "nodes": nodes,
                "ranks_per_node": per_node,
                "model": model,
                "params": results[0]["params"],
                "seed": seed,
                "optimizer": {"name": "AdamW", "lr": LR, "betas": list(BETAS), "eps": EPS},
                "sgd_shadow_momentum": MOMENTUM,
                "batch_per_rank": BATCH,
                "small_below": SMALL,
                "blocks": "UnitBlocks.gradients (parameter-aligned, gradient_block_size)",
                "groups": groups,
                "late": late_figures(per_step[steps // 2 :], late_summed),
                "per_step": [{"step": i + 1, **ratios(s)} for i, s in enumerate(per_step)],
                "per_unit": per_unit,
                "losses": results[0]["losses"],
            }
        )
    return rows


def late_figures(per_step: list, summed: list) -> dict[str, float | None]:
    """The second half of a run in one row: the per-step figures pooled over its steps, the moved ones over the
    groups that start in it (``summed``: their :meth:`Recorder.summed` sums)."""
    moved = ratios(pooled(summed)) if summed else {}
    return {**ratios(pooled(per_step)), **{k: v for k, v in moved.items() if "_moved_" in k}}


def _f(v: float | None, spec: str = ".3f") -> str:
    return "n/a" if v is None else format(v, spec)


def table(rows: list[dict]) -> str:
    """Three tables: the gradients qgZ delivers, the AdamW directions they make, and how far each coordinate moved
    over a group of steps under AdamW and under SGD with momentum, against the same optimizer fed exact gradients."""
    lines = [
        "| qgZ | steps | zeroed (of e != 0) | zeroed among small | small share | rel err small | rel err rest |"
        " rel err, all | summed over the steps: rel err small | rest | loss (last step) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        for g in row["groups"]:
            lo, hi = g["steps"]
            lines.append(
                f"| {_feedback(row)} | {lo}-{hi} | {_f(g['zeroed'])} | {_f(g['zeroed_small'])} |"
                f" {_f(g['small_share'])} | {_f(g['rel_err_small'])} | {_f(g['rel_err_rest'])} |"
                f" {_f(g.get('rel_err'))} | {_f(g['summed_rel_err_small'])} | {_f(g['summed_rel_err_rest'])} |"
                f" {row['losses'][hi - 1]:.3f} |"
            )
    lines += [
        "",
        "| qgZ | steps | Adam small: norm ratio | rel err | shadow: norm ratio | rel err |"
        " Adam rest: norm ratio | rel err | shadow: norm ratio | rel err |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        for g in row["groups"]:
            figures = " | ".join(
                _f(g[f"adam_{c}_{k}"])
                for c in ("small", "rest")
                for k in ("norm_ratio", "rel_err", "shadow_norm_ratio", "shadow_rel_err")
            )
            lines.append(f"| {_feedback(row)} | {g['steps'][0]}-{g['steps'][1]} | {figures} |")
    lines += [
        "",
        "| qgZ | steps | moved, Adam small: rel err | against | SGD small: rel err | against |"
        " Adam rest: rel err | against | SGD rest: rel err | against |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        for g in row["groups"]:
            figures = " | ".join(
                _f(g.get(f"{opt}_{c}_moved_{k}"))
                for c in ("small", "rest")
                for opt in ("adam", "sgd")
                for k in ("rel_err", "against")
            )
            lines.append(f"| {_feedback(row)} | {g['steps'][0]}-{g['steps'][1]} | {figures} |")
    lines += [
        "",
        "| qgZ, second half | rel err, all | rel err rest | Adam shadow: norm ratio small | rest |"
        " shadow rel err small | rest | moved, Adam small | rest | SGD small | rest |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        g = row["late"]
        keys = ("rel_err", "rel_err_rest", "adam_small_shadow_norm_ratio", "adam_rest_shadow_norm_ratio",
                "adam_small_shadow_rel_err", "adam_rest_shadow_rel_err", "adam_small_moved_rel_err",
                "adam_rest_moved_rel_err", "sgd_small_moved_rel_err", "sgd_rest_moved_rel_err")  # fmt: skip
        lines.append(f"| {_feedback(row)} | " + " | ".join(_f(g.get(k)) for k in keys) + " |")
    return "\n".join(lines)


def _feedback(row: dict) -> str:
    strategy = row["strategy"]
    if strategy.get("gradient_rounding") == "stochastic":
        return "stochastic rounding"
    if strategy.get("gradient_rotation", "none") != "none":
        return f"rotation ({strategy['gradient_rotation']})"
    if strategy.get("gradient_bits", 4) != 4:
        return f"INT{strategy['gradient_bits']} inter-node hop"
    if not strategy.get("gradient_error_feedback"):
        return "off"
    return {8: "on, INT8 residual", 16: "on, bf16 residual", 32: "on, fp32 residual"}[
        strategy.get("error_feedback_bits", 8)
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--topology", default="2x2", help="NODESxRANKS_PER_NODE")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--n-layer", type=int, default=MODEL["n_layer"])
    parser.add_argument("--n-embd", type=int, default=MODEL["n_embd"])
    parser.add_argument("--seed", type=int, default=1234, help="the initial weights")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = parser.parse_args(argv)
    nodes, per_node = (int(v) for v in args.topology.split("x"))
    model = dict(MODEL, n_layer=args.n_layer, n_embd=args.n_embd)
    rows = measure(args.steps, nodes, per_node, model, args.configs, args.seed)
    print(table(rows))
    if args.json:
        record.write(args.json, rows, None if argv is None else [__file__, *argv])
        print(f"wrote {args.json}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
