"""Materializing a sharded model whose tensors were created on the meta device (the big-model path).

A model built under ``trainer.init_module(empty_init=True)`` / ``fabric.init_module(empty_init=True)``, or on the meta
device inside ``configure_model``, holds no data. The strategy shards it first (``fully_shard`` keeps meta tensors
meta, so no rank ever allocates a whole parameter), then :func:`materialize_meta_tensors` allocates each rank's shards
on the device and initializes them with the modules' own ``reset_parameters()``.

What differs from Lightning's helper for ``ModelParallelStrategy``:

- Only meta tensors are replaced. Tensors that already hold data (a layer built outside the meta context, weights
  loaded before ``fit``) keep it: Lightning empties the whole model once any tensor is meta.
- ``reset_parameters`` runs on every module whose subtree holds a meta tensor, children before parents and the
  LightningModule (the root) last, so that a parent's initialization of its subtree (a GPT's scaled residual
  projections) wins over its children's defaults, as it does when the model is built on a real device. Lightning
  calls it only on modules that hold a tensor directly.
- Nothing is left uninitialized silently: floating-point tensors start as NaN, and any that still hold a NaN after
  every ``reset_parameters`` ran are refused by name, on every rank (each rank checks its own shards; one small
  all-reduce makes the verdict common). Integer and boolean tensors cannot be told apart that way: they need a
  ``reset_parameters`` on a module on their path from the root.
- The modules' initializers run in the order their constructors run them (each module after its children, children
  in the order they were registered), so a model initialized from the meta device starts from the weights the same
  seed gives a model built on a real device (when its constructors draw only through ``reset_parameters``; not
  ``nn.TransformerEncoder``, whose constructor deep-copies one layer).
- A tied parameter (a head sharing the embedding's weight) keeps the initialization of the module that holds it
  first; another holder's ``reset_parameters`` draws into a stand-in, as its constructor drew into a weight the tie
  then replaced.
- torch.nn modules whose constructor initializes with a private ``_reset_parameters()`` (``nn.MultiheadAttention``,
  ``nn.Transformer``) are initialized by it, as their constructor does.
- A random initializer draws the numbers of the whole parameter, as on one device, and each rank keeps its slice
  (:class:`WholeDraws`): the same seed gives the same weights at any number of ranks.

Why whole draws. DTensor keeps a sharded random initialization equal to an unsharded one only on devices with a
settable generator offset (CUDA-like meshes: its RNG tracker). On a CPU mesh a random op on a sharded parameter runs
on each rank's local shard with that rank's generator, which is in the same state on every rank: every rank draws
the same numbers (the two halves of a matrix come out identical at 2 ranks), and the ranks' generators then drift
apart (each drew its shard's count). :class:`WholeDraws` intercepts the in-place random initializers on a sharded
tensor of such a mesh, draws the tensor of the global shape with the same call (the generator, the default one or a
``generator=`` argument, advances as on one device, identically on every rank), and copies this rank's slice into
the local shard. One whole parameter exists at a time, for the duration of one call: the setup peak grows by the
largest parameter at most, never by a unit. Meshes with DTensor's RNG tracker (CUDA) keep DTensor's behaviour.

::

    one device                        2 ranks (Shard(0), 7 rows: chunks of 4 and 3)
    w.normal_()  -> rows 0..6          rank r: full = empty(7, n).normal_()   (the same 7 x n numbers on both ranks)
                                               local.copy_(full[4r : 4r + 4])   rank 0: rows 0-3, rank 1: rows 4-6
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.overrides import TorchFunctionMode

from .compat.torch import replace_meta_tensors, reset_function, strided_shard_factor

__all__ = ["WholeDraws", "materialize_meta_tensors", "has_meta_tensors"]


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))


def _direct_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def materialize_meta_tensors(model: nn.Module, device: torch.device) -> list[str]:
    """Allocates every meta parameter and buffer of the (sharded) ``model`` on ``device`` and initializes it with
    ``reset_parameters()`` (``_reset_parameters()`` for ``nn.MultiheadAttention`` and ``nn.Transformer``) of every
    module whose subtree holds a meta tensor, each module after its children (``model`` itself last), random numbers
    drawn whole (:class:`WholeDraws`). Returns the names of the tensors it materialized. Raises ``ValueError`` naming
    the tensors no ``reset_parameters`` initialized. Collective when the default process group exists (every rank must
    call it)."""
    owners: dict[str, nn.Module] = {}  # tensor name -> the module that holds it directly
    for prefix, module in model.named_modules():
        for name, t in _direct_tensors(module):
            if t.is_meta:
                owners.setdefault(f"{prefix}.{name}" if prefix else name, module)
    if not owners:
        return []
    # Children before parents, the root last: a parent's (or the LightningModule's) own initialization of its
    # subtree wins over its children's defaults, as when the model is built on a real device; and in the order its
    # constructor runs them, so that the random numbers fall where they fall on a real device. The order depends on
    # the model alone, never on the rank or the world size: every rank draws the same sequence.
    resetting = [(prefix, m) for prefix, m in _children_first(model) if reset_function(m) and has_meta_tensors(m)]
    covered = {id(m) for _, m in resetting}
    # A tied parameter (a head sharing the embedding's weight) belongs to the module that holds it first; when that
    # module initializes it, another holder's reset draws into a stand-in, as its constructor drew into a weight the
    # tie then replaced: the tied weight keeps its creator's initialization, and the random numbers stay in step.
    creators: dict[int, nn.Module] = {}
    for m in model.modules():
        if reset_function(m):
            for p in m.parameters(recurse=False):
                creators.setdefault(id(p), m)
    # Integer/bool tensors: no NaN tells whether they were set; a module on their path to the root must say how.
    unknowable = sorted(
        name
        for name in owners
        if not (_get(model, name).is_floating_point() or _get(model, name).is_complex())
        and not any(id(m) in covered for m in _path(model, name))
    )
    replace_meta_tensors(model, device)
    draws = WholeDraws()
    with torch.no_grad():
        for name in owners:
            t = _get(model, name)
            if t.is_floating_point() or t.is_complex():
                _local(t).fill_(math.nan)
        with draws:
            for prefix, module in resetting:
                draws.where = f"{type(module).__name__} ({prefix or 'the root'})"
                with _tied_left_alone(module, creators):
                    reset_function(module)()
    left = [name for name in owners if _holds_nan(_get(model, name))]
    left = _agreed(sorted(owners), left, device)
    problems = sorted(set(left) | set(unknowable))
    if problems:
        shown = ", ".join(problems[:8]) + (f", ... ({len(problems)} in all)" if len(problems) > 8 else "")
        classes = sorted({type(owners[n]).__name__ for n in problems})
        raise ValueError(
            f"ZeroPPStrategy: the model was built on the meta device (`init_module(empty_init=True)` or in"
            f" `configure_model`), and no `reset_parameters()` initialized these tensors: {shown}. Define"
            f" `reset_parameters()` on their modules ({', '.join(classes)}) or on the LightningModule (it runs last,"
            " after every submodule's), or build those layers outside the meta device."
        )
    return sorted(owners)


def _children_first(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module of ``model`` once (a shared one where first met), each after its children, children in the order
    they were registered: the order in which constructors run the children's initializers, then their own."""
    order: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()

    def visit(prefix: str, module: nn.Module) -> None:
        seen.add(id(module))
        for name, child in module.named_children():
            if id(child) not in seen:
                visit(f"{prefix}.{name}" if prefix else name, child)
        order.append((prefix, module))

    visit("", model)
    return order


@contextmanager
def _tied_left_alone(module: nn.Module, creators: dict[int, nn.Module]) -> Iterator[None]:
    """Inside: ``module``'s parameters that another module holds first (and initializes) are replaced by stand-ins of
    the same shape and sharding, so that ``module``'s reset draws into those."""
    tied = {name: p for name, p in module.named_parameters(recurse=False) if creators.get(id(p)) is not module}
    for name, p in tied.items():
        setattr(module, name, nn.Parameter(torch.empty_like(p), requires_grad=p.requires_grad))
    try:
        yield
    finally:
        for name, p in tied.items():
            setattr(module, name, p)


def _path(model: nn.Module, name: str) -> list[nn.Module]:
    """The modules from ``model`` down to the one that holds the tensor ``name``."""
    modules, module = [model], model
    for part in name.split(".")[:-1]:
        module = module.get_submodule(part)
        modules.append(module)
    return modules


def _get(model: nn.Module, name: str) -> torch.Tensor:
    module_name, _, attr = name.rpartition(".")
    return getattr(model.get_submodule(module_name) if module_name else model, attr)


def _holds_nan(t: torch.Tensor) -> bool:
    if not (t.is_floating_point() or t.is_complex()):
        return False
    return bool(torch.isnan(_local(t)).any())


def _agreed(names: list[str], left: list[str], device: torch.device) -> list[str]:
    """The union over ranks of the uninitialized tensors (each rank sees only its own shards)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return left
    flags = torch.tensor([name in left for name in names], dtype=torch.int32, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return [name for name, flag in zip(names, flags.tolist()) if flag]


# ------------------------------------------------------------------------------------------------ whole draws
# In-place random initializers: each fills its first argument, and the numbers it draws depend on that tensor's shape
# only. nn.init's uniform_, normal_ and kaiming_uniform_ dispatch to a TorchFunctionMode as a whole (the mode is off
# while it handles them, so the Tensor method they call inside would not be seen): they are drawn whole themselves.
# The other nn.init functions (xavier_*, kaiming_normal_, trunc_normal_, sparse_, orthogonal_) reach these methods
# while the mode is on.
_IN_PLACE_DRAWS: frozenset[Callable] = frozenset({
    torch.Tensor.uniform_, torch.Tensor.normal_, torch.Tensor.bernoulli_, torch.Tensor.exponential_,
    torch.Tensor.geometric_, torch.Tensor.log_normal_, torch.Tensor.cauchy_, torch.Tensor.random_,
    nn.init.uniform_, nn.init.normal_, nn.init.kaiming_uniform_,
})  # fmt: skip
# Random tensors shaped like their first argument: drawn whole, returned as a DTensor sharded like it.
_LIKE_DRAWS: frozenset[Callable] = frozenset({torch.rand_like, torch.randn_like, torch.randint_like})
# A Python value read from a sharded tensor: nn.init.trunc_normal_ redraws until `not mask.any()`, and on a CPU mesh
# DTensor answers that from the local shard (ranks would then draw different counts): read from the whole tensor.
_SCALARS: frozenset[Callable] = frozenset({torch.Tensor.__bool__, torch.Tensor.item, torch.Tensor.tolist})
# Random ops whose numbers depend on the values of a sharded input (probabilities, means): drawing them whole would
# need the whole input; refused rather than drawn alike on every rank.
_REFUSED: frozenset[Callable] = frozenset({
    torch.bernoulli, torch.Tensor.bernoulli, torch.normal, torch.poisson, torch.multinomial, torch.Tensor.multinomial,
    torch.dropout, torch.Tensor.bernoulli_, F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout,
    F.feature_alpha_dropout,
})  # fmt: skip


class WholeDraws(TorchFunctionMode):
    """Inside: a random initializer called on a tensor sharded over a mesh without DTensor's RNG tracker (a CPU mesh)
    draws the whole tensor and keeps this rank's slice, so that every rank's shard holds what one device would hold
    there and every rank's generator advances as one device's does.

    Intercepted (first argument sharded): the in-place methods ``uniform_``, ``normal_``, ``bernoulli_`` (with a
    float probability), ``exponential_``, ``geometric_``, ``log_normal_``, ``cauchy_``, ``random_``, the nn.init
    functions that dispatch as a whole (``uniform_``, ``normal_``, ``kaiming_uniform_``: the others reach the
    methods), and ``rand_like``, ``randn_like``, ``randint_like``. An explicit ``generator=`` is passed on: it
    advances as on one device. Random ops whose numbers depend on a sharded input's values (``bernoulli`` with a
    sharded probability tensor, ``normal`` with sharded means, dropout) raise ``ValueError``. Elementwise ops
    (``fill_``, ``zero_``, ``mul_``, ``erfinv_``, ``clamp_``) act on the local shard, as they should.

    Shardings: ``Shard(d)`` and ``Replicate()`` on each mesh dimension (FSDP2, HSDP's ``(Replicate, Shard(0))``),
    chunked as ``torch.chunk`` does (the last ranks' chunks shorter or empty). Contiguous whole draws: a random op on
    a non-contiguous view of a sharded parameter draws as on a contiguous tensor of its shape. A Python value read
    from a sharded tensor (``bool``, ``item``, ``tolist``: ``trunc_normal_`` redraws until ``not mask.any()``) is
    read from the whole tensor, so that every rank loops as often as one device does (on a CPU mesh DTensor answered
    from the local shard: the ranks looped 6 and 7 times on a 7 x 9 tensor). Not supported on a sharded tensor,
    with DTensor's error at any number of ranks: ``nn.init.sparse_`` (index assignment) and ``orthogonal_`` of a
    matrix with fewer rows than columns (an in-place transpose).
    """

    def __init__(self) -> None:
        super().__init__()
        self.where = "materialization"  # which reset_parameters() is running, for the errors
        # One buffer per dtype and device that every whole draw views: a fresh tensor per draw (a few MB each, freed
        # at once) left the allocator holding freed blocks, and the setup peak grew by several parameters' worth.
        self._scratch: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._scratch.clear()

    def _whole(self, tensor: DTensor, local: torch.Tensor) -> torch.Tensor:
        """An uninitialized contiguous tensor of ``tensor``'s global shape, a view of the scratch buffer."""
        key, numel = (tensor.dtype, local.device), tensor.numel()
        if key not in self._scratch or self._scratch[key].numel() < numel:
            self._scratch.pop(key, None)  # freed before the larger one exists
            self._scratch[key] = torch.empty(numel, dtype=tensor.dtype, device=local.device)
        return self._scratch[key][:numel].view(tensor.shape)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if not args and "tensor" in kwargs:  # nn.init.normal_(tensor=w)
            args = (kwargs.pop("tensor"),)
        first = args[0] if args else None
        drawn_alone = not _any_dtensor(args[1:], kwargs)  # bernoulli_(p) with a sharded tensor p: refused below
        if func in _IN_PLACE_DRAWS and _untracked(first) and drawn_alone:
            return self._in_place(func, first, args[1:], kwargs)
        if func in _LIKE_DRAWS and _untracked(first):
            return self._like(func, first, args[1:], kwargs)
        if func in _SCALARS and _untracked(first):  # a loop's test (trunc_normal_'s rejection): the global value
            return func(first.full_tensor(), *args[1:], **kwargs)
        if func in _REFUSED and (_any_untracked(args, kwargs)):
            raise ValueError(
                f"ZeroPPStrategy: `{getattr(func, '__name__', func)}` on a sharded tensor in `reset_parameters()`"
                f" of {self.where}, while materializing a model built on the meta device: its numbers depend on the"
                " values of a sharded input, so every rank would draw its shard alike. Initialize with an in-place"
                " initializer (`uniform_`, `normal_`, `bernoulli_(p)` with a float `p`, nn.init), or build that layer"
                " outside the meta device."
            )
        return func(*args, **kwargs)

    def _in_place(self, func: Callable, tensor: DTensor, rest: tuple, kwargs: dict[str, Any]) -> DTensor:
        local = tensor.to_local()
        region = _local_region(tensor, self.where)
        if tuple(local.shape) == tuple(tensor.shape):  # nothing sharded: the local draw is the whole one
            func(local, *rest, **kwargs)
            return tensor
        whole = self._whole(tensor, local)
        func(whole, *rest, **kwargs)
        local.copy_(whole[region])
        return tensor

    def _like(self, func: Callable, tensor: DTensor, rest: tuple, kwargs: dict[str, Any]) -> DTensor:
        local = tensor.to_local()
        region = _local_region(tensor, self.where)
        whole = func(self._whole(tensor, local), *rest, **kwargs)
        return DTensor.from_local(whole[region].clone(), tensor.device_mesh, tensor.placements, run_check=False,
                                  shape=tensor.shape, stride=whole.stride())  # fmt: skip


def _rng_tracked(device_type: str) -> bool:
    """Whether DTensor keeps sharded random ops equal to unsharded ones on this device type: its RNG tracker runs
    where the device module can set the generator's state (``torch.cuda``), not on CPU."""
    return hasattr(getattr(torch, device_type, None), "set_rng_state")


def _untracked(t: Any) -> bool:
    return isinstance(t, DTensor) and not _rng_tracked(t.device_mesh.device_type)


def _any_dtensor(args: tuple, kwargs: dict[str, Any]) -> bool:
    return any(isinstance(a, DTensor) for a in (*args, *kwargs.values()))


def _any_untracked(args: tuple, kwargs: dict[str, Any]) -> bool:
    return any(_untracked(a) for a in (*args, *kwargs.values()))


def _local_region(tensor: DTensor, where: str) -> tuple[slice, ...]:
    """The slice of the global tensor that this rank's local tensor holds (``torch.chunk`` along each sharded dim, in
    the order of the mesh dimensions, as DTensor's ``Shard`` splits). A strided shard (FSDP2 over a tensor-parallel
    plan: ``(_StridedShard(d, split_factor=t), Shard(d))``) splits after the later mesh dims' shards of its dim: this
    rank's tensor-parallel piece, then its data-parallel part of that piece, still one contiguous slice."""
    bounds = [(0, n) for n in tensor.shape]
    coordinate = tensor.device_mesh.get_coordinate()
    placements = tensor.placements
    order = sorted(range(len(placements)), key=lambda m: (strided_shard_factor(placements[m]) is not None, m))
    done: dict[int, int] = {}  # tensor dim -> how many pieces it is split into so far
    for mesh_dim in order:
        placement = placements[mesh_dim]
        if isinstance(placement, Replicate):
            continue
        factor = strided_shard_factor(placement)
        dim = placement.dim % tensor.ndim if type(placement) is Shard or factor is not None else None
        if dim is None or (factor is not None and factor != done.get(dim, 1)):  # Partial; a stride not of the later
            raise ValueError(  # shards (the only one FSDP2 over tensor parallelism makes): no contiguous slice
                f"ZeroPPStrategy: a random initializer in `reset_parameters()` of {where} ran on a tensor placed as"
                f" {tuple(placements)}; materializing from the meta device draws whole tensors only for Shard and"
                " Replicate placements, and for FSDP's strided shard over a tensor-parallel split. Initialize that"
                " tensor before sharding it (build it outside the meta device) or load it from a checkpoint."
            )
        start, stop = bounds[dim]
        size = tensor.device_mesh.size(mesh_dim)
        chunk = -(-(stop - start) // size)
        low = min(start + coordinate[mesh_dim] * chunk, stop)
        bounds[dim] = (low, min(low + chunk, stop))
        done[dim] = done.get(dim, 1) * size
    local_shape = tuple(hi - lo for lo, hi in bounds)
    if local_shape != tuple(tensor.to_local().shape):
        raise AssertionError(f"local shard {tuple(tensor.to_local().shape)} != computed {local_shape} ({where})")
    return tuple(slice(lo, hi) for lo, hi in bounds)
