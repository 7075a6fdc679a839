"""The second-moment correction: qgZ's rounding noise taken out of an Adam-family optimizer's ``exp_avg_sq``.

Why: every coordinate qgZ delivers is ``g + n``, with ``n`` the inter-node hop's rounding error. Adam's first moment
averages ``n`` away, but its second moment averages ``(g + n)^2``, whose mean is ``g^2 + var(n)``: the denominator
grows, and every step is shorter than ZeRO-3's. That alone explains the defaults' late loss gap (a ZeRO-3 run with its
learning rate cut by the same amount loses the same: docs/accuracy.md).

What: the rank that sums the K pieces of a chunk (qgZ's last step) holds each piece's block scales ``s_k``. A block
rounded to nearest has an error of variance about ``s_k^2 / 12`` per element (uniform over one step), so the reduced
coordinate's noise variance is ``multiplier^2 * factor * sum_k s_k^2`` with ``factor`` 1/12 (1/6 with stochastic
rounding, which spreads over a whole step; twice that with error feedback, whose error each step is the difference
of two residuals). With rotated blocks (``gradient_rotation``) the rounding happens in rotated coordinates and the
inverse rotation spreads it: an element keeps ``1 / P`` of its power-of-two piece's variance. One fp32 per block is
accumulated over a step's reductions: no byte on the wire, ``4 / gradient_block_size`` bytes per element of the rank's
shard. ``benchmarks/adam_noise.py`` measures the estimate against the true squared error (nearest, stochastic
rounding, error feedback), and the step AdamW takes when fed ``g^2 - var`` against the exact-fed one (its figures:
docs/accuracy.md).

Where: right before the optimizer's update (after the closure's backward and any gradient clipping), for every
parameter of an optimizer :func:`judge` accepts (torch's Adam family; with ``second_moment_scope="matrices"``
only its parameters of two or more dimensions, :func:`in_scope`), ``exp_avg_sq`` is lowered so that the update
``b2 * v + (1 - b2) * g^2`` becomes ``max(b2 * v + (1 - b2) * (g^2 - var), FLOOR * (b2 * v + (1 - b2) * g^2))``,
``g`` the gradient the optimizer squares (``grad + wd * p`` with coupled L2 weight decay: :func:`squared_gradient`).
Then ``exp_avg_sq >= FLOOR * (b2 * v + (1 - b2) * g^2) >= 0`` after the update, whatever the estimate: the lowered
``v'`` is at least ``FLOOR * v - (1 - FLOOR) * shift * g^2`` (``shift = (1 - b2) / b2``), and ``b2 * v' + (1 - b2) *
g^2`` at least ``FLOOR`` times the uncorrected update. The floor keeps a step at most ``1 / sqrt(FLOOR)`` longer than
without the correction, where the estimate exceeds the coordinate's own square. Gradients rescaled after the backward
(clipping by norm, a scaler's unscaling) scale the variance by the same factor (each parameter's squared norm before
and after). A parameter whose state the step itself creates (the first step) is corrected right after that step, from
the blocks (``amsgrad``'s ``max_exp_avg_sq`` alike). The estimates hold until the next reduction after an update
starts the next step's (:class:`~lightning_zeropp.step_owner.StepOwner` tells): so that several optimizers stepping
after one backward (manual optimization, Fabric) each correct their own parameters, none twice for one step's noise,
and the reductions of one step (micro-batches) add up.

Cost: the norms are one multi-tensor pass over the gradients after the backward and one before the update; the
lowering is four element-wise passes over a parameter's shard (``v + shift g^2``, its share, the cap, the
subtraction). On a CPU each parameter is lowered alone, the cap broadcast from the blocks without expanding them to
elements where the blocks start at the parameter's start (parameter-aligned blocks; flat blocks expand): about the
cost of one AdamW step (``benchmarks/moments_cost.py``). On a GPU a unit's parameters are lowered together in
multi-tensor passes, the blocks expanded once: about 12 launches per unit in place of about 6 per parameter
(``PER_PARAMETER``).
"""

from __future__ import annotations

import bisect
import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from .blocks import UnitBlocks
from .compat import torch as compat

FLOOR = 0.5  # the corrected second moment never falls below this share of the uncorrected one
PER_PARAMETER = {"cpu"}
"""Devices whose shards are lowered one parameter at a time (:func:`_lower`, the blocks broadcast, never expanded):
on a CPU a call costs microseconds and the passes over memory are what counts. Elsewhere (GPUs) a unit's parameters
are lowered together (:func:`_lower_unit`): a fixed number of launches per unit in place of about five per
parameter, for one expansion of the blocks (``benchmarks/moments_cost.py --ops`` counts both)."""


def noise_factor(rounding: str, feedback_decay: float | None) -> float:
    """The variance of one element's error, in squared block scales: nearest rounding's uniform error over one step
    (1/12), stochastic rounding's ``f (1 - f)`` averaged over the fraction ``f`` (1/6); with error feedback at decay
    ``d``, times ``1 + d^2``.

    Error feedback's noise, derived: a reduction sends ``Q(x_t + d r_{t-1})`` and keeps ``r_t = x_t + d r_{t-1} -
    Q(x_t + d r_{t-1})``, so what arrives is ``x_t + d r_{t-1} - r_t``: its error is ``n_t = d r_{t-1} - r_t``. Each
    residual is one rounding's error (variance ``base * s^2``, ``s`` the block's scale), and two reductions' roundings
    are uncorrelated, so ``var(n_t) = (1 + d^2) base s^2`` (2 at ``d = 1``, 1.64 at 0.8), with the block scales of two
    consecutive steps taken as equal (the estimate reads the current step's). The reduction right after a reset
    (``error_feedback_reset``) carries no residual and has ``base`` alone: it is over-corrected by ``1 + d^2``, one
    reduction in ``error_feedback_reset``."""
    base = 1 / 6 if rounding == "stochastic" else 1 / 12
    return base if feedback_decay is None else base * (1 + feedback_decay**2)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the tensor itself otherwise), sharing its storage."""
    return t.to_local() if hasattr(t, "to_local") else t


@dataclass
class _UnitNoise:
    """One unit's accumulated noise variance, one fp32 per quantization block of its gradient chunk."""

    unit: UnitBlocks
    starts: tuple[int, ...]
    values: torch.Tensor
    _spans: dict[tuple[int, int], tuple[int, int, torch.Tensor]] = field(default_factory=dict)
    _uniform: dict[tuple[int, int], tuple[int, int, int] | None] = field(default_factory=dict)
    _owners: dict[tuple, torch.Tensor] = field(default_factory=dict)

    def per_element(self, start: int, length: int, numel: int) -> torch.Tensor:
        """The variance of elements ``[start, start + numel)`` of the chunk (a parameter's shard, whose padded segment
        is ``length`` long), one value per element, expanded from the blocks."""
        key = (start, length)
        if key not in self._spans:
            end = start + length
            first = bisect.bisect_right(self.starts, start) - 1
            last = bisect.bisect_left(self.starts, end)
            bounds = [start, *self.starts[first + 1 : last], end]
            lengths = torch.tensor(bounds, device=self.values.device).diff()
            self._spans[key] = (first, first + len(bounds) - 1, lengths)
        first, last, lengths = self._spans[key]
        return torch.repeat_interleave(self.values[first:last], lengths, output_size=length)[:numel]

    def owners(self, spans: tuple[tuple[int, int], ...], device: torch.device) -> torch.Tensor:
        """For each block, the index of the span ``(first, count)`` of blocks that holds it, ``len(spans)`` for the
        blocks of none: built once on the host for a set of spans (each step corrects the same parameters)."""
        key = (spans, device)
        if key not in self._owners:
            owner = torch.full((len(self.starts) - 1,), len(spans), dtype=torch.long)
            for index, (first, count) in enumerate(spans):
                owner[first : first + count] = index
            self._owners[key] = owner.to(device)
        return self._owners[key]

    def blocks_of(self, start: int, length: int) -> tuple[int, int, int] | None:
        """``(first, count, size)`` where the segment ``[start, start + length)`` is cut into blocks ``first ..
        first + count - 1`` of ``size`` elements from its start (the last one may be shorter), as parameter-aligned
        blocks are; None where its blocks are not (flat blocks straddling the segment's start)."""
        key = (start, length)
        if key not in self._uniform:
            end = start + length
            first = bisect.bisect_left(self.starts, start)
            last = bisect.bisect_left(self.starts, end)
            inside = self.starts[first:last]
            size = (inside[1] - inside[0]) if len(inside) > 1 else length
            uniform = bool(inside) and inside[0] == start and inside == tuple(range(start, end, size))
            self._uniform[key] = (first, len(inside), size) if uniform and size > 0 else None
        return self._uniform[key]


def _squared_norm(grad: torch.Tensor) -> torch.Tensor:
    """``sum(grad^2)`` in fp32, in one pass without a temporary."""
    return torch.linalg.vector_norm(grad, dtype=torch.float32).square()


def _lower(
    v: torch.Tensor,
    grad: torch.Tensor | None,
    entry: _UnitNoise,
    start: int,
    length: int,
    shift: float,
    ratio: torch.Tensor | None,
) -> None:
    """``v <- v - min(shift * var, (1 - FLOOR) * (v + shift * g^2))``: four passes over the shard, the variance
    broadcast from its blocks (never expanded to elements) where they are cut from the parameter's start, as
    parameter-aligned blocks are. ``grad`` None (a second moment the update already holds ``g^2`` in: the first
    step's, corrected after it): ``v - min(shift * var, (1 - FLOOR) * v)``."""
    if grad is None:
        room = v.mul(1 - FLOOR)
    else:
        g = grad if grad.dtype == v.dtype else grad.to(v.dtype)
        room = torch.addcmul(v, g, g, value=shift).mul_(1 - FLOOR)
    blocks = entry.blocks_of(start, length)
    if blocks is not None and v.is_contiguous():
        first, count, size = blocks
        cap = entry.values[first : first + count].to(v.device, v.dtype) * shift
        if ratio is not None:
            cap = cap * ratio.to(v.dtype)
        flat, numel = room.view(-1), room.numel()
        whole = numel // size
        if whole:
            head = flat[: whole * size].view(whole, size)
            torch.minimum(head, cap[:whole].unsqueeze(1), out=head)
        if numel > whole * size:
            tail = flat[whole * size :]
            torch.minimum(tail, cap[whole], out=tail)
    else:
        variance = entry.per_element(start, length, v.numel()).view_as(v).to(v.device, v.dtype) * shift
        if ratio is not None:
            variance = variance * ratio.to(v.dtype)
        torch.minimum(room, variance, out=room)
    v.sub_(room)


def _lower_unit(
    entry: _UnitNoise, items: list[tuple[torch.Tensor, torch.Tensor, int, int, float, torch.Tensor | None]]
) -> None:
    """:func:`_lower` for the parameters of one unit at once, ``items`` ``(v, grad, start, length, shift, ratio)``: a
    fixed number of passes whatever their count, each one launch on a GPU (``torch._foreach_*``), where :func:`_lower`
    pays about five per parameter. The blocks' variances are scaled (shift, clipping ratio) block by block, as
    :func:`_lower` scales them, and each block is written out ``B`` times, ``B`` the blocks' size (one pass, 4 bytes
    per element of the rank's shard plus the short blocks' padding, transient). A parameter's blocks of ``B``
    elements from its start (its last one shorter) put its element ``j`` at ``first * B + j`` there: its cap is a
    view. Same operations, same order: :func:`_lower`'s result bit for bit. Parameters whose blocks are cut otherwise
    (flat blocks straddling their start, another size) take :func:`_lower`."""
    spans = {id(item): entry.blocks_of(item[2], item[3]) for item in items}
    sizes = [size for span in spans.values() if span is not None and span[1] > 1 for size in span[2:]]
    B = max(sizes) if sizes else max((span[2] for span in spans.values() if span is not None), default=0)
    by_dtype: dict[tuple[torch.dtype, torch.device], list] = {}
    for item in items:
        v, grad, start, length, shift, ratio = item
        span = spans[id(item)]
        if span is None or (span[2] != B if span[1] > 1 else span[2] > B):
            _lower(v, grad, entry, start, length, shift, ratio)
        else:
            by_dtype.setdefault((v.dtype, v.device), []).append((v, grad, span[0], span[:2], shift, ratio))
    for (dtype, device), group in by_dtype.items():
        owner = entry.owners(tuple(span for *_, span, _, _ in group), device)
        scaled = entry.values.to(device, dtype)
        shifts = [shift for *_, shift, _ in group]
        if len(set(shifts)) == 1:
            scaled = scaled * shifts[0]
        else:
            scaled = scaled * torch.tensor([*shifts, 1.0], dtype=dtype, device=device)[owner]
        ratios = [ratio for *_, ratio in group]
        if any(r is not None for r in ratios):
            one = torch.ones((), dtype=torch.float32, device=device)
            each = torch.stack([*(one if r is None else r.to(device) for r in ratios), one]).to(dtype)
            scaled = scaled * each[owner]
        spread = scaled.unsqueeze(1).expand(-1, B).reshape(-1)  # block b's value at b * B ... b * B + B - 1
        vs = [v for v, *_ in group]
        grads = [g if g.dtype == dtype else g.to(dtype) for _, g, *_ in group]
        caps = [spread[first * B : first * B + g.numel()].view_as(g) for (_, _, first, *_), g in zip(group, grads)]
        rooms = compat.foreach_addcmul(vs, grads, grads, shifts)
        compat.foreach_mul_(rooms, 1 - FLOOR)
        compat.foreach_minimum_(rooms, caps)
        compat.foreach_sub_(vs, rooms)


def _squared_norms(grads: list[torch.Tensor]) -> torch.Tensor:
    """``sum(grad^2)`` of each gradient in fp32, one value each, in one multi-tensor pass."""
    return torch.stack(compat.foreach_norm(grads, 2, dtype=torch.float32)).square()


SCOPES = ("all", "matrices")


def in_scope(param: torch.Tensor, scope: str) -> bool:
    """Whether the correction lowers ``param``'s second moment: every parameter (``"all"``), or (``"matrices"``) one
    of two or more dimensions, counted on the whole parameter (a sharded DTensor's global shape). Decided from the
    parameter's shape alone: norm gains and biases are the parameters of one dimension."""
    return scope == "all" or param.dim() >= 2


# torch.optim's optimizers whose update keeps the second moment ``exp_avg_sq = b2 * v + (1 - b2) * g^2`` (``g`` the
# gradient they square: negated with ``maximize``, plus ``weight_decay * p`` where the decay is coupled L2) and divide
# by its square root: what the correction is derived for. Adamax keeps an infinity norm instead, SparseAdam has its own
# sparse update; neither qualifies, nor does any optimizer outside torch.optim (its update is not known here).
FAMILY: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.NAdam,
    torch.optim.RAdam,
)


@dataclass(frozen=True)
class Verdict:
    """Whether one optimizer's second moment is corrected, and why not where it is not."""

    optimizer: str  # the optimizer's class name
    corrected: bool
    reason: str = ""

    def describe(self) -> str:
        return f"{self.optimizer} corrected" if self.corrected else f"{self.optimizer}: {self.reason}, off"


def judge(optimizer: torch.optim.Optimizer) -> Verdict:
    """What ``optimizer`` is, for the correction: one of :data:`FAMILY` (or a subclass that keeps its ``step``), with
    ``betas`` whose second lies in (0, 1) in every group, and not ``differentiable`` (its state then belongs to an
    autograd graph that an in-place change would corrupt). Decided from the class, never from the attributes an
    object happens to have: an optimizer with ``betas`` and ``exp_avg_sq`` of another update rule is not corrected."""
    cls = type(optimizer)
    name = cls.__name__
    family = next((c for c in cls.__mro__ if c in FAMILY), None)
    if family is None:
        return Verdict(name, False, "not an Adam second moment")
    if inspect.unwrap(cls.step) is not inspect.unwrap(family.step):
        return Verdict(name, False, f"its own step (not {family.__name__}'s)")
    for group in optimizer.param_groups:
        betas = group.get("betas")
        if not isinstance(betas, (tuple, list)) or len(betas) != 2 or not 0.0 < float(betas[1]) < 1.0:
            return Verdict(name, False, f"betas={betas!r} (the correction needs 0 < betas[1] < 1)")
        if group.get("differentiable"):
            return Verdict(name, False, "differentiable=True")
    return Verdict(name, True)


def squared_gradient(param: torch.Tensor, grad: torch.Tensor, group: dict, adamw: bool) -> torch.Tensor:
    """The local gradient an Adam-family update squares into ``exp_avg_sq``: ``grad`` (its sign, ``maximize``, does
    not matter to its square), plus ``weight_decay * param`` where the decay is coupled L2 (Adam, NAdam, RAdam without
    ``decoupled_weight_decay``): ``-grad + wd * p`` with ``maximize``."""
    decay = float(group.get("weight_decay") or 0.0)
    if decay == 0.0 or adamw or group.get("decoupled_weight_decay"):  # an older AdamW lacks the key
        return grad
    p = _local(param).detach()
    g = grad.neg() if group.get("maximize") else grad
    return torch.add(g, p.to(g.dtype), alpha=decay)


class SecondMomentCorrection:
    """The noise variance of this step's qgZ reductions, by unit, and the correction of the second moment of every
    optimizer :func:`judge` accepts. A subscriber of the :class:`~lightning_zeropp.step_owner.StepOwner`.

    Args:
        factor: the variance of one element's error in squared block scales (:func:`noise_factor`).
        setting: the argument as the user gave it: ``True`` refuses an optimizer it cannot correct; ``"auto"``
            leaves that optimizer alone (and keeps no estimate for its parameters).
        scope: ``"all"`` corrects every parameter of a corrected optimizer; ``"matrices"`` only those of two or more
            dimensions (:func:`in_scope`).
    """

    def __init__(self, factor: float, setting: bool | str = True, scope: str = "all") -> None:
        if scope not in SCOPES:
            raise ValueError(f"ZeroPPStrategy: `second_moment_scope={scope!r}`: use one of {SCOPES}.")
        self.factor = factor
        self.setting = setting
        self.scope = scope
        self.verdicts: dict[int, Verdict] = {}  # id(optimizer) -> its verdict
        self._params: set[int] = set()  # id(param) of every corrected optimizer's parameters
        self._units: dict[str, _UnitNoise] = {}
        self._wanted: dict[str, bool] = {}  # unit name -> it holds a corrected optimizer's parameter
        self._reduced: set[str] = set()  # units reduced in this step
        self._norms: dict[int, torch.Tensor] = {}  # id(param) -> squared norm of its gradient after the backward
        self._first: dict[int, list] = {}  # id(optimizer) -> its parameters whose exp_avg_sq this update creates
        self._warnings: set[str] = set()
        self.corrected = 0  # parameters corrected so far (for tests and the log)

    # ------------------------------------------------------------------ which optimizers
    def judge_optimizer(self, optimizer: torch.optim.Optimizer) -> Verdict:
        """Decides for ``optimizer`` (once, when it is set up); ``True`` refuses one that cannot be corrected."""
        if id(optimizer) in self.verdicts:
            return self.verdicts[id(optimizer)]
        verdict = judge(optimizer)
        if not verdict.corrected and self.setting is True:
            raise ValueError(
                f"ZeroPPStrategy: `second_moment_correction=True` cannot correct {verdict.optimizer} ({verdict.reason}:"
                " the correction is derived for torch.optim's Adam, AdamW, NAdam and RAdam); set"
                f' `second_moment_correction="auto"`, which leaves {verdict.optimizer} alone, or False.'
            )
        self.verdicts[id(optimizer)] = verdict
        if verdict.corrected:
            params = (p for group in optimizer.param_groups for p in group["params"])
            self._params.update(id(p) for p in params if in_scope(p, self.scope))
            self._wanted.clear()
        return verdict

    def forget_optimizers(self) -> None:
        """Drops every verdict and estimate (the run's optimizers are done with)."""
        self.verdicts.clear()
        self._params.clear()
        self._units.clear()
        self._wanted.clear()
        self._reduced.clear()
        self._norms.clear()
        self._first.clear()

    def wants_before_update(self, optimizer: torch.optim.Optimizer) -> bool:
        verdict = self.verdicts.get(id(optimizer))
        return verdict is not None and verdict.corrected

    @property
    def active(self) -> bool:
        """Whether any optimizer is corrected (else nothing is estimated, kept or computed)."""
        return bool(self._params)

    @property
    def nbytes(self) -> int:
        """The accumulators this rank keeps across steps: one fp32 per gradient block of each unit's chunk."""
        return sum(e.values.numel() * e.values.element_size() for e in self._units.values())

    def _wants(self, unit: UnitBlocks) -> bool:
        if not self._params:
            return False
        if unit.name not in self._wanted:
            from .compat.torch import unit_fsdp_parameters

            self._wanted[unit.name] = any(id(p) in self._params for p, _ in unit_fsdp_parameters(unit.module))
        return self._wanted[unit.name]

    # ------------------------------------------------------------------ the step's phases
    def new_step(self) -> None:
        """The first reduction since an update: the last step's estimates are done with."""
        self._reduced.clear()
        self._norms.clear()

    def buffer(self, unit: UnitBlocks | None, chunk: int, starts: tuple[int, ...], device: torch.device) -> Any:
        """The per-block accumulator of ``unit``'s reduction of ``chunk`` elements in blocks starting at ``starts``
        (what :func:`lightning_zeropp.qgz.quantized_reduce_scatter` adds into), or None where nothing of the unit is
        corrected or its blocks cannot be mapped to parameters (no unit)."""
        if unit is None or not self._wants(unit):
            return None
        entry = self._units.get(unit.name)
        if entry is None or entry.starts != starts or entry.values.device != device:
            entry = self._units[unit.name] = _UnitNoise(unit, starts, torch.zeros(len(starts) - 1, device=device))
        elif unit.name not in self._reduced:  # the unit's first reduction of this step (later ones, micro-batches')
            entry.values.zero_()
        self._reduced.add(unit.name)
        return entry.values

    def reduced_parameters(self):
        """``(entry, param, start, length)`` for every trained parameter of every unit reduced this step: its place in
        the unit's gradient chunk (the padded shards of the trained parameters, one after another)."""
        from .compat.torch import unit_fsdp_parameters

        for name in self._reduced:
            entry = self._units[name]
            chunk = entry.starts[-1]
            params = unit_fsdp_parameters(entry.unit.module)
            if sum(length for _, length in params) != chunk:  # FSDP reduced only the parameters that got gradients
                params = [(p, length) for p, length in params if p.grad is not None]
            if sum(length for _, length in params) != chunk:
                self._warn_once(
                    f"ZeroPPStrategy: the gradient reduction of unit {entry.unit.name!r} held {chunk} elements per"
                    " rank, which no set of its parameters accounts for; its second moments are not corrected."
                )
                continue
            start = 0
            for param, length in params:
                yield entry, param, start, length
                start += length

    def backward_done(self) -> None:
        """Notes each corrected parameter's squared gradient norm, so that a rescaling before the update (clipping,
        a scaler's unscaling) rescales the variance alike. After every backward (the last one of an accumulation
        counts)."""
        grads, params = [], []
        for _, param, _, _ in self.reduced_parameters():
            if param.grad is not None and id(param) in self._params:
                grads.append(_local(param.grad))
                params.append(param)
        if not grads:
            return
        norms = _squared_norms(grads)
        for index, param in enumerate(params):
            self._norms[id(param)] = norms[index]

    def before_update(self, optimizer: torch.optim.Optimizer, fresh: bool) -> None:
        """Lowers ``exp_avg_sq`` of ``optimizer``'s parameters reduced this step (see the module docstring), on its
        first update on this step's gradients; a parameter without state yet is corrected by :meth:`after_update`."""
        if not fresh or not self.wants_before_update(optimizer):
            return
        groups = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        adamw = isinstance(optimizer, torch.optim.AdamW)
        todo = []
        for entry, param, start, length in self.reduced_parameters():
            group = groups.get(id(param))
            if group is None or param.grad is None or id(param) not in self._params:
                continue  # another optimizer's parameter, no gradient, or outside the scope
            todo.append((entry, param, start, length, group, _local(param.grad)))
        if not todo:
            return
        first = self._first.setdefault(id(optimizer), [])
        with torch.no_grad():
            # the gradient rescaled since the backward (clipping by norm): its noise too, by the same factor
            noted = [i for i, (_, param, *_) in enumerate(todo) if id(param) in self._norms]
            ratios: list[torch.Tensor | None] = [None] * len(todo)
            if noted:
                before = torch.stack([self._norms[id(todo[i][1])] for i in noted])
                after = _squared_norms([todo[i][-1] for i in noted])
                scale = torch.where(before > 0, after / before, 0.0)
                for k, i in enumerate(noted):
                    ratios[i] = scale[k]
            by_unit: dict[int, tuple[_UnitNoise, list]] = {}
            for (entry, param, start, length, group, grad), ratio in zip(todo, ratios, strict=True):
                b2 = float(group["betas"][1])
                v = optimizer.state.get(param, {}).get("exp_avg_sq")
                if v is None:  # the update creates it: corrected right after (no estimate expanded meanwhile)
                    first.append((entry, param, start, length, b2, ratio))
                    continue
                v = _local(v)
                if v.shape != grad.shape or not v.is_floating_point():
                    continue
                squared = squared_gradient(param, grad, group, adamw)
                by_unit.setdefault(id(entry), (entry, []))[1].append((v, squared, start, length, (1 - b2) / b2, ratio))
            for entry, items in by_unit.values():
                if items[0][0].device.type in PER_PARAMETER:
                    for v, grad, start, length, shift, ratio in items:
                        _lower(v, grad, entry, start, length, shift, ratio)
                else:
                    _lower_unit(entry, items)
                self.corrected += len(items)

    def after_update(self, optimizer: torch.optim.Optimizer, fresh: bool) -> None:
        """Corrects the parameters whose ``exp_avg_sq`` this update created (the first step: ``v = (1 - b2) g^2``
        with the noise in it, lowered for the steps after; with ``amsgrad`` its ``max_exp_avg_sq``, equal to ``v``
        after a first step, alike). The step's estimates stay for another optimizer stepping after the same backward;
        the next step's first reduction replaces them."""
        pending = self._first.pop(id(optimizer), [])
        with torch.no_grad():
            for entry, param, start, length, b2, ratio in pending:
                state = optimizer.state.get(param, {})
                v = state.get("exp_avg_sq")
                if v is None:
                    continue
                v = _local(v)
                if not v.is_floating_point() or v.shape != _local(param).shape:
                    continue
                _lower(v, None, entry, start, length, 1 - b2, ratio)
                peak = state.get("max_exp_avg_sq")
                if peak is not None and _local(peak).shape == v.shape:
                    _local(peak).copy_(v)
                self.corrected += 1

    def _warn_once(self, message: str) -> None:
        if message not in self._warnings:
            self._warnings.add(message)
            rank_zero_warn(message)
