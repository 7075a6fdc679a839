"""Can AdamW's second moment be cleared of qgZ's rounding noise, at zero bytes? A probe before any runtime code.

qgZ's defaults make AdamW's steps 0.4-0.5% shorter: nearest rounding's error on the INT4 inter-node hop adds its
variance to every gradient that the second moment ``v`` averages (``benchmarks/small_coordinates.py``; the lr checks in
results show a step that much shorter costs the defaults' whole second-half gap). The rank that sums the K pieces
of a chunk (qgZ step 5) knows each piece's block scales ``s_k`` and codes; a rounding error of a code that is not 0 is
close to uniform over one step, variance ``s_k^2 / 12``. So that rank can estimate the noise variance of each reduced
coordinate, ``sigma^2 = multiplier^2 * sum_k [code_k != 0] s_k^2 / 12`` ("codes != 0"; or over every code: "every
code", which overestimates where a coordinate is much smaller than half a step and rounds to 0 with an error of its own
size), without a byte more on the wire, and AdamW can feed ``v`` with ``g^2 - sigma^2`` in place of ``g^2``.

Gloo ranks emulating ``nodes x ranks_per_node`` (default 2 x 2) train the small example GPT of
``small_coordinates.py`` with ``ZeroPPStrategy()`` defaults (AdamW 0.9 / 0.95, constant lr 3e-4, fp32). At every step
and on every rank, each unit's chunk is reduced exactly as well (on a clone, outside training), and these Adam states
follow the run's trajectory, each fed the same qgZ gradient ``q`` in its first moment:

- ``plain``: ``v`` fed ``q^2``: the run's own optimizer;
- ``v exact``: ``v`` fed ``e^2`` (the exact reduced gradient): the best any correction of ``v`` can do;
- ``every code`` / ``codes != 0``: ``v`` fed ``q^2 - sigma^2``, and never below ``FLOOR`` of the ``plain`` update
  (``max(b2 v + (1 - b2)(q^2 - sigma^2), FLOOR * (b2 v + (1 - b2) q^2))``: a step can grow at most 1 / sqrt(FLOOR)).

Each is compared with an Adam state fed ``e`` in both moments (the exact-fed shadow), over the second half's steps:
the length of each update's component along the shadow's (``sum u * s / sum s^2``: the effective learning rate, which
noise orthogonal to the exact update does not lengthen; 1 is exact), the ratio of the directions' norms, and their
relative distance, for small coordinates (``|e|`` below 1/8 of the block's largest) and the rest. The estimator's
calibration is ``sum sigma^2 / sum (q - e)^2`` (1 is unbiased) by class; the floor's share is where it bound.

    python benchmarks/adam_noise.py [--steps 150] [--topology 2x2] [--seeds 1 2 3] [--configs qgz qgz_sr] [--json FILE]

``--configs`` takes ``small_coordinates.py``'s configurations (``qgz``: the defaults; ``qgz_sr``, ``qgz_feedback``,
...); the estimate uses the runtime's factor for each (``moments.noise_factor``: 1/12, 1/6 with stochastic rounding,
twice that with error feedback).
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

FLOOR = 0.5
VARIANTS = ("plain", "v_exact", "every_code", "codes_nonzero")
CLASSES = ("small", "rest")
SUMS = ("u2", "shadow2", "diff2", "dot", "floored", "count")  # per variant and class
EST = ("var_every", "var_nonzero", "err2")  # per class: the estimators' and the true squared error's sums


class NoiseCapture:
    """Wraps qgZ's step 5 (``qgz._finish``) in this process: from the K received pieces of each stage, the noise
    variance estimates of the output's coordinates, by the output's storage, for every code and for codes != 0."""

    def __init__(self, factor: float = 1 / 12) -> None:
        self.factor = factor  # the variance of one element's error in squared scales (moments.noise_factor)
        self.by_output: dict[int, tuple[Any, Any]] = {}

    def install(self) -> None:
        import torch

        from lightning_zeropp import kernels as tk
        from lightning_zeropp import qgz
        from lightning_zeropp.kernels import layout, reference

        original = qgz._finish
        capture = self

        def finish(reduction, stage, inter, out, *rest):
            original(reduction, stage, inter, out, *rest)
            g = reduction.gradients
            bits, size, blocks = g.inter_bits, stage.size, stage.blocks
            recv = inter.recv.view(-1, inter.recv.shape[-1])
            values = reference._dequantize_rows(recv, size, bits, g.block_size, blocks)  # (K, size)
            if blocks is not None:
                offset, count = blocks.scale_offset(bits), blocks.count
                lengths = torch.tensor(blocks.starts).diff()
            else:
                offset, count = layout.scale_offset(size, bits), layout.num_blocks(size, g.block_size)
                lengths = torch.full((count,), g.block_size)
                if size % g.block_size:
                    lengths[-1] = size % g.block_size
            scales = recv[:, offset : offset + 4 * count].contiguous().view(torch.float32)  # (K, count)
            squares = scales.double().square()
            if reduction.rotation_seed(stage) is not None:  # as the runtime: the inverse rotation spreads the error
                squares = squares * qgz._unrotated_share(stage, g.block_size, squares.device).double()
            step2 = torch.repeat_interleave(squares, lengths, dim=1) * capture.factor  # (K, size)
            m2 = float(reduction.multiplier) ** 2
            every = step2.sum(0) * m2
            nonzero = (step2 * (values != 0)).sum(0) * m2
            key = out.data_ptr()
            if key not in capture.by_output:
                capture.by_output[key] = (torch.zeros(out.numel(), dtype=torch.float64),
                                          torch.zeros(out.numel(), dtype=torch.float64))  # fmt: skip
            ev, nz = capture.by_output[key]
            ev[stage.start : stage.start + size] = every
            nz[stage.start : stage.start + size] = nonzero

        assert tk is not None
        qgz._finish = finish

    def take(self, output) -> tuple[Any, Any]:
        return self.by_output.pop(output.data_ptr())


class Moments:
    """The Adam states of :data:`VARIANTS` and the exact-fed shadow for one flat chunk."""

    def __init__(self, numel: int, betas: tuple[float, float], eps: float) -> None:
        import torch

        self.b1, self.b2, self.eps, self.t = betas[0], betas[1], eps, 0
        self.m = torch.zeros(numel, dtype=torch.float64)  # fed q: shared by every variant
        self.v = {k: torch.zeros(numel, dtype=torch.float64) for k in VARIANTS}
        self.ms, self.vs = (torch.zeros(numel, dtype=torch.float64) for _ in range(2))

    def _direction(self, m, v):
        return (m / (1 - self.b1**self.t)) / ((v.clamp_min(0) / (1 - self.b2**self.t)).sqrt() + self.eps)

    def step(self, q, e, var_every, var_nonzero) -> tuple[dict[str, Any], dict[str, Any], Any]:
        """Steps every state; returns each variant's direction, where its floor bound, and the shadow's direction."""
        b1, b2 = self.b1, self.b2
        self.t += 1
        self.m = b1 * self.m + (1 - b1) * q
        self.ms, self.vs = b1 * self.ms + (1 - b1) * e, b2 * self.vs + (1 - b2) * e.square()
        feeds = {"plain": q.square(), "v_exact": e.square(), "every_code": q.square() - var_every,
                 "codes_nonzero": q.square() - var_nonzero}  # fmt: skip
        directions, floored = {}, {}
        for k, feed in feeds.items():
            v = b2 * self.v[k] + (1 - b2) * feed
            if k in ("every_code", "codes_nonzero"):
                floor = FLOOR * (b2 * self.v[k] + (1 - b2) * q.square())
                floored[k] = v < floor
                v = torch_max(v, floor)
            self.v[k] = v
            directions[k] = self._direction(self.m, v)
        return directions, floored, self._direction(self.ms, self.vs)


def torch_max(a, b):
    import torch

    return torch.maximum(a, b)


def _worker(rank: int, world_size: int, per_node: int, steps: int, model: dict, seed: int, config: str) -> dict:
    import small_coordinates as sc

    sc.quiet()
    import torch
    import torch.nn.functional as F
    from data import ByteWindows, load_corpus
    from lightning.fabric import Fabric
    from model import GPTModule

    from lightning_zeropp import comm
    from lightning_zeropp.collectives import split_reduce_op
    from lightning_zeropp.fabric import ZeroPPStrategy
    from lightning_zeropp.ledger import CommLedger
    from lightning_zeropp.moments import noise_factor

    kwargs = sc.CONFIGS[config]
    decay = kwargs.get("error_feedback_decay", 1.0) if kwargs.get("gradient_error_feedback") else None
    capture = NoiseCapture(noise_factor(kwargs.get("gradient_rounding", "nearest"), decay))
    capture.install()
    states: dict[str, Moments] = {}
    ids: dict[tuple[str, int], Any] = {}
    late: dict[str, dict[str, dict[str, float]]] = {v: {c: dict.fromkeys(SUMS, 0.0) for c in CLASSES} for v in VARIANTS}
    est = {c: dict.fromkeys(EST, 0.0) for c in CLASSES}
    norm_by_step: list[dict[str, float]] = []
    original = comm.ZeroPPComms.reduce_scatter
    step_sums: dict[str, list[float]] = {}

    def reduce_scatter(self, output, input, fsdp_group, op, unit=None):
        if not self.quantizes_gradients():
            return original(self, output, input, fsdp_group, op, unit)
        base_op, premul = split_reduce_op(op)
        exact = torch.empty_like(output)
        comm.exact_reduce_scatter(exact, input.clone(), base_op, premul, self.ensure_groups(),
                                  CommLedger(self.topology))  # fmt: skip
        original(self, output, input, fsdp_group, op, unit)
        var_every, var_nonzero = capture.take(output.view(-1))
        q, e = output.detach().reshape(-1).double(), exact.reshape(-1).double()
        name = unit.name if unit is not None else "<unit>"
        key = (name, q.numel())
        if key not in ids:
            blocks = unit.gradients(q.numel()) if unit is not None else None
            ids[key] = sc.block_ids(q.numel(), blocks.starts if blocks is not None else None,
                                    self.config.gradient_block_size)  # fmt: skip
        small = sc.small_mask(e, ids[key])
        state = states.setdefault(name, Moments(q.numel(), sc.BETAS, sc.EPS))
        directions, floored, shadow = state.step(q, e, var_every, var_nonzero)
        step = self.steps + 1
        for v in VARIANTS:
            row = step_sums.setdefault(v, [0.0, 0.0])
            row[0] += float(directions[v].square().sum())
            row[1] += float(shadow.square().sum())
        if step <= steps // 2:
            return
        for c, mask in (("small", small), ("rest", ~small)):
            for v in VARIANTS:
                u, s = directions[v][mask], shadow[mask]
                row = late[v][c]
                row["u2"] += float(u.square().sum())
                row["shadow2"] += float(s.square().sum())
                row["diff2"] += float((u - s).square().sum())
                row["dot"] += float((u * s).sum())
                row["count"] += float(mask.sum())
                if v in floored:
                    row["floored"] += float(floored[v][mask].sum())
            est[c]["var_every"] += float(var_every[mask].sum())
            est[c]["var_nonzero"] += float(var_nonzero[mask].sum())
            est[c]["err2"] += float((q - e)[mask].square().sum())

    comm.ZeroPPComms.reduce_scatter = reduce_scatter
    torch.manual_seed(seed)
    windows = ByteWindows(load_corpus(max_bytes=world_size * steps * sc.BATCH * (model["block_size"] + 1)),
                          model["block_size"])  # fmt: skip
    fabric = Fabric(accelerator="cpu", devices=world_size, precision="32-true",
                    strategy=ZeroPPStrategy(ranks_per_node=per_node, **kwargs))  # fmt: skip
    fabric.launch()
    module = GPTModule(**model, learning_rate=sc.LR, warmup_steps=0)
    module.configure_model()
    module = fabric.setup_module(module)
    optimizer = fabric.setup_optimizers(module.configure_optimizers()["optimizer"])
    losses = []
    for step in range(steps):
        first = (step * world_size + rank) * sc.BATCH
        x, y = (torch.stack(t) for t in zip(*(windows[i] for i in range(first, first + sc.BATCH)), strict=True))
        loss = F.cross_entropy(module(x).float().view(-1, 256), y.reshape(-1))
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(fabric.all_reduce(loss.detach(), reduce_op="mean")))
        norm_by_step.append({v: (a / b) ** 0.5 if b else None for v, (a, b) in step_sums.items()})
        step_sums.clear()
    return {"late": late, "estimates": est, "losses": losses, "norm_by_step": norm_by_step}


def summarize(results: list[dict]) -> dict[str, Any]:
    """Pools the ranks' second-half sums into the figures of the table."""
    out: dict[str, Any] = {"variants": {}, "calibration": {}}
    for v in VARIANTS:
        row = {}
        for c in CLASSES:
            s = {k: sum(r["late"][v][c][k] for r in results) for k in SUMS}
            row[c] = {
                "norm_ratio": (s["u2"] / s["shadow2"]) ** 0.5 if s["shadow2"] else None,
                "rel_err": (s["diff2"] / s["shadow2"]) ** 0.5 if s["shadow2"] else None,
                "along": s["dot"] / s["shadow2"] if s["shadow2"] else None,
                "floored": s["floored"] / s["count"] if s["count"] else None,
            }
        out["variants"][v] = row
    for c in CLASSES:
        s = {k: sum(r["estimates"][c][k] for r in results) for k in EST}
        out["calibration"][c] = {
            "every_code": s["var_every"] / s["err2"] if s["err2"] else None,
            "codes_nonzero": s["var_nonzero"] / s["err2"] if s["err2"] else None,
        }
    return out


def _f(v: float | None, spec: str = ".4f") -> str:
    return "n/a" if v is None else format(v, spec)


def table(rows: list[dict]) -> str:
    lines = [
        "| qgZ | seed | AdamW's v fed | step along exact-fed's, small | rest | step length vs exact-fed, small | rest |"
        " direction error, small | rest | floor bound, small | rest |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        for v, r in row["summary"]["variants"].items():
            lines.append(
                f"| {row.get('config', 'qgz')} | {row['seed']} | {v} | {_f(r['small']['along'])} |"
                f" {_f(r['rest']['along'])} |"
                f" {_f(r['small']['norm_ratio'])} | {_f(r['rest']['norm_ratio'])} |"
                f" {_f(r['small']['rel_err'])} | {_f(r['rest']['rel_err'])} | {_f(r['small']['floored'], '.3f')} |"
                f" {_f(r['rest']['floored'], '.3f')} |"
            )
    lines += ["", "| qgZ | seed | estimate / true squared error | small | rest |", "|---|---|---|---|---|"]
    for row in rows:
        cal = row["summary"]["calibration"]
        for k in ("every_code", "codes_nonzero"):
            lines.append(f"| {row.get('config', 'qgz')} | {row['seed']} | {k} | {_f(cal['small'][k], '.3f')} |"
                         f" {_f(cal['rest'][k], '.3f')} |")  # fmt: skip
    return "\n".join(lines)


def measure(steps: int, nodes: int, per_node: int, model: dict, seed: int, config: str = "qgz") -> dict:
    from lightning_zeropp.spawn import run_local_ranks

    results = run_local_ranks(_worker, nodes * per_node, per_node, steps, model, seed, config,
                              sys_path=[str(EXAMPLE), str(BENCH)], timeout=3600)  # fmt: skip
    return {
        "config": config, "seed": seed, "steps": steps, "nodes": nodes, "ranks_per_node": per_node, "model": model,
        "floor": FLOOR,
        "summary": summarize(results), "losses": results[0]["losses"], "norm_by_step": results[0]["norm_by_step"],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    import small_coordinates as sc

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--topology", default="2x2", help="NODESxRANKS_PER_NODE")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1])
    parser.add_argument("--configs", nargs="+", default=["qgz"], choices=list(sc.CONFIGS),
                        help="small_coordinates.py's configurations (qgz: the defaults)")  # fmt: skip
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    nodes, per_node = (int(v) for v in args.topology.split("x"))
    rows = [measure(args.steps, nodes, per_node, dict(sc.MODEL), seed, c) for c in args.configs for seed in args.seeds]
    print(table(rows))
    if args.json:
        record.write(args.json, rows, None if argv is None else [__file__, *argv])
        print(f"wrote {args.json}")


if __name__ == "__main__":
    sys.path[:0] = [str(ROOT), str(BENCH)]
    main()
