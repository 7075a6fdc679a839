"""qwZ, qgZ and all three (with hpZ) train the example GPT like ZeRO-3, and backward sees forward's exact weights.

4 ranks as 2 nodes x 2, 32-true, 3 SGD steps; the reference is one process on the global batch (ZeRO-3 matches it
to 1e-5, test_zero3.py). Tolerances, from the quantizers' error (measured values in the comments):
- loss per step: within 0.5% (the forward weights differ by at most half an INT8 step, 1/254 of a block's absmax);
- parameter update (final - initial) over the whole model, relative L2 error vs the reference update.
"""

import os

import pytest
import torch
from helpers import spawn
from workers import reference_training, relative_error, save_inputs, train_worker

pytestmark = pytest.mark.multiprocess

WORLD, PER_NODE, BATCH, STEPS = 4, 2, 2, 3
CONFIGS = {
    # name: (strategy kwargs, update tolerance); measured on this setup: 0.060, 0.125, 0.139, 0.278 (losses within
    # 0.04%, 0.03%, 0.04%, 0.27% of ZeRO-3's)
    "qwz": (dict(quantize_weights=True, hpz_partition_size=1, quantize_gradients=False), 0.12),
    "qgz": (dict(quantize_weights=False, hpz_partition_size=1, quantize_gradients=True), 0.25),
    "zeropp": (dict(), 0.25),
    "zeropp_int4_weights": (dict(weight_bits=4, weight_block_size=64), 0.5),
}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    init_path, data_path, x, y = save_inputs(tmp_path_factory.mktemp("parity"), WORLD * BATCH * STEPS)
    ref_state, ref_losses = reference_training(init_path, x, y, WORLD * BATCH, STEPS)
    init = {f"net.{k}": v for k, v in torch.load(init_path).items()}
    return init_path, data_path, init, ref_state, ref_losses


def _update_error(state, init, ref_state) -> float:
    names = sorted(ref_state)
    got = torch.cat([(state[n] - init[n]).flatten() for n in names])
    want = torch.cat([(ref_state[n] - init[n]).flatten() for n in names])
    return relative_error(got, want)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_quantized_training_tracks_zero3(inputs, name):
    init_path, data_path, init, ref_state, ref_losses = inputs
    kwargs, update_tol = CONFIGS[name]
    results = spawn(
        train_worker, WORLD, dict(ranks_per_node=PER_NODE, **kwargs), init_path, data_path, BATCH, STEPS,
        "32-true", 1, True,
    )  # fmt: skip
    losses = torch.tensor([r["losses"] for r in results]).mean(0)
    ref = torch.tensor(ref_losses)
    assert torch.all((losses - ref).abs() / ref <= 5e-3), f"losses {losses.tolist()} vs ZeRO-3 {ref_losses}"
    err = _update_error(results[0]["state"], init, ref_state)
    assert err <= update_tol, f"{name}: update differs from ZeRO-3's by {err:.3f} (relative L2)"
    assert err > 0, "quantization left no trace: is it switched on?"
    for r in results:
        assert r["weights_compared"] > 0 and r["weights_mismatched"] == 0
    ledger = results[0]["ledger"]
    if kwargs.get("quantize_gradients", True):
        assert "gradient_reduce_scatter" not in ledger and ledger["gradient_all_to_all_inter"][1] > 0
    else:
        assert "gradient_all_to_all_inter" not in ledger


@pytest.mark.triton_interpret
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 (set without a GPU)")
def test_triton_backend_trains_bit_identically(inputs):
    """ZeRO++ through the Triton kernels (interpreted on the CPU) gives exactly the torch path's weights."""
    init_path, data_path, *_ = inputs
    runs = {
        backend: spawn(
            train_worker, WORLD, dict(ranks_per_node=PER_NODE, kernel_backend=backend), init_path, data_path, BATCH, 2
        )[0]["state"]
        for backend in ("torch", "triton")
    }
    for name, value in runs["torch"].items():
        assert torch.equal(value, runs["triton"][name]), name
