"""Weight deltas: the node copy kept across steps and updated by deltas sent once per node.

What each test pins down:
- training with weight deltas tracks one process on the global batch over 20 steps, per parameter (2 x 2 through the
  Trainer, 3 x 2 through Fabric); qgZ is off there, so the only difference from ZeRO-3 is the forward's weights;
- every rank of a node and every node compute with bit-identical weights, and the node copies' slices are
  bit-identical across nodes;
- a change outside the optimizer step (weights scaled in place, as an EMA swap does, and back; a checkpoint load) is
  followed by an exact refresh: the next forward uses exactly the new weights; a write through ``param.data`` is not
  seen until ``refresh_weight_copies()``;
- the ledger: one refresh per unit at the first step and every ``weight_delta_refresh`` steps, otherwise per step one
  delta exchange per unit, whose cross-node bytes are exactly one INT4 buffer per other node, and no weight
  all-gather leaves the node; those bytes come from the wire format alone (``_closed_form_wire``), which is checked,
  with the quantizer's sizes, offsets and bytes, against numbers computed by hand (``BY_HAND``);
- bad combinations are refused with the argument named.
"""

import pytest
import torch

from lightning_zeropp import ZeroPPStrategy
from lightning_zeropp import kernels as tk
from lightning_zeropp.commplan import resolve
from lightning_zeropp.config import ZeroPPConfig
from lightning_zeropp.deltas import WeightDeltas
from lightning_zeropp.ledger import CommLedger
from lightning_zeropp.testing.deltas import deltas_worker, trainer_swap_worker
from lightning_zeropp.testing.distributed import spawn
from lightning_zeropp.testing.models import TinyLM
from lightning_zeropp.testing.workers import (
    padded_shard_numel,
    reference_training,
    relative_error,
    save_inputs,
    train_worker,
)
from lightning_zeropp.topology import Topology

pytestmark = pytest.mark.version_sensitive

BATCH, STEPS = 2, 20
# Tolerances from measured errors (32-true, TinyLM's SGD at lr 0.3 with momentum 0.9, qgZ off, 20 steps), as
# (worst parameter's update, whole model's update) relative to one process's: INT4 deltas 2 x 2: 0.358, 0.064 (the
# Trainer and Fabric alike); INT8 deltas 3 x 2: 0.022, 0.0058; for comparison qwZ's INT8 weights 2 x 2: 0.057, 0.011.
# The steps here move the weights by several percent each, where INT4 deltas lose to INT8 weights quantized from
# scratch (a delta's error is about 12% of what the step changed); docs/results/gradient_error.md has the AdamW
# regime, where
# INT4 deltas are 5.8x more accurate than INT8 weights.
UPDATE_TOL = {4: (0.5, 0.1), 8: (0.05, 0.01)}
FORWARD_ERROR_TOL = {4: 1.5e-2, 8: 1e-3}  # measured at most 1.09e-2 (INT4, 2 x 2), 5.0e-4 (INT8, 3 x 2)


# ----------------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(weight_deltas=True, hpz_partition_size=1), ValueError, "hpz_partition_size=1"),
        (dict(weight_deltas=True, cpu_offload=True), ValueError, "cpu_offload=True"),
        (dict(weight_deltas=True, weight_block_size=255), ValueError, "`weight_block_size=255`"),
        (dict(weight_delta_bits=2), ValueError, "`weight_delta_bits=2`"),
        (dict(weight_delta_refresh=-1), ValueError, "`weight_delta_refresh=-1`"),
        (dict(weight_delta_refresh=1.5), TypeError, "`weight_delta_refresh` must be an int"),
        (dict(weight_deltas="yes"), TypeError, "`weight_deltas` must be True or False"),
    ],
)
def test_bad_combinations_are_refused(kwargs, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        ZeroPPStrategy(**kwargs)


def test_odd_blocks_are_fine_for_int8_deltas_and_hpz_that_resolves_to_one_is_refused():
    ZeroPPStrategy(weight_deltas=True, weight_block_size=255, weight_delta_bits=8)
    config = ZeroPPConfig(weight_deltas=True, ranks_per_node=1)
    with pytest.raises(ValueError, match="resolves to 1 here"):
        config.resolve(4, 4)


@pytest.mark.parametrize("world, per_node", [(4, 2), (6, 2), (8, 4), (8, 2)])
def test_every_shard_has_one_holder_per_node(world, per_node):
    """Who sends to whom: shard s goes to exactly one rank of each hpZ group, and each rank's slice is made of the
    shards whose holder lists name it (so the all-to-all's sends and receives match)."""
    config = ZeroPPConfig(weight_deltas=True, ranks_per_node=per_node)
    parts = []
    for rank in range(world):
        topology = Topology(world, per_node, rank, per_node)
        forward = resolve(config, topology).forward
        assert forward.kind == "node_copy"
        parts.append(WeightDeltas(forward, topology, CommLedger(topology)))
    for owner, part in enumerate(parts):
        assert sorted(h // per_node for h in part.holders) == list(range(world // per_node))
        for holder in part.holders:
            assert owner in parts[holder].owners
    slices = [tuple(p.owners) for p in parts]
    for rank in range(world):
        assert slices[rank] == slices[rank % per_node]  # the same slice on every node
    assert sorted(s for p in parts[:per_node] for s in p.owners) == list(range(world))  # one node holds every shard


# ----------------------------------------------------------------------------------------------------- training
@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Inputs and the one-process reference for 4 and 6 ranks (the global batch is ranks x BATCH)."""
    out = {}
    for world in (4, 6):
        folder = tmp_path_factory.mktemp(f"deltas{world}")
        init_path, data_path, x, y = save_inputs(folder, world * BATCH * STEPS)
        ref_state, _ = reference_training(init_path, x, y, world * BATCH, STEPS)
        init = {f"net.{k}": v for k, v in torch.load(init_path).items()}
        out[world] = (init_path, data_path, init, ref_state, folder)
    return out


def _check_parity(state, init, ref_state, label, bits):
    param_tol, whole_tol = UPDATE_TOL[bits]
    errors = {n: relative_error(state[n] - init[n], ref_state[n] - init[n]) for n in ref_state}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= param_tol, f"{label}: {worst}'s update differs by {errors[worst]:.4f}"
    names = sorted(ref_state)
    whole = relative_error(
        torch.cat([(state[n] - init[n]).flatten() for n in names]),
        torch.cat([(ref_state[n] - init[n]).flatten() for n in names]),
    )
    assert 0 < whole <= whole_tol, f"{label}: the model's update differs by {whole:.4f}"


def _closed_form_wire(segments: list[int], bits: int, block: int = 256) -> int:
    """The wire size of one quantized buffer from the format alone (README, "Kernels"): per parameter segment whole
    blocks from its start and a shorter tail; INT4 codes two per byte; with a block size that is a multiple of 32,
    each tail's codes padded to 16 bytes (every block then starts on 16 bytes), else each block starting on a byte;
    the payload padded to 16 bytes, one fp32 scale per block, padded to 16 bytes."""
    blocks = sum(-(-n // block) for n in segments)
    tail_pad = 16 if block % 32 == 0 else 1
    full = block if bits == 8 else block // 2
    payload = 0
    for n in segments:
        tail = n % block if bits == 8 else -(-(n % block) // 2)
        payload += (n // block) * full + -(-tail // tail_pad) * tail_pad
    return -(-(-(-payload // 16) * 16 + 4 * blocks) // 16) * 16


def _unit_segments(world: int) -> list[list[int]]:
    """Per unit of TinyLM (blocks, then the root): each parameter's padded shard on ``world`` ranks (FSDP pads dim 0
    to a multiple of the world size)."""
    model = TinyLM()
    model.configure_model()
    blocks = list(model.net.blocks)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    units = [list(b.parameters()) for b in blocks] + [[p for p in model.parameters() if id(p) not in in_blocks]]
    return [[padded_shard_numel(p.shape, world) for p in params] for params in units]


def _delta_bytes(world: int, bits: int = 4, block: int = 256) -> list[int]:
    """Per unit of TinyLM (blocks, then the root): the bytes of one rank's delta buffer, from the wire format alone."""
    return [_closed_form_wire(segments, bits, block) for segments in _unit_segments(world)]


# Hand-computed from the format (README "Kernels", docs/kernels.md), for segments of 300 and 5 elements:
# block 256: blocks [256 | 44] [5], 3 scales
#   INT8: payload 256 + 44 -> 48 + 5 -> 16 = 320 bytes; scales 320..332; 332 -> 336
#   INT4: payload 128 + 22 -> 32 + 3 -> 16 = 176 bytes; scales 176..188; 188 -> 192
# block 128: blocks [128 | 128 | 44] [5], 4 scales (payload + scales on a 16-byte boundary: one scale more shows)
#   INT8: payload 128 + 128 + 48 + 16 = 320; scales 320..336; 336
#   INT4: payload 64 + 64 + 32 + 16 = 176; scales 176..192; 192
# block 100 (not a multiple of 32: blocks start on a byte, no tail padding), segments 250 and 5: [100|100|50] [5]
#   INT8: payload 100 + 100 + 50 + 5 = 255 -> 256; scales 256..272; 272
#   INT4: payload 50 + 50 + 25 + 3 = 128; scales 128..144; 144
# one block of 256, and one element: 256 + 4 -> 272 (INT8), 128 + 4 -> 144 (INT4); 16 + 4 -> 32 (either)
# (segments, block, bits): (payload blocks' byte ranges, scale offset, wire bytes)
BY_HAND = {
    ((300, 5), 256, 8): ([(0, 256), (256, 300), (304, 309)], 320, 336),
    ((300, 5), 256, 4): ([(0, 128), (128, 150), (160, 163)], 176, 192),
    ((300, 5), 128, 8): ([(0, 128), (128, 256), (256, 300), (304, 309)], 320, 336),
    ((300, 5), 128, 4): ([(0, 64), (64, 128), (128, 150), (160, 163)], 176, 192),
    ((250, 5), 100, 8): ([(0, 100), (100, 200), (200, 250), (250, 255)], 256, 272),
    ((250, 5), 100, 4): ([(0, 50), (50, 100), (100, 125), (125, 128)], 128, 144),
    ((256,), 256, 8): ([(0, 256)], 256, 272),
    ((256,), 256, 4): ([(0, 128)], 128, 144),
    ((1,), 256, 8): ([(0, 1)], 16, 32),
    ((1,), 256, 4): ([(0, 1)], 16, 32),
}


@pytest.mark.parametrize("key", list(BY_HAND), ids=lambda k: f"{'+'.join(map(str, k[0]))}-b{k[1]}-int{k[2]}")
def test_wire_size_and_layout_match_the_format_by_hand(key):
    """The sizes the ledger tests expect (:func:`_closed_form_wire`) and what the quantizer writes, against sizes and
    offsets computed by hand from the format: every block of ``c_b`` (a power of two, exact in fp32) codes as
    ``qmax`` at its byte range, zeros in the padding, scale ``c_b / qmax`` (the reciprocal rounded to fp32 once) at
    the scale offset, zeros after the scales."""
    segments, block, bits = key
    ranges, scale_at, wire = BY_HAND[key]
    assert _closed_form_wire(list(segments), bits, block) == wire
    layout = tk.Blocks.of_segments(list(segments), block)
    assert layout.count == len(ranges) and layout.wire_size(bits) == wire
    starts = layout.starts
    values = [2.0 ** (b % 5 - 2) for b in range(layout.count)]
    x = torch.cat([torch.full((starts[b + 1] - starts[b],), v) for b, v in enumerate(values)])
    q = tk.quantize(x, bits, block, blocks=layout, backend="torch")
    assert q.dtype == torch.uint8 and q.shape == (wire,), f"{q.shape[0]} bytes on the wire, {wire} by hand"
    qmax = 127 if bits == 8 else 7
    expected = torch.zeros(wire, dtype=torch.uint8)
    for (a, b), n in zip(ranges, (starts[k + 1] - starts[k] for k in range(layout.count))):
        if bits == 8:
            expected[a:b] = qmax
        else:  # two codes per byte, element 2i in the low nibble; an odd count leaves the last high nibble 0
            expected[a:b] = qmax | qmax << 4
            if n % 2:
                expected[b - 1] = qmax
    scales = torch.tensor(values) * torch.tensor(1 / qmax, dtype=torch.float32)
    expected[scale_at : scale_at + 4 * layout.count] = scales.view(torch.uint8)
    assert torch.equal(q, expected), f"bytes differ at {torch.nonzero(q != expected).flatten().tolist()[:16]}"


def _wire_to_other_nodes(result: dict, rank: int, per_node: int) -> int:
    return sum(n for peer, n in result["wire_sent"].items() if peer // per_node != rank // per_node)


@pytest.mark.multiprocess
def test_trainer_2x2_tracks_one_process_and_sends_one_delta_per_node(data):
    init_path, data_path, init, ref_state, _ = data[4]
    kwargs = dict(ranks_per_node=2, weight_deltas=True, quantize_gradients=False, weight_delta_refresh=7)
    results = spawn(train_worker, 4, kwargs, init_path, data_path, BATCH, STEPS, "32-true", 1, True)
    _check_parity(results[0]["state"], init, ref_state, "2 x 2", 4)
    delta_bytes = _delta_bytes(4)
    units = len(delta_bytes)
    for rank, r in enumerate(results):
        assert r["weights_compared"] > 0 and r["weights_mismatched"] == 0, (rank, r["weights_mismatches"])
        ledger = r["ledger"]
        # exact refreshes at the first step and after steps 7 and 14 (weight_delta_refresh=7): 3 per unit
        assert ledger["weight_delta_refresh"][2] == 3 * units, f"rank {rank}: {ledger['weight_delta_refresh']}"
        # 2 x 2: each shard goes to one rank of the other node (and to a rank of its own node, or itself)
        assert ledger["weight_delta_all_to_all"][1:] == ((STEPS - 3) * sum(delta_bytes), (STEPS - 3) * units)
        assert ledger["weight_all_gather_node_copy"][1:] == (0, STEPS * units)
        assert ledger["weight_all_gather_secondary"][1] == 0
        assert "weight_all_gather" not in ledger and "weight_all_gather_backward" not in ledger


@pytest.mark.multiprocess
def test_fabric_2x2_copies_are_identical_and_outside_changes_refresh_exactly(data):
    init_path, data_path, init, ref_state, folder = data[4]
    kwargs = dict(ranks_per_node=2, weight_deltas=True, quantize_gradients=False)
    options = dict(probes=True, folder=str(folder), probe_steps=True)
    results = spawn(deltas_worker, 4, kwargs, init_path, data_path, BATCH, STEPS, options)
    first = results[0]
    for name in first["probes"]:  # every rank computed each probed forward with rank 0's weights
        assert len({r["probes"][name]["digest"] for r in results}) == 1, f"ranks used different weights ({name})"
    for rank, r in enumerate(results):
        for unit, piece in r["slices"].items():
            assert torch.equal(piece, results[rank % 2]["slices"][unit]), f"rank {rank}'s copy of {unit} differs"
    probes = first["probes"]
    after = probes["after_training"]
    assert not after["equal"] and 0 < after["relative_error"] <= FORWARD_ERROR_TOL[4], after
    for name in ("swapped_in", "swapped_back", "loaded", "after_refresh_call"):
        assert probes[name]["equal"] and not probes[name]["missing"], f"the forward after {name} was not exact"
    assert not probes["behind_counters"]["equal"]  # a write through .data is not seen, as documented
    # every training forward's weights against the exact ones (the worker's probe, not the strategy's own report):
    # the first is an exact refresh, the others carry the deltas' rounding
    measured = first["measured"]
    assert measured[0] == 0.0 and 0 < max(measured) <= FORWARD_ERROR_TOL[4], measured
    assert max(first["errors"]) <= FORWARD_ERROR_TOL[4] and first["errors"][0] == 0.0
    # the bytes handed to torch.distributed for other-node peers in the 20 steps: one fp32 refresh of each unit's
    # shard, then 19 INT4 deltas, each to the one holder on the other node (sizes from the format, not the code)
    segments = _unit_segments(4)
    expected = sum(4 * sum(s) + (STEPS - 1) * _closed_form_wire(s, 4) for s in segments)
    for rank, r in enumerate(results):
        assert _wire_to_other_nodes(r, rank, 2) == expected, (rank, r["wire_sent"], expected)
    _check_parity(first["state"], init, ref_state, "Fabric 2 x 2", 4)
    memory = first["memory"]
    assert memory["weight_deltas_node_copy"] == 2 * memory["weight_deltas_tracked_copy"] > 0  # G = 2 shards per slice


@pytest.mark.multiprocess
def test_fabric_3x2_int8_deltas_track_one_process_with_identical_copies(data):
    init_path, data_path, init, ref_state, _ = data[6]
    kwargs = dict(ranks_per_node=2, weight_deltas=True, weight_delta_bits=8, quantize_gradients=False)
    results = spawn(deltas_worker, 6, kwargs, init_path, data_path, BATCH, STEPS, dict(probe_steps=True))
    _check_parity(results[0]["state"], init, ref_state, "3 x 2", 8)
    measured = results[0]["measured"]
    assert measured[0] == 0.0 and 0 < max(measured) <= FORWARD_ERROR_TOL[8], measured
    segments = _unit_segments(6)  # 3 nodes: each shard to one holder on each of the 2 other nodes
    expected = 2 * sum(4 * sum(s) + (STEPS - 1) * _closed_form_wire(s, 8) for s in segments)
    for rank, r in enumerate(results):
        assert _wire_to_other_nodes(r, rank, 2) == expected, (rank, r["wire_sent"], expected)
    digests = {r["probes"]["after_training"]["digest"] for r in results}
    assert len(digests) == 1, "ranks computed the last forward with different weights"
    delta_bytes = _delta_bytes(6, bits=8)
    for rank, r in enumerate(results):
        for unit, piece in r["slices"].items():
            assert torch.equal(piece, results[rank % 2]["slices"][unit]), f"rank {rank}'s copy of {unit} differs"
        # 3 nodes: each shard goes to one rank on each of the 2 other nodes (and to one on its own). Steps 2 to 20
        # and the forward after the last step send deltas.
        sent = r["ledger"]["weight_delta_all_to_all"]
        assert sent[1:] == (2 * STEPS * sum(delta_bytes), STEPS * len(delta_bytes)), f"rank {rank}: {sent}"
        assert max(r["errors"]) <= FORWARD_ERROR_TOL[8]


@pytest.mark.multiprocess
def test_trainer_ema_swap_callback_is_followed_by_exact_refreshes(data):
    """A callback swaps scaled weights in at validation start and the trained ones back at its end (in place, as EMA
    callbacks do): the validation forward and the next training forward each use exactly the weights in place."""
    init_path, data_path, *_ = data[4]
    kwargs = dict(ranks_per_node=2, weight_deltas=True)
    results = spawn(trainer_swap_worker, 4, kwargs, init_path, data_path, BATCH)
    for name in ("validation", "training_after"):
        assert len({r["results"][name]["digest"] for r in results}) == 1, f"ranks used different weights ({name})"
        checked = results[0]["results"][name]
        assert checked["equal"] and not checked["missing"], f"the {name} forward did not use the weights in place"
    # exact refreshes per unit: the first step, swapped in for validation after step 2, swapped back for step 3,
    # swapped in for validation after step 4; deltas at steps 2 and 4
    ledger = results[0]["ledger"]
    assert ledger["weight_delta_refresh"][2] == 4 * 3, ledger["weight_delta_refresh"]
    assert ledger["weight_delta_all_to_all"][2] == 2 * 3, ledger["weight_delta_all_to_all"]
