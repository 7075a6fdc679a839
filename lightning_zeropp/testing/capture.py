"""The kernel launches real training steps make, captured for the compile gate.

The gate (``lightning_zeropp.kernels.aot``) compiles every launch the strategy makes. A list written by hand beside
the collectives misses a launch added to one; this module takes the list from training instead: short
``Trainer.fit`` runs of TinyLM and of the example GPT (odd parameter sizes: a width of 44, LayerNorms beside biases, a
tied head) on spawned gloo ranks emulating 2 x 2, 3 x 2 and 4 x 2, in each configuration of :data:`CONFIGS`. The
CPU ranks compute every step with the torch twins; for each op a step calls, an observer
(``lightning_zeropp.kernels.observers``) also calls the Triton launcher on the same tensors with launching replaced
by recording (``lightning_zeropp.compat.triton.record_launches``), so the records carry what a GPU run would
specialize: dtypes, whether each buffer starts on 16 bytes, sizes, constexprs and launch options.

    python -m lightning_zeropp.testing.capture --json FILE [--topologies 2x2 3x2 4x2] [--configs NAME ...]

writes the records (plain JSON: :func:`record_of`); ``python -m lightning_zeropp.kernels.aot --captured FILE``
compiles them with the hand-picked edge shapes.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

# name -> (ZeroPPStrategy arguments, Trainer precision). Together they cover INT8 and INT4 weights, both intra-node
# gradient widths and both inter-node ones, nearest and stochastic rounding, error feedback at every residual width,
# weight deltas at both widths, one and two qgZ pieces, fp32, bf16 and fp16 compute; combined, so that a capture is four
# short fits per model and topology.
CONFIGS: dict[str, tuple[dict[str, Any], str]] = {
    "defaults, bf16-mixed": ({}, "bf16-mixed"),
    "int4 weights, int4 intra-node, stochastic, feedback 8, 16-true": (
        dict(weight_bits=4, intra_node_gradient_bits=4, gradient_rounding="stochastic", gradient_error_feedback=True),
        "16-true",
    ),
    "int8 gradients, feedback 32, weight deltas int8, one piece, 32-true": (
        dict(
            gradient_bits=8,
            gradient_error_feedback=True,
            error_feedback_bits=32,
            weight_deltas=True,
            weight_delta_bits=8,
            gradient_pieces=1,
        ),
        "32-true",
    ),  # fmt: skip
    "stochastic, feedback 16, weight deltas int4, bf16-true": (
        dict(gradient_rounding="stochastic", gradient_error_feedback=True, error_feedback_bits=16, weight_deltas=True),
        "bf16-true",
    ),
}
TOPOLOGIES = ("2x2", "3x2", "4x2")
MODELS = ("TinyLM", "example GPT")


def record_of(kernel: Any, args: tuple, kwargs: dict, grid: tuple) -> dict[str, Any]:
    """A recorded launch as plain data: the kernel's module and name; each argument a tensor's dtype and whether it
    starts on 16 bytes (all a launch specializes on), or the value; the keyword arguments (constexprs, options)."""

    def arg(value: Any) -> list:
        if isinstance(value, torch.Tensor):
            return ["tensor", str(value.dtype).removeprefix("torch."), value.data_ptr() % 16 == 0]
        return ["value", value]

    return {
        "kernel": [kernel.fn.__module__, kernel.fn.__name__],
        "args": [arg(a) for a in args],
        "kwargs": {k: v for k, v in kwargs.items()},
        "grid": list(grid),
    }


class _Recorder:
    """The observer: after each op, the op's Triton launcher on the same tensors, recording instead of launching."""

    def __init__(self, label: str) -> None:
        from lightning_zeropp.compat import triton as compat
        from lightning_zeropp.kernels import triton_ops

        self.compat, self.ops, self.label = compat, triton_ops, label
        self.records: list[dict[str, Any]] = []

    def __call__(self, tensor: torch.Tensor, spec: Any) -> None:
        with self.compat.record_launches() as launches:
            getattr(self.ops, spec.name)(tensor, spec)
        for launch in launches:
            self.records.append(dict(record_of(*launch), label=f"{self.label} {spec.name}"))


def an_extra_launch() -> None:
    """The gate's negative control: qgZ's final dequantize-reduce also quantizes its output in INT4 blocks of 96 (a
    block size nothing else uses), as a new launch added to a collective would, with no gate entry for it."""
    from lightning_zeropp import kernels as tk
    from lightning_zeropp import qgz

    real = qgz.tk.dequantize_reduce

    def with_extra(buf, *args, **kwargs):
        out = real(buf, *args, **kwargs)
        tk.quantize(out.float().flatten()[:96], 4, 96)
        return out

    qgz.tk = _Namespace(tk, dequantize_reduce=with_extra)


class _Namespace:
    """``module`` with some attributes replaced (the others read through)."""

    def __init__(self, module: Any, **replaced: Any) -> None:
        self._module, self._replaced = module, replaced

    def __getattr__(self, name: str) -> Any:
        return self._replaced[name] if name in self._replaced else getattr(self._module, name)


def capture_worker(rank: int, world_size: int, per_node: int, configs: list[str], root: str, setup: str | None = None,
                   models: tuple[str, ...] = MODELS) -> list[dict[str, Any]]:  # fmt: skip
    """One rank: a two-step ``Trainer.fit`` of TinyLM and of the example GPT in each configuration, every op's launch
    recorded (rank 0 returns the records; the ranks' launches differ only in what every rank shares). ``setup``: the
    name of a function of this module to call first (:func:`an_extra_launch`)."""
    if setup is not None:
        globals()[setup]()
    from lightning.pytorch import seed_everything
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_zeropp import ZeroPPStrategy
    from lightning_zeropp import kernels as tk
    from lightning_zeropp.testing.distributed import lightning_trainer
    from lightning_zeropp.testing.models import TinyLM
    from lightning_zeropp.testing.workers import GPT_SHAPE, example_gpt

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    x, y = torch.load(Path(root) / "data.pt", weights_only=True)
    gx, gy = torch.load(Path(root) / "gpt_data.pt", weights_only=True)
    topology = f"{world_size // per_node}x{per_node}"
    records: list[dict[str, Any]] = []
    for name in configs:
        kwargs, precision = CONFIGS[name]
        for model_name in models:
            seed_everything(0, verbose=False)
            if model_name == "TinyLM":
                model, data = (
                    TinyLM(str(Path(root) / "init.pt")),
                    TensorDataset(x[rank::world_size], y[rank::world_size]),
                )
            else:
                model = example_gpt()(**GPT_SHAPE)
                data = TensorDataset(gx[rank::world_size], gy[rank::world_size])
            recorder = _Recorder(f"captured {topology} {name} {model_name}")
            tk.observers.append(recorder)
            try:
                strategy = ZeroPPStrategy(ranks_per_node=per_node, **kwargs)
                trainer = lightning_trainer(world_size, strategy, max_steps=2, precision=precision,
                                            use_distributed_sampler=False)  # fmt: skip
                trainer.fit(model, DataLoader(data, batch_size=2, shuffle=False))
            finally:
                tk.observers.remove(recorder)
            records.extend(recorder.records)
    return records if rank == 0 else []


def capture(topologies: list[str], configs: list[str], setup: str | None = None, models: tuple[str, ...] = MODELS,
            timeout: float = 900) -> list[dict[str, Any]]:  # fmt: skip
    """The records of :func:`capture_worker` at each topology (``"NxR"``: N emulated nodes of R ranks)."""
    from lightning_zeropp.testing.distributed import spawn
    from lightning_zeropp.testing.workers import save_gpt_inputs, save_inputs

    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as root:
        save_inputs(Path(root), 32)
        save_gpt_inputs(Path(root), 32)
        for topology in topologies:
            nodes, per_node = (int(v) for v in topology.split("x"))
            # the ranks define the kernels compiled, not interpreted, whatever the caller runs under: the recorder
            # replaces the compiler's launch
            results = spawn(capture_worker, nodes * per_node, per_node, configs, root, setup, models,
                            timeout=timeout, env={"TRITON_INTERPRET": "0"})  # fmt: skip
            records.extend(results[0])
    return records


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, required=True, help="write the records here")
    parser.add_argument("--topologies", nargs="+", default=list(TOPOLOGIES), help="NODESxRANKS_PER_NODE")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    args = parser.parse_args(argv)
    records = capture(args.topologies, args.configs)
    args.json.write_text(json.dumps(records))
    kernels = sorted({r["kernel"][1] for r in records})
    print(f"{len(records)} launches captured ({', '.join(kernels)}) at {', '.join(args.topologies)}")


if __name__ == "__main__":
    main()
