"""``second_moment_correction``: qgZ's rounding noise taken out of Adam's second moment (lightning_zeropp.moments).

- The estimate: on 2 x 2 gloo ranks with made-up gradients, each block's noise variance from the received scales
  against the true squared error of qgZ's output (pooled: close to 1), in parameter-aligned and flat blocks, with
  stochastic rounding and with rotated blocks (whose inverse spreads a piece's error over it).
- The wiring, per parameter and element: in a Fabric run on 2 x 2 ranks where every rank has the same data (so each
  node's partial sum is N times the reduced gradient, and each block's scale is known from the gradient itself), the
  variance each element gets is ``K (N amax / 7)^2 / 12 / W^2`` of its own block; ``exp_avg_sq`` right before each
  update is the corrected one (the floor included), the first step's is corrected right after it, and a clipped
  step's variance is scaled by the clipping.
- The Trainer: the correction runs once per step between the clipping and the update, and an LR scheduler's wrapper
  of ``optimizer.step`` survives.
- The arguments: refused without qgZ, with HYBRID_SHARD and with fp16 gradients; a warning for an optimizer without
  ``betas`` (SGD), whose state is left alone.
- The default, ``"auto"``: resolved in the plan (on across nodes with bf16 / fp32 gradients in FULL_SHARD; off with
  fp16, HSDP, one node, no qgZ); through the Trainer it corrects AdamW every step and stands down silently for SGD.
- The broadcast update (the cap from parameter-aligned blocks) against the element-wise formula on every layout.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from lightning_zeropp import ZeroPPConfig, ZeroPPStrategy
from lightning_zeropp.moments import noise_factor
from lightning_zeropp.testing.distributed import spawn

# The floor as documented (moments.py's docstring, docs/accuracy.md): the corrected second moment never falls
# below half the uncorrected one. Written here, not imported: a changed floor must fail these tests.
FLOOR = 0.5

N, K = 2, 2
W = N * K


def test_noise_factor():
    assert noise_factor("nearest", None) == pytest.approx(1 / 12)
    assert noise_factor("stochastic", None) == pytest.approx(1 / 6)
    assert noise_factor("nearest", 1.0) == pytest.approx(2 / 12)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(quantize_gradients=False), r"`quantize_gradients=False` reduces gradients exactly"),
        (dict(sharding_strategy="HYBRID_SHARD", ranks_per_node=2), r"not supported with `sharding_strategy='HYBRID"),
    ],
)
def test_refused_where_there_is_no_qgz_noise_to_take_out(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ZeroPPConfig(second_moment_correction=True, **kwargs)


def test_refused_with_fp16_gradients_whose_division_follows_the_reduction():
    from lightning_zeropp.core import ZeroPPCore

    core = ZeroPPCore(ZeroPPConfig(second_moment_correction=True))
    for precision in ("32-true", "bf16-mixed", "bf16-true"):
        core.check_device(precision, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"cannot follow fp16 gradients \(`precision='16-true'`\)"):
        core.check_device("16-true", torch.device("cpu"))


def test_default_auto_and_type_checked():
    assert ZeroPPConfig().second_moment_correction == "auto"
    for bad in ("yes", 1, None):
        with pytest.raises(TypeError, match="second_moment_correction"):
            ZeroPPConfig(second_moment_correction=bad)


@pytest.mark.parametrize(
    ("kwargs", "nodes", "precision", "on"),
    [
        (dict(), 2, "bf16-mixed", True),
        (dict(), 4, "32-true", True),
        (dict(), 2, None, True),  # precision not known yet: not fp16
        (dict(), 2, "16-true", False),  # fp16 gradients: FSDP divides them after qgZ
        (dict(), 1, "bf16-mixed", False),  # one node: no inter-node hop, no noise
        (dict(quantize_gradients=False), 2, "bf16-mixed", False),
        (dict(sharding_strategy="HYBRID_SHARD", quantize_weights=False), 2, "bf16-mixed", False),  # quantized HSDP
        (dict(second_moment_correction=False), 2, "bf16-mixed", False),
        (dict(second_moment_correction=True), 2, "bf16-mixed", True),
    ],
)
def test_auto_is_on_wherever_qgz_crosses_nodes_with_gradients_it_can_follow(kwargs, nodes, precision, on):
    """``"auto"`` resolves in the plan, which the runtime and the planner share; it never refuses."""
    from lightning_zeropp.commplan import resolve
    from lightning_zeropp.topology import Topology

    config = ZeroPPConfig(ranks_per_node=2, **kwargs)
    plan = resolve(config, Topology(2 * nodes, 2, 0, config.resolve(2 * nodes, 2)[1]), precision)
    assert (plan.gradients.kind == "two_hop" and plan.gradients.second_moment) == on
    assert ("second-moment correction" in plan.describe()) == on


def _one_parameter(correction, values, length, starts):
    """``correction`` made to see one unit holding one plain parameter of ``length`` elements, reduced this step, its
    chunk's blocks starting at ``starts`` with noise ``values`` (what the units of a sharded model give it)."""
    from lightning_zeropp.moments import _UnitNoise

    param = torch.nn.Parameter(torch.zeros(length))
    entry = _UnitNoise(None, tuple(starts), torch.tensor(values))
    correction._units["unit"] = entry
    correction._reduced.add("unit")
    correction.reduced_parameters = lambda: iter([(entry, param, 0, length)])
    return param


@pytest.fixture(params=["per parameter", "per unit"])
def lowering(request, monkeypatch):
    """Both ways to lower ``exp_avg_sq``: one parameter at a time (the CPU's) and a unit at a time (the GPUs'), both
    run here on the CPU."""
    from lightning_zeropp import moments

    monkeypatch.setattr(moments, "PER_PARAMETER", {"cpu"} if request.param == "per parameter" else set())
    return request.param


def test_blocks_expand_to_their_elements_and_the_floor_holds(lowering):
    from lightning_zeropp.moments import SecondMomentCorrection

    correction = SecondMomentCorrection(1 / 12)
    param = _one_parameter(correction, [0.5, 100.0, 0.25], 5, [0, 2, 4, 5])
    param.grad = torch.ones(5)
    optimizer = torch.optim.AdamW([param], lr=0.1, betas=(0.9, 0.8))
    correction.judge_optimizer(optimizer)
    correction._wanted["unit"] = True
    optimizer.step()
    v = optimizer.state[param]["exp_avg_sq"].clone()
    correction.before_update(optimizer, True)
    shift = 0.2 / 0.8
    sigma = torch.tensor([0.5, 0.5, 100.0, 100.0, 0.25])
    want = torch.maximum(v - shift * sigma, FLOOR * v - (1 - FLOOR) * shift * param.grad.square())
    assert torch.allclose(optimizer.state[param]["exp_avg_sq"], want)
    assert (want[2:4] == FLOOR * v[2:4] - (1 - FLOOR) * shift).all()  # floored where the noise swamps the gradient
    correction.after_update(optimizer, True)
    entry = correction._units["unit"]
    assert entry.values.tolist() == [0.5, 100.0, 0.25]  # kept for another optimizer stepping on the same backward
    # the next step's first reduction starts from zero
    correction.new_step()
    assert correction.buffer(_Unit("unit"), 5, (0, 2, 4, 5), torch.device("cpu")) is entry.values
    assert (entry.values == 0).all() and "unit" in correction._reduced


class _Unit:
    def __init__(self, name):
        self.name = name


def test_every_optimizer_stepping_after_one_backward_corrects_its_own_parameters_once(lowering):
    """Two Adam optimizers stepping after one backward (manual optimization, Fabric): each corrects its own
    parameters with the step's estimates, none twice (an optimizer stepping again on the same gradients changes
    nothing more); the next step's reduction starts new estimates and every parameter is corrected again."""
    from lightning_zeropp.moments import SecondMomentCorrection

    correction = SecondMomentCorrection(1 / 12, "auto")
    unit = _Unit("unit")
    starts = (0, 2, 4, 6, 7)  # two parameters of 4 and 3 elements, parameter-aligned blocks of 2
    a, b = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(3))
    correction.reduced_parameters = lambda: iter(
        [(correction._units["unit"], a, 0, 4), (correction._units["unit"], b, 4, 3)]
    )
    first, second = torch.optim.AdamW([a], lr=0.1), torch.optim.Adam([b], lr=0.1)
    correction.judge_optimizer(first)
    correction.judge_optimizer(second)
    correction._wanted["unit"] = True
    shift = 0.001 / 0.999
    for step in range(3):
        correction.new_step()
        values = correction.buffer(unit, 7, starts, torch.device("cpu"))
        added = torch.tensor([1e-3, 2e-3, 3e-3, 4e-3]) * (step + 1)  # what the step's reduction adds
        values += added
        sigmas = {a: added[[0, 0, 1, 1]], b: added[[2, 2, 3]]}  # each element its block's
        a.grad, b.grad = torch.full((4,), 0.5), torch.full((3,), 0.25)
        correction.backward_done()
        for optimizer, param in ((first, a), (second, b)):
            before = optimizer.state[param]["exp_avg_sq"].clone() if step else None
            correction.before_update(optimizer, True)
            if step:  # lowered by the step's own variance, this optimizer's parameter only
                sigma = sigmas[param]
                want = torch.maximum(before - shift * sigma, FLOOR * before - (1 - FLOOR) * shift * param.grad**2)
                assert torch.allclose(optimizer.state[param]["exp_avg_sq"], want), (step, param.numel())
            optimizer.step()
            correction.after_update(optimizer, True)
        assert correction.corrected == 2 * (step + 1), step
        again = {p: o.state[p]["exp_avg_sq"].clone() for o, p in ((first, a), (second, b))}
        for optimizer in (first, second):  # stepping again without a backward (the owner: not fresh): once is all
            correction.before_update(optimizer, False)
            correction.after_update(optimizer, False)
        assert correction.corrected == 2 * (step + 1), step
        assert all(torch.equal(again[p], o.state[p]["exp_avg_sq"]) for o, p in ((first, a), (second, b)))


@pytest.mark.parametrize("scope", ["all", "matrices"])
def test_the_scope_matrices_leaves_norm_gains_and_biases_as_the_optimizer_made_them(scope, lowering):
    """One unit of a weight (2 x 2), a norm gain (2) and a bias (2), blocks of 2, the same noise everywhere:
    ``"all"`` lowers all three second moments, ``"matrices"`` the weight's alone; a 1-D parameter is left bit for bit
    as AdamW made it, and the weight is lowered by the same amount in both scopes."""
    from lightning_zeropp.moments import SecondMomentCorrection

    correction = SecondMomentCorrection(1 / 12, "auto", scope)
    weight, gain, bias = (torch.nn.Parameter(torch.zeros(shape)) for shape in ((2, 2), (2,), (2,)))
    entry_of = lambda: correction._units["unit"]  # noqa: E731
    correction.reduced_parameters = lambda: iter(
        [(entry_of(), weight, 0, 4), (entry_of(), gain, 4, 2), (entry_of(), bias, 6, 2)]
    )
    optimizer = torch.optim.AdamW([weight, gain, bias], lr=0.1, betas=(0.9, 0.8))
    correction.judge_optimizer(optimizer)
    correction._wanted["unit"] = True
    for p in (weight, gain, bias):
        p.grad = torch.ones_like(p)
    optimizer.step()  # the state exists: the next update is corrected before it
    correction.new_step()
    correction.buffer(_Unit("unit"), 8, (0, 2, 4, 6, 8), torch.device("cpu")).fill_(0.01)
    correction.backward_done()
    before = {p: optimizer.state[p]["exp_avg_sq"].clone() for p in (weight, gain, bias)}
    correction.before_update(optimizer, True)
    after = {p: optimizer.state[p]["exp_avg_sq"] for p in (weight, gain, bias)}
    shift = 0.2 / 0.8
    assert torch.allclose(after[weight], before[weight] - shift * 0.01)
    for p in (gain, bias):
        if scope == "all":
            assert torch.allclose(after[p], before[p] - shift * 0.01)
        else:
            assert torch.equal(after[p], before[p])
    assert correction.corrected == (3 if scope == "all" else 1)


def test_the_scope_is_checked_where_it_is_given():
    from lightning_zeropp.moments import SecondMomentCorrection

    with pytest.raises(ValueError, match="second_moment_scope='rows'"):
        SecondMomentCorrection(1 / 12, "auto", "rows")
    with pytest.raises(Exception, match="second_moment_scope"):
        ZeroPPStrategy(second_moment_scope="rows")


@pytest.mark.parametrize(
    "starts, start, length, shape",
    [
        ((0, 8, 16, 20, 28, 36, 37), 8, 12, (12,)),  # a parameter's blocks from its start, a shorter tail
        ((0, 8, 16, 20, 28, 36, 37), 20, 17, (4, 4)),  # the padded segment longer than the shard (16 of 17)
        ((0, 8, 16, 20, 28, 36, 37), 20, 17, (2, 3)),  # a shard that ends inside a whole block
        ((0, 8, 16, 24, 32, 37), 4, 20, (20,)),  # flat blocks straddling the segment's start: expanded instead
        ((0, 5), 0, 5, (5,)),  # one block
    ],
)
@pytest.mark.parametrize("ratio", [None, 0.3])
def test_the_broadcast_update_is_the_elementwise_formula(starts, start, length, shape, ratio):
    """``_lower`` (the variance broadcast from its blocks where they follow the parameter) against the formula on
    the variance expanded element by element, for every layout a shard can have in its unit's chunk."""
    from lightning_zeropp.moments import _lower, _UnitNoise

    gen = torch.Generator().manual_seed(len(starts) + start)
    entry = _UnitNoise(None, starts, torch.rand(len(starts) - 1, generator=gen) * 4)
    grad = torch.randn(shape, generator=gen)
    v = torch.rand(shape, generator=gen) * 0.4  # so that the floor binds at some elements and not at others
    shift = 0.05 / 0.95
    sigma = entry.per_element(start, length, grad.numel()).view(shape)
    if ratio is not None:
        sigma = sigma * ratio
    want = torch.maximum(v - shift * sigma, FLOOR * v - (1 - FLOOR) * shift * grad.square())
    aligned = entry.blocks_of(start, length) is not None
    assert aligned == (start != 4), "the layouts whose blocks start at the parameter's start take the broadcast"
    floored = want == FLOOR * v - (1 - FLOOR) * shift * grad.square()
    if grad.numel() >= 12 and ratio is None:
        assert floored.any() and not floored.all()
    _lower(v, grad, entry, start, length, shift, None if ratio is None else torch.tensor(ratio))
    torch.testing.assert_close(v, want)


def test_a_unit_lowered_at_once_is_each_parameter_lowered_alone_bit_for_bit():
    """``_lower_unit`` (a unit's parameters in multi-tensor passes, the GPUs' way) against ``_lower`` called for each
    parameter (the CPU's way), bit for bit: parameter-aligned blocks with short tails, a padded shard, a parameter
    with no clipping ratio next to clipped ones (a ratio of 0 among them), two optimizer groups' shifts, an fp32 and a
    bf16 state, a parameter left out (another optimizer's), one whose flat blocks straddle its start and one whose
    blocks are of another size than its unit's others."""
    from lightning_zeropp.kernels.layout import Blocks
    from lightning_zeropp.moments import _lower, _lower_unit, _UnitNoise

    gen = torch.Generator().manual_seed(3)
    segments = [40, 7, 130, 12, 65, 9]  # the padded shards in the unit's chunk
    starts = Blocks.of_segments(segments, 16).starts
    entry = _UnitNoise(None, tuple(starts), torch.rand(len(starts) - 1, generator=gen) * 3)
    offsets = [sum(segments[:i]) for i in range(len(segments))]
    shapes = [(5, 8), (7,), (128,), (3, 4), (65,), (9,)]  # the third's shard (128) is shorter than its segment
    ratios = [torch.tensor(0.7), None, torch.tensor(0.0), torch.tensor(1.3), None, torch.tensor(0.5)]
    shifts = [0.05 / 0.95, 0.05 / 0.95, 0.001 / 0.999, 0.05 / 0.95, 0.001 / 0.999, 0.05 / 0.95]
    dtypes = [torch.float32, torch.float32, torch.float32, torch.bfloat16, torch.float32, torch.bfloat16]
    items = []
    for shape, start, length, ratio, shift, dtype in zip(
        shapes, offsets, segments, ratios, shifts, dtypes, strict=True
    ):
        grad = torch.randn(shape, generator=gen)
        v = (torch.rand(shape, generator=gen) * 0.4).to(dtype)  # the floor binds at some elements only
        items.append((v, grad, start, length, shift, ratio))
    del items[4]  # another optimizer's parameter: its blocks' variance is in the unit, its state is not lowered here
    flat = _UnitNoise(None, (0, 16, 32, 48), torch.rand(3, generator=gen))  # blocks straddling a shard's start
    straddled = (torch.rand(20, generator=gen), torch.randn(20, generator=gen), 8, 24, 0.05 / 0.95, None)
    mixed = _UnitNoise(None, (0, 16, 32, 40, 50, 60, 70), torch.rand(6, generator=gen))  # blocks of 16, then of 10
    sized = [(torch.rand(n, generator=gen), torch.randn(n, generator=gen), s, n, 0.05 / 0.95, torch.tensor(0.9))
             for s, n in ((0, 40), (40, 30))]  # fmt: skip

    want = [item[0].clone() for item in items]
    for v, (_, grad, start, length, shift, ratio) in zip(want, items, strict=True):
        _lower(v, grad, entry, start, length, shift, ratio)
    want_flat = straddled[0].clone()
    _lower(want_flat, straddled[1], flat, *straddled[2:])
    want_sized = [item[0].clone() for item in sized]
    for v, (_, grad, *rest) in zip(want_sized, sized, strict=True):
        _lower(v, grad, mixed, *rest)
    for _ in range(2):  # the second call reuses the blocks' owners the first built
        got = [(item[0].clone(), *item[1:]) for item in items]
        _lower_unit(entry, got)
        for (v, *_), expected in zip(got, want, strict=True):
            assert v.dtype == expected.dtype and torch.equal(v, expected)
        got_flat = (straddled[0].clone(), *straddled[1:])
        _lower_unit(flat, [got_flat])
        assert torch.equal(got_flat[0], want_flat)
        got_sized = [(item[0].clone(), *item[1:]) for item in sized]
        _lower_unit(mixed, got_sized)
        assert all(torch.equal(g[0], w) for g, w in zip(got_sized, want_sized, strict=True))
    assert not torch.equal(want[0], items[0][0]) and torch.equal(want[2], items[2][0])  # ratio 0: unchanged


def _estimate_worker(rank, world, aligned, kwargs):
    from lightning_zeropp import kernels as tk
    from lightning_zeropp import qgz
    from lightning_zeropp.comm import _flat_starts, exact_reduce_scatter
    from lightning_zeropp.commplan import two_hop
    from lightning_zeropp.ledger import CommLedger
    from lightning_zeropp.topology import ProcessGroups, Topology

    dist.init_process_group("gloo")
    topo = Topology(world, N, rank)
    groups = ProcessGroups.build(topo)
    config = ZeroPPConfig(ranks_per_node=N, **kwargs)
    segments = [1000, 37, 600, 3, 360]  # odd sizes: tails shorter than a block
    chunk = sum(segments)
    blocks = tk.Blocks.of_segments(segments, config.gradient_block_size) if aligned else None
    starts = blocks.starts if aligned else _flat_starts(chunk, config.gradient_block_size)
    gen = torch.Generator().manual_seed(rank)
    scale = torch.ones(world * chunk)
    scale[::50] = 8.0  # some outliers, as gradients have
    total = torch.zeros(2)
    for call in range(4):
        x = torch.randn(world * chunk, generator=gen) * scale
        reduction = qgz.Reduction.of(topo, two_hop(config), chunk, dist.ReduceOp.AVG, None, call=call, blocks=blocks,
                                     backend=config.kernel_backend)  # fmt: skip
        noise = torch.zeros(len(starts) - 1)
        out, exact = torch.empty(chunk), torch.empty(chunk)
        exact_reduce_scatter(exact, x.clone(), dist.ReduceOp.AVG, None, groups, CommLedger(topo))
        factor = noise_factor(config.gradient_rounding, False)
        qgz.quantized_reduce_scatter(out, x, reduction, groups, CommLedger(topo), None, noise, factor)
        lengths = torch.tensor(starts).diff()
        assert (noise > 0).all()
        total[0] += float((noise * lengths).sum())
        total[1] += float((out - exact).square().sum())
    groups.destroy()
    dist.destroy_process_group()
    return total.tolist()


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("aligned", "kwargs"),
    [
        (True, {}),
        (False, {}),
        (True, dict(gradient_rounding="stochastic")),
        (True, dict(gradient_rotation="hadamard")),
        (False, dict(gradient_rotation="hadamard")),
    ],
    ids=["parameter-aligned", "flat", "stochastic", "rotated", "rotated-flat"],
)
def test_the_estimate_matches_the_true_squared_error(aligned, kwargs):
    results = spawn(_estimate_worker, W, aligned, kwargs)
    estimate = sum(r[0] for r in results)
    true = sum(r[1] for r in results)
    assert 0.85 < estimate / true < 1.15, (estimate, true)


def _block_amax(flat: torch.Tensor, block: int) -> torch.Tensor:
    """Each element's block maximum of ``|flat|``, in blocks of ``block`` from its start (a shard's aligned blocks)."""
    n = flat.numel()
    padded = torch.nn.functional.pad(flat.abs(), (0, -n % block)).view(-1, block)
    return padded.amax(1).repeat_interleave(block)[:n]


def _fabric_worker(rank, world, init_path, steps, clip_at, lowering="per parameter", precision="32-true",
                   accumulate=1):  # fmt: skip
    import torch.nn.functional as F
    from lightning.fabric import Fabric

    from lightning_zeropp import moments as correction_module
    from lightning_zeropp.fabric import ZeroPPStrategy as FabricZeroPP
    from lightning_zeropp.testing.models import TinyTransformer

    if lowering == "per unit":  # the GPUs' way, on these CPU ranks
        correction_module.PER_PARAMETER.clear()

    torch.manual_seed(0)
    fabric = Fabric(
        accelerator="cpu",
        devices=world,
        precision=precision,
        strategy=FabricZeroPP(
            ranks_per_node=N,
            second_moment_correction=True,
            second_moment_scope="all",
            gradient_quantization_scope="all",
        ),
    )  # every gradient quantized: noise on all
    fabric.launch()
    net = TinyTransformer(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=32, mlp_hidden=64, dropout=0.0)
    net.load_state_dict(torch.load(init_path, weights_only=True))
    model = fabric.setup_module(net)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95)))
    moments = fabric.strategy.comms.moments
    b2 = 0.95
    block = fabric.strategy.zeropp_config.gradient_block_size
    params = [p for p in model.parameters() if p.requires_grad]
    seen: dict[str, list[float]] = {"sigma": [], "pre": [], "first": [], "clipped": []}
    state = {"before": None, "unclipped": None}

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    def pre_hook(opt, args, kwargs):  # runs after the correction, right before the update
        for p in params:
            v = opt.state.get(p, {}).get("exp_avg_sq")
            if v is None:
                continue
            g = local(p.grad).double()
            entry_sigma = None
            for entry, param, start, length in moments.reduced_parameters():
                if param is p:
                    entry_sigma = entry.per_element(start, length, g.numel()).view_as(g).double()
            # each of the step's ``accumulate`` reductions quantized a gradient of g / accumulate: their variances add
            expected = noise_factor("nearest", None) * K * (N * _block_amax(g.flatten(), block) / 7) ** 2 / W**2
            expected = expected / accumulate
            if state["unclipped"] is None:  # not clipped: the estimate, element by element
                seen["sigma"].append(float(((entry_sigma.flatten() - expected) / expected.clamp_min(1e-30)).abs()
                                           .max()))  # fmt: skip
            sigma = entry_sigma
            if state["unclipped"] is not None:
                sigma = sigma * (g.square().sum() / state["unclipped"][id(p)].square().sum())
            before = state["before"][id(p)]
            shift = (1 - b2) / b2
            want = torch.maximum(before - shift * sigma, FLOOR * before - (1 - FLOOR) * shift * g.square())
            key = "clipped" if state["unclipped"] is not None else "pre"
            seen[key].append(float((local(v).double() - want).abs().max() / want.abs().max()))

    optimizer.register_step_pre_hook(pre_hook)
    x = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))  # the same on every rank
    for step in range(steps):
        for _ in range(accumulate):  # several backwards, each reducing (no `no_backward_sync`): one step's noise
            loss = F.cross_entropy(model(x).view(-1, 64), x.roll(-1, 1).reshape(-1))
            fabric.backward(loss)
        state["unclipped"] = None
        if step == clip_at:
            state["unclipped"] = {id(p): local(p.grad).detach().clone().double() for p in params}
            fabric.clip_gradients(model, optimizer, max_norm=1e-3)
        if step == 0:
            grads = {id(p): local(p.grad).detach().clone().double() for p in params}
            sigmas = {}
            for entry, param, start, length in moments.reduced_parameters():
                g = grads[id(param)]
                sigmas[id(param)] = entry.per_element(start, length, g.numel()).view_as(g).double()
        optimizer.step()
        if step == 0:  # the first step made the state: corrected right after it
            for p in params:
                g, sigma = grads[id(p)], sigmas[id(p)]
                v1 = (1 - b2) * g.square()
                want = torch.maximum(v1 - (1 - b2) * sigma, FLOOR * v1)
                got = local(optimizer.state[p]["exp_avg_sq"]).double()
                seen["first"].append(float((got - want).abs().max() / want.abs().max()))
        state["before"] = {id(p): local(optimizer.state[p]["exp_avg_sq"]).detach().clone().double() for p in params}
        optimizer.zero_grad()
    return {k: max(v) if v else None for k, v in seen.items()} | {"corrected": moments.corrected,
                                                                     "params": len(params)}  # fmt: skip


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "lowering, precision, accumulate",
    [("per parameter", "32-true", 1), ("per unit", "32-true", 1), ("per parameter", "bf16-mixed", 1),
     ("per parameter", "32-true", 2)],
    ids=["per-parameter", "per-unit", "bf16-mixed", "two-reductions-a-step"],
)  # fmt: skip
def test_each_element_gets_its_blocks_variance_and_adam_the_corrected_second_moment(
    tmp_path, lowering, precision, accumulate
):
    """Also in bf16-mixed, and with two reductions in one step (Fabric, two backwards without `no_backward_sync`):
    their variances add up, none is dropped by a reset at the second reduction."""
    from lightning_zeropp.testing.models import TinyTransformer

    torch.manual_seed(0)
    net = TinyTransformer(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=32, mlp_hidden=64, dropout=0.0)
    init_path = str(tmp_path / "init.pt")
    torch.save(net.state_dict(), init_path)
    steps = 4
    for rank, r in enumerate(spawn(_fabric_worker, W, init_path, steps, 2, lowering, precision, accumulate)):
        assert r["corrected"] == steps * r["params"], (rank, r)
        assert r["sigma"] < 0.05, (rank, r)  # INT8's error on the first hop, nothing more
        assert r["first"] < 1e-6, (rank, r)
        assert r["pre"] < 1e-6, (rank, r)
        assert r["clipped"] < 1e-6, (rank, r)


def _trainer_worker(rank, world, init_path, data_path, steps):
    from lightning.pytorch import Callback
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_zeropp.testing.distributed import lightning_trainer
    from lightning_zeropp.testing.models import TinyLM

    class AdamTinyLM(TinyLM):
        def configure_optimizers(self):
            optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3, betas=(0.9, 0.95))
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
            self.attributes = {k: id(v) for k, v in vars(optimizer).items()}  # the scheduler's wrapper included
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    class Order(Callback):
        """Before the clipping (Lightning's hook) nothing is corrected yet; right before the update (the step owner's
        ``before_update``, subscribed after the correction) every parameter is, the gradients are clipped already and
        the optimizer has not updated yet."""

        def __init__(self):
            self.rows, self.count, self.optimizer = [], 0, None

        def on_train_start(self, trainer, pl_module):
            self.optimizer = trainer.optimizers[0]
            self._strategy = trainer.strategy
            trainer.strategy.comms.owner.subscribe(self)

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.count = trainer.strategy.comms.moments.corrected

        def before_update(self, optimizer, fresh):
            grads = [p.grad.to_local() for group in optimizer.param_groups for p in group["params"]
                     if p.grad is not None]  # fmt: skip
            local = float(sum(g.square().sum() for g in grads))
            total = torch.tensor(local)
            torch.distributed.all_reduce(total)
            params = sum(len(g["params"]) for g in optimizer.param_groups)
            steps = {int(s["step"]) for s in optimizer.state.values()} or {0}
            corrected = self._strategy.comms.moments.corrected - self.count
            self.rows.append((self.count, corrected, params, float(total.sqrt()), steps))

    x, y = torch.load(data_path, weights_only=True)
    loader = DataLoader(TensorDataset(x[rank::world], y[rank::world]), batch_size=2, shuffle=False)
    order = Order()
    strategy = ZeroPPStrategy(ranks_per_node=N, second_moment_correction=True, second_moment_scope="all")
    trainer = lightning_trainer(world, strategy, max_steps=steps, callbacks=[order], gradient_clip_val=1e-3,
                                use_distributed_sampler=False)  # fmt: skip
    module = AdamTinyLM(init_path)
    trainer.fit(module, loader)
    now = {k: id(v) for k, v in vars(order.optimizer).items() if k != "_opt_called"}  # torch's LR scheduler's mark
    return {
        "rows": order.rows,
        "replaced": sorted(k for k in now.keys() | module.attributes.keys() if now.get(k) != module.attributes.get(k)),
        "attached": strategy.comms.owner.attached,
    }


@pytest.mark.multiprocess
def test_the_trainer_corrects_between_the_clipping_and_the_update(tmp_path):
    from lightning_zeropp.testing.workers import save_inputs

    steps = 3
    init_path, data_path, _, _ = save_inputs(tmp_path, W * 2 * steps)
    for rank, r in enumerate(spawn(_trainer_worker, W, init_path, data_path, steps)):
        assert len(r["rows"]) == steps, (rank, r)
        for step, (before, corrected, params, norm, stepped) in enumerate(r["rows"]):
            assert before == step * params, (rank, r)  # nothing of this step corrected at Lightning's hook
            # every parameter, once per step, after Lightning's hook (the first step's right after its update)
            assert corrected == (params if step else 0), (rank, r)
            assert norm <= 1e-3 * 1.001, (rank, r)  # and after the clipping
            assert stepped == {step}, (rank, r)  # and before the update
        assert r["replaced"] == [], (rank, r)  # no attribute of the optimizer instance replaced or added
        assert r["attached"] == 0, (rank, r)  # detached at teardown


def _default_worker(rank, world, init_path, data_path, steps, optimizer_name, precision="32-true"):
    import warnings

    from torch.utils.data import DataLoader, TensorDataset

    from lightning_zeropp.testing.distributed import lightning_trainer
    from lightning_zeropp.testing.models import TinyLM

    class Module(TinyLM):
        def configure_optimizers(self):
            if optimizer_name == "sgd":
                return torch.optim.SGD(self.parameters(), lr=1e-2, momentum=0.9)
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def on_train_end(self):  # before the teardown, which forgets the run's optimizers and frees the estimates
            moments = self.trainer.strategy.comms.moments
            self.seen = {"verdicts": sorted(v.describe() for v in moments.verdicts.values()) if moments else [],
                         "noise_bytes": self.trainer.strategy.persistent_memory["second_moment_noise"]}  # fmt: skip

    x, y = torch.load(data_path, weights_only=True)
    loader = DataLoader(TensorDataset(x[rank::world], y[rank::world]), batch_size=2, shuffle=False)
    strategy = ZeroPPStrategy(ranks_per_node=N)  # the defaults: second_moment_correction="auto"
    trainer = lightning_trainer(world, strategy, max_steps=steps, use_distributed_sampler=False, precision=precision)
    module = Module(init_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, loader)
    moments = strategy.comms.moments
    if moments is None:  # off in the plan (fp16 gradients)
        warned = [str(w.message) for w in caught if "second_moment_correction" in str(w.message)]
        return {"moments": None, "line": strategy.comms.describe(), "warned": warned,
                "noise_bytes": module.seen["noise_bytes"]}  # fmt: skip
    return {
        "warned": [str(w.message) for w in caught if "second_moment_correction" in str(w.message)],
        "corrected": moments.corrected,
        "verdicts": module.seen["verdicts"],
        "noise_bytes": module.seen["noise_bytes"],
        "freed": strategy.persistent_memory["second_moment_noise"],
        # the default scope ("matrices"): the parameters of two or more dimensions
        "params": sum(1 for p in trainer.lightning_module.parameters() if p.requires_grad and p.dim() >= 2),
        "vectors": sum(1 for p in trainer.lightning_module.parameters() if p.requires_grad and p.dim() < 2),
        "line": strategy.comms.describe(),
    }


@pytest.mark.multiprocess
def test_the_default_corrects_adamw_and_stands_down_silently_for_sgd(tmp_path):
    """What a user gets without choosing, through the Trainer on 2 x 2 ranks: AdamW corrected every step after the
    first (the first step's right after its update: every step, every parameter of two or more dimensions, the default
    scope), its estimates kept (and counted in
    persistent_memory); SGD: nothing corrected, no warning, no estimate kept; fp16 gradients: off from the start."""
    from lightning_zeropp.testing.workers import save_inputs

    steps = 3
    init_path, data_path, _, _ = save_inputs(tmp_path, W * 2 * steps)
    for rank, r in enumerate(spawn(_default_worker, W, init_path, data_path, steps, "adamw")):
        assert r["corrected"] == steps * r["params"] and r["verdicts"] == ["AdamW corrected"], (rank, r)
        assert r["vectors"] > 0, (rank, r)  # the norms and biases the default scope leaves alone
        assert r["freed"] == 0, (rank, r)  # the teardown frees the estimates
        assert r["noise_bytes"] > 0 and not r["warned"], (rank, r)
        assert "Adam second-moment correction on matrices" in r["line"], (rank, r)
    for rank, r in enumerate(spawn(_default_worker, W, init_path, data_path, steps, "sgd")):
        assert r["corrected"] == 0 and r["verdicts"] == ["SGD: not an Adam second moment, off"], (rank, r)
        assert r["noise_bytes"] == 0 and not r["warned"], (rank, r)
    # fp16 gradients: the Trainer's precision reaches the plan, which leaves the correction out (True is refused)
    for rank, r in enumerate(spawn(_default_worker, W, init_path, data_path, 1, "adamw", "16-true")):
        assert r["moments"] is None and r["noise_bytes"] == 0 and not r["warned"], (rank, r)
        assert "qgZ INT8 -> INT4" in r["line"] and "second-moment" not in r["line"], (rank, r)


def test_a_reduction_of_the_parameters_with_gradients_alone_maps_to_them(monkeypatch):
    """FSDP reduces only the parameters that got a gradient: the chunk then skips the others."""
    from types import SimpleNamespace

    from lightning_zeropp.compat import torch as compat
    from lightning_zeropp.moments import SecondMomentCorrection

    a, b = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(2))
    monkeypatch.setattr(compat, "unit_fsdp_parameters", lambda module: [(a, 4), (b, 2)])
    unit = SimpleNamespace(name="unit", module=None)
    correction = SecondMomentCorrection(1 / 12)
    correction.judge_optimizer(torch.optim.Adam([a, b]))
    correction.buffer(unit, 2, (0, 2), torch.device("cpu")).fill_(3.0)
    b.grad = torch.ones(2)
    assert [(p is b, start, length) for _, p, start, length in correction.reduced_parameters()] == [(True, 0, 2)]
    correction.buffer(unit, 5, (0, 5), torch.device("cpu"))  # no set of parameters holds 5 elements
    with pytest.warns(UserWarning, match=r"held 5 elements per rank, which no set of its parameters accounts for"):
        assert list(correction.reduced_parameters()) == []


def _two_optimizers_worker(rank, world, init_path, data_path, steps, second="adam"):
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_zeropp.testing.distributed import lightning_trainer
    from lightning_zeropp.testing.models import TinyLM

    class TwoOptimizers(TinyLM):
        """Manual optimization: one backward, then one AdamW for the matrices and one Adam for the rest."""

        def __init__(self, init_path):
            super().__init__(init_path)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            loss = self.loss(batch)
            self.manual_backward(loss)
            for optimizer in self.optimizers():
                optimizer.step()
            for optimizer in self.optimizers():
                optimizer.zero_grad()
            return loss

        def configure_optimizers(self):
            matrices = [p for p in self.parameters() if p.dim() >= 2]
            rest = [p for p in self.parameters() if p.dim() < 2]
            if second == "sgd":
                return torch.optim.AdamW(matrices, lr=1e-3), torch.optim.SGD(rest, lr=1e-2, momentum=0.9)
            return torch.optim.AdamW(matrices, lr=1e-3), torch.optim.Adam(rest, lr=1e-3)

    x, y = torch.load(data_path, weights_only=True)
    loader = DataLoader(TensorDataset(x[rank::world], y[rank::world]), batch_size=2, shuffle=False)
    strategy = ZeroPPStrategy(ranks_per_node=N, second_moment_scope="all")  # the second optimizer's are 1-D
    trainer = lightning_trainer(world, strategy, max_steps=steps, use_distributed_sampler=False)
    module = TwoOptimizers(init_path)
    trainer.fit(module, loader)
    sizes = [sum(len(g["params"]) for g in o.param_groups) for o in trainer.optimizers]
    losses = [float(x) for x in trainer.callback_metrics.values()]
    return {"corrected": strategy.comms.moments.corrected, "sizes": sizes, "finite": all(map(math.isfinite, losses))}


@pytest.mark.multiprocess
def test_every_optimizer_that_steps_after_one_backward_is_corrected(tmp_path):
    """Manual optimization with two Adam-family optimizers after one backward (the second holds the 1-D parameters,
    so the scope is "all"), through the Trainer on 2 x 2 ranks: every parameter of both corrected once per step
    (the second optimizer found no estimates when the first step's update dropped them)."""
    from lightning_zeropp.testing.workers import save_inputs

    batches = 2  # manual optimization: each optimizer's step counts toward max_steps
    init_path, data_path, _, _ = save_inputs(tmp_path, W * 2 * batches)
    for rank, r in enumerate(spawn(_two_optimizers_worker, W, init_path, data_path, 2 * batches)):
        first, second = r["sizes"]
        assert first and second, (rank, r)
        assert r["corrected"] == batches * (first + second), (rank, r)


@pytest.mark.multiprocess
def test_an_sgd_beside_an_adamw_leaves_the_adamws_correction_on(tmp_path):
    """AdamW for the matrices and SGD for the rest, one backward, through the Trainer on 2 x 2 ranks: the AdamW's
    parameters corrected every step, the SGD's never, and the SGD's verdict changes nothing of the AdamW's."""
    from lightning_zeropp.testing.workers import save_inputs

    batches = 2
    init_path, data_path, _, _ = save_inputs(tmp_path, W * 2 * batches)
    for rank, r in enumerate(spawn(_two_optimizers_worker, W, init_path, data_path, 2 * batches, "sgd")):
        first, second = r["sizes"]
        assert first and second and r["finite"], (rank, r)
        assert r["corrected"] == batches * first, (rank, r)


def _factor_worker(rank, world, decay):
    from lightning.fabric import Fabric

    from lightning_zeropp.fabric import ZeroPPStrategy as FabricZeroPP

    strategy = FabricZeroPP(ranks_per_node=N, gradient_error_feedback=decay is not None,
                            **({} if decay is None else {"error_feedback_decay": decay}))  # fmt: skip
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    fabric.setup_module(torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(8, 8)]), torch.nn.Linear(8, 8)))
    return fabric.strategy.comms.moments.factor


@pytest.mark.multiprocess
def test_the_runtime_takes_feedbacks_decay_into_the_factor():
    """What the comms hand the correction: 1/12 without feedback, (1 + d^2)/12 with feedback at decay d."""
    for decay, want in ((None, 1 / 12), (0.8, 1.64 / 12), (1.0, 2 / 12)):
        assert spawn(_factor_worker, W, decay) == [pytest.approx(want)] * W, decay
