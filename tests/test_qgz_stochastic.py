"""qgZ with stochastic rounding on real gloo ranks: bounded, reproducible per call, and unbiased where nearest is not.

Stochastic rounding sends ``y`` (in units of the block's step) to ``floor(y + u)``, ``u ~ U[0, 1)``: the error is
below one full step (not half, as for nearest) and its mean is 0. Per element e of this rank's output, with the
final multiplier m, hop 1's step ``s1_i(e) = A_i(e) / q1`` (``A_i(e)``: max |x| over the block of e in rank i's
piece) and hop 2's step ``s2_k(e) = B_k(e) / q2`` (``B_k(e)``: max over the block of node k's sum, at most its
exact value plus hop 1's errors)::

    |qgz - exact| <= m * (sum_i s1_i(e) + sum_k s2_k(e))           (nearest: half of it)

Unbiasedness, per element: each hop's error has mean 0 given what came before and lies in an interval one step wide
(at most ``m * s(e)``), so by Azuma-Hoeffding the mean error over M calls exceeds
``t(e) = sqrt(sum_h (m s_h(e))^2 * ln(2 / delta) / (2 M))`` with probability below delta. The seeds are fixed by
``call``, so the test is deterministic; delta = 1e-9 per element says a correct implementation passes it for
practically every choice of seeds.

The exposed case makes nearest rounding's bias visible: in every block a large element (a weight's outlier) shares
the scale with small ones whose node sum is below half of hop 2's step, so nearest sends them to exactly 0 on every
call, while stochastic rounding keeps their mean.
"""

import math

import pytest
import torch

from lightning_zeropp import kernels as tk
from lightning_zeropp.testing.distributed import spawn

pytestmark = pytest.mark.multiprocess

CALLS = 160  # reductions per case and topology: 4-8 s on 4 CPU ranks (starting them takes longer)
STAGES, BLOCK, INTRA_BITS, INTER_BITS = 2, 32, 8, 4
QMAX = {8: 127, 4: 7}
CASES = {"heavy": 301, "exposed": 256}  # case: chunk numel (301: a partial block at the end)
DELTA = 1e-9
WORLD = 4
TOPOLOGIES = {"2x2": (WORLD, 2), "4x1": (WORLD, 1)}  # nodes x ranks per node


def _inputs(case: str, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s reduce-scatter input: ``world`` chunks, made the same way wherever it is called."""
    chunk = CASES[case]
    g = torch.Generator().manual_seed(7919 * len(case) + rank)
    n = world * chunk
    if case == "heavy":  # magnitudes over 3 decades, shuffled
        scales = torch.logspace(-2, 1, n, dtype=torch.float64)[torch.randperm(n, generator=g)]
        return (torch.randn(n, generator=g, dtype=torch.float64) * scales).float()
    # every 8th element large (each 32-element block holds 4), the rest small and positive
    x = 0.025 + 0.025 * torch.rand(n, generator=g, dtype=torch.float64)
    x[exposed_large(n)] = 1.0 + 0.5 * rank
    return x.float()


def exposed_large(n: int) -> torch.Tensor:
    return torch.arange(n) % 8 == 0


def _reduce(x, groups, rounding, call):
    import torch.distributed as dist

    from lightning_zeropp.commplan import two_hop
    from lightning_zeropp.config import ZeroPPConfig
    from lightning_zeropp.ledger import CommLedger
    from lightning_zeropp.qgz import Reduction, quantized_reduce_scatter

    config = ZeroPPConfig(
        gradient_rounding=rounding, gradient_pieces=STAGES, gradient_block_size=BLOCK,
        intra_node_gradient_bits=INTRA_BITS, gradient_bits=INTER_BITS, kernel_backend="torch",
    )  # fmt: skip
    out = torch.empty(x.numel() // groups.topology.world_size)
    ledger = CommLedger(groups.topology)
    reduction = Reduction.of(groups.topology, two_hop(config), out.numel(), dist.ReduceOp.AVG, None, call=call,
                             backend=config.kernel_backend)  # fmt: skip
    quantized_reduce_scatter(out, x.clone(), reduction, groups, ledger)
    return out


def _worker(rank, world, topologies):
    """Every case on each topology (ranks per node), on one set of ranks: one start-up for all."""
    import torch.distributed as dist

    from lightning_zeropp.comm import exact_reduce_scatter
    from lightning_zeropp.ledger import CommLedger
    from lightning_zeropp.topology import ProcessGroups, Topology

    dist.init_process_group("gloo")
    report = {}
    for ranks_per_node in topologies:
        topo = Topology(world, ranks_per_node, rank)
        groups = ProcessGroups.build(topo)
        for case in CASES:
            x = _inputs(case, rank, world)
            exact = torch.empty(x.numel() // world)
            exact_reduce_scatter(exact, x.clone(), dist.ReduceOp.AVG, None, groups, CommLedger(topo))
            report[ranks_per_node, case] = {
                "stochastic": torch.stack([_reduce(x, groups, "stochastic", c) for c in range(CALLS)]),
                "again": _reduce(x, groups, "stochastic", 0),
                "fresh": torch.stack([_reduce(x, groups, "stochastic", None) for _ in range(2)]),
                "nearest": torch.stack([_reduce(x, groups, "nearest", c) for c in (0, 1)]),
                "exact": exact,
            }
    dist.destroy_process_group()
    return report


@pytest.fixture(scope="module")
def reports():
    return spawn(_worker, WORLD, [per_node for _, per_node in TOPOLOGIES.values()])


def _block_max(values: torch.Tensor) -> torch.Tensor:
    """Each element replaced by the max of its quantization block (blocks start at every stage piece's start)."""
    out = torch.empty_like(values)
    chunk = values.shape[-1]
    for s in range(STAGES):
        start, size = tk.stage_bounds(chunk, STAGES, s, BLOCK)
        for b in range(start, start + size, BLOCK):
            end = min(b + BLOCK, start + size)
            out[..., b:end] = values[..., b:end].amax(dim=-1, keepdim=True)
    return out


def _analysis(case: str, rank: int, world: int, per_node: int) -> dict[str, torch.Tensor]:
    """The exact result (fp64) and, per element, each hop's step times the final multiplier."""
    N, K = per_node, world // per_node
    chunk = CASES[case]
    pieces = torch.stack([_inputs(case, i, world).double().view(world, chunk)[rank] for i in range(world)])
    m = 1 / world
    truth = pieces.sum(0) * m
    hop1 = _block_max(pieces.abs()) / QMAX[INTRA_BITS] if N > 1 else torch.zeros_like(pieces)
    nodes = [slice(k * N, (k + 1) * N) for k in range(K)]
    if K > 1:  # node sums before re-quantizing: their exact value plus at most hop 1's steps
        sums = torch.stack([(pieces[k].sum(0).abs() + hop1[k].sum(0)) for k in nodes])
        hop2 = _block_max(sums) / QMAX[INTER_BITS]
    else:
        hop2 = torch.zeros(1, chunk, dtype=torch.float64)
    steps = torch.cat([hop1 * m, hop2 * m])  # (hops, chunk): every hop's rounding of element e
    return {"truth": truth, "steps": steps, "bound": steps.sum(0)}


@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_stochastic_rounding_is_bounded_reproducible_and_unbiased(reports, topology):
    world, per_node = TOPOLOGIES[topology]
    for rank, report in enumerate(reports):
        for case in CASES:
            r = report[per_node, case]
            where = f"rank {rank}, {case}"
            a = _analysis(case, rank, world, per_node)
            truth, bound = a["truth"], a["bound"]
            runs = r["stochastic"].double()
            assert runs.shape == (CALLS, CASES[case]), where
            torch.testing.assert_close(r["exact"].double(), truth, rtol=1e-6, atol=1e-7)

            # within one full step per hop; beyond half a step somewhere (nearest's bound), so it is not nearest
            err = runs - truth
            slack = 2 * torch.finfo(torch.float32).eps * truth.abs() + 1e-6 * bound
            excess = err.abs() - (bound + slack)  # measured: errors reach 0.75-0.90 of the bound
            assert excess.max() <= 0, f"{where}: error beyond the stochastic bound by {excess.max():.3g}"
            beyond_half = (err.abs() > bound / 2 + slack).sum().item()  # measured: 0.6% to 4.8% of them
            assert beyond_half > 0, f"{where}: no error beyond half a step in {CALLS} calls: nearest rounding?"
            nearest_err = (r["nearest"].double() - truth).abs()
            assert (nearest_err <= bound / 2 + slack).all(), f"{where}: nearest beyond half a step"

            # reproducible per call, different across calls; without a call number, fresh noise each time
            assert torch.equal(r["again"], r["stochastic"][0]), f"{where}: call 0 twice gave different results"
            distinct = torch.unique(r["stochastic"], dim=0).shape[0]
            assert distinct == CALLS, f"{where}: {CALLS} calls gave only {distinct} different results"
            assert not torch.equal(r["fresh"][0], r["fresh"][1]), f"{where}: call=None repeated its noise"
            assert torch.equal(r["nearest"][0], r["nearest"][1]), f"{where}: nearest rounding depends on the call"

            # unbiased per element: the mean error over the calls within Azuma-Hoeffding's bound
            mean_err = err.mean(0)
            t = (a["steps"].square().sum(0) * math.log(2 / DELTA) / (2 * CALLS)).sqrt()
            ratio = mean_err.abs() / t  # measured: at most 0.43
            assert ratio.max() <= 1, f"{where}: element {int(ratio.argmax())}: mean error {ratio.max():.2f}x the bound"

            if case == "exposed":
                small = ~exposed_large(world * CASES[case]).view(world, -1)[rank]
                # nearest: the small elements are 0 on every call (a bias of -truth); stochastic keeps their mean
                assert (r["nearest"][:, small] == 0).all(), f"{where}: the exposed elements were not rounded to 0"
                assert (truth[small] > 0).all()
                steps = a["steps"][:, small]
                t_pooled = math.sqrt(steps.square().sum(0).mean() * math.log(2 / DELTA) / (2 * CALLS * small.sum()))
                pooled = err[:, small].mean().item()
                nearest_bias = (r["nearest"][0].double() - truth)[small].mean().item()
                # measured: |pooled| <= 0.22 t_pooled, nearest's bias 12 (2x2) to 17 (4x1) t_pooled
                assert abs(pooled) <= t_pooled, f"{where}: stochastic mean error {pooled:.2e} > {t_pooled:.2e}"
                assert abs(nearest_bias) > 3 * t_pooled, f"{where}: nearest's bias {nearest_bias:.2e} not visible"
                # and element by element closer than nearest: measured |mean error| <= 0.47 of nearest's
                worse = mean_err[small].abs() >= truth[small]
                assert not worse.any(), f"{where}: {int(worse.sum())} small elements no better than nearest"
