"""GPU smoke test for the Triton path (needs a CUDA device): qgZ's and qwZ's kernel pipelines at production shapes,
bit for bit against the torch twins on the CPU, and a short training run with ``kernel_backend="triton"``.

    python benchmarks/gpu_smoke.py [--steps 30] [--json benchmarks/data/kernels/gpu_smoke.json]

The all-to-alls of qgZ are emulated in one process (a reshape of the buffers every rank would exchange), so the five
steps run with the same shapes and kernels as on N x K ranks. The training run is one process: it checks that the
strategy trains with the Triton kernels selected, not the collectives.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import record  # noqa: E402


def _same(a, b) -> bool:
    a, b = a.cpu(), b.cpu()
    if a.dtype.is_floating_point:
        return bool((a.isnan() == b.isnan()).all() and (a.nan_to_num() == b.nan_to_num()).all())
    return bool((a == b).all())


def qgz_pipeline(N: int, K: int, chunk: int, stages: int, backend: str, device: str, grads: list):
    """Steps 1, 3 and 5 of qgZ on every rank, each all-to-all done by indexing; returns every rank's output."""
    import torch

    from lightning_zeropp import kernels as tk

    W = N * K
    outputs = torch.empty(W, chunk, device=device)
    grads = [g.to(device) for g in grads]  # rank r's reduce-scatter input
    for s in range(stages):
        start, size = tk.stage_bounds(chunk, stages, s, 128)
        if not size:
            continue
        sent = [tk.swizzle_quantize(g, N, K, stages, s, 8, 128, backend=backend) for g in grads]
        rail = {}
        for node in range(K):
            for local in range(N):  # intra hop: every local peer's slots [local*K, (local+1)*K) arrive here
                recv = torch.stack([sent[node * N + p][local * K : (local + 1) * K] for p in range(N)])
                rail[node, local] = tk.dequantize_reduce_quantize(recv, size, 8, 4, 128, backend=backend)
        for node in range(K):
            for local in range(N):  # inter hop: piece `node` of every node's rank with this local rank
                rows = torch.stack([rail[k, local][node] for k in range(K)])
                out = outputs[node * N + local, start : start + size]
                tk.dequantize_reduce(rows, size, 4, 128, multiplier=1 / W, out=out, backend=backend)
    return outputs


def kernel_pipelines() -> dict:
    import torch

    from lightning_zeropp import kernels as tk

    gen = torch.Generator().manual_seed(0)
    N, K, chunk, stages = 8, 4, 100_003, 3
    g = [torch.randn(N * K * chunk, generator=gen).to(torch.bfloat16) for _ in range(N * K)]
    t = time.perf_counter()
    want = qgz_pipeline(N, K, chunk, stages, "torch", "cpu", g)
    got = qgz_pipeline(N, K, chunk, stages, "triton", "cuda", g)
    qgz_ok = _same(want, got)
    w = torch.randn(8 * 1_000_003, generator=gen).to(torch.bfloat16)
    results = {"qgz_bit_exact": qgz_ok}
    for bits in (8, 4):
        rows = w.view(8, -1)  # qwZ: 8 ranks' shards, each quantized on its own, gathered as rows
        packed = tk.quantize(rows.cuda(), bits, 256, backend="triton")
        out = torch.empty(8, rows.shape[1], dtype=torch.bfloat16, device="cuda")
        tk.dequantize(packed, rows.shape[1], bits, 256, torch.bfloat16, out=out, backend="triton")
        want = tk.quantize(rows, bits, 256, backend="torch")
        ref = tk.dequantize(want, rows.shape[1], bits, 256, torch.bfloat16, backend="torch")
        results[f"qwz_int{bits}_bit_exact"] = _same(packed, want) and _same(out, ref)
    results["seconds"] = time.perf_counter() - t
    return results


def training(steps: int) -> dict:
    import torch
    from lightning.pytorch import Trainer, seed_everything

    sys.path.insert(0, str(ROOT / "examples" / "gpt"))
    from data import ByteCorpusDataModule
    from model import GPTModule

    from lightning_zeropp import ZeroPPStrategy
    from lightning_zeropp.kernels import triton_ops

    calls = {}
    for name in ("quantize", "dequantize", "swizzle_quantize", "dequantize_reduce_quantize", "dequantize_reduce"):
        fn = getattr(triton_ops, name)

        def counted(*a, _fn=fn, _name=name, **k):
            calls[_name] = calls.get(_name, 0) + 1
            return _fn(*a, **k)

        setattr(triton_ops, name, counted)
    losses = {}
    for backend in ("triton", "torch"):
        seed_everything(1234)
        model = GPTModule(block_size=256, n_layer=4, n_head=8, n_embd=512)
        trainer = Trainer(accelerator="gpu", devices=1, precision="bf16-mixed", max_steps=steps, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, limit_val_batches=0,
                          strategy=ZeroPPStrategy(kernel_backend=backend))  # fmt: skip
        trainer.fit(model, datamodule=ByteCorpusDataModule(block_size=256, batch_size=16))
        losses[backend] = float(trainer.callback_metrics["train/loss"])  # the twins on the GPU give the same bits
    torch.cuda.synchronize()
    result = {"final_loss": losses, "finite": all(v == v for v in losses.values()), "triton_kernel_calls": calls}
    if not calls:  # one GPU is one node: nothing crosses nodes, so the strategy quantizes nothing
        result["note"] = "one rank on one node: no quantized collective ran; the pipelines above check the kernels"
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import torch

    if not torch.cuda.is_available():
        sys.exit("benchmarks/gpu_smoke.py needs a CUDA device.")
    result = {"device": torch.cuda.get_device_name(), "kernels": kernel_pipelines(), "training": training(args.steps)}
    print(json.dumps(result, indent=2))
    if args.json:
        record.write(args.json, result, None if argv is None else [__file__, *argv])
    if not all(v for k, v in result["kernels"].items() if k.endswith("bit_exact")) or not result["training"]["finite"]:
        sys.exit("gpu_smoke: FAILED")


if __name__ == "__main__":
    main()
