"""Whether an optimizer can step FSDP2's sharded parameters: found out before the first step, by a trial.

FSDP2 hands the optimizer DTensors, each rank holding a shard of dimension 0. An element-wise update (SGD, the Adam
family) runs on them as on plain tensors; an update that factors a matrix over its rows and columns (Adafactor) or
that redistributes in place can fail inside DTensor at the first step, deep in a training step, with an error about
placements that does not name the optimizer. An update that runs may still compute something else on shards than on
the whole tensor (a norm or a statistic taken per shard).

So each optimizer the strategy sets up gets one trial step, before training: a fresh optimizer of the same class and
hyperparameters (``type(optimizer)(params, **optimizer.defaults)``, of the defaults those its constructor takes) steps
two small sharded tensors (a matrix and, if the user's optimizer holds any, a vector; their first dimension not a
multiple of the ranks, as most parameters' is not), placed on the model's mesh as FSDP2 places parameters, and the same
step runs on the whole tensors in this process. Every rank runs the same trial on tensors of the same shapes, so a
failure (or a collective inside the update) is the same on all ranks. An optimizer whose class cannot be built from its
``defaults`` alone (a wrapper that takes another optimizer) is not tried.
"""

from __future__ import annotations

import inspect

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

TRIAL_STEPS = 2  # the second step is the first that reads state the first one created


def _trial_tensors(world: int, with_vector: bool) -> list[torch.Tensor]:
    rows = 2 * world + 1  # uneven, as most parameters' first dimension is: the last rank's shard is shorter
    matrix = torch.linspace(-1.0, 1.0, rows * 3).view(rows, 3)
    tensors = [matrix]
    if with_vector:
        tensors.append(torch.linspace(0.5, -0.5, rows))
    return tensors


def _grads(tensors: list[torch.Tensor], step: int) -> list[torch.Tensor]:
    return [(t * (0.3 + 0.1 * step) + 0.05).sin() for t in tensors]


def _run(optimizer_class: type, defaults: dict, params: list[torch.nn.Parameter], grads_of) -> None:
    optimizer = optimizer_class(params, **defaults)
    for step in range(TRIAL_STEPS):

        def closure(step: int = step) -> torch.Tensor:
            for p, g in zip(params, grads_of(step), strict=True):
                p.grad = g
            return torch.zeros(())

        for p, g in zip(params, grads_of(step), strict=True):
            p.grad = g
        optimizer.step(closure)


def _constructor_arguments(cls: type, defaults: dict) -> dict:
    """The hyperparameters of ``defaults`` that ``cls`` takes (some keep running values among their defaults)."""
    try:
        parameters = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return dict(defaults)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in parameters}


def check_runs_sharded(optimizer: torch.optim.Optimizer, mesh: DeviceMesh | None, device: torch.device) -> None:
    """Raises ``ValueError`` (one sentence naming the optimizer's class) where a trial step of ``optimizer``'s class
    on sharded tensors fails, or differs from the same step on the whole tensors; see the module docstring."""
    if mesh is None:
        return
    cls = type(optimizer)
    defaults = _constructor_arguments(cls, optimizer.defaults)
    held = [p for group in optimizer.param_groups for p in group["params"]]
    with_vector = any(p.dim() < 2 for p in held)
    placements = [Replicate()] * (mesh.ndim - 1) + [Shard(0)]
    world = mesh.size(mesh.ndim - 1)
    whole = [torch.nn.Parameter(t.to(device)) for t in _trial_tensors(world, with_vector)]
    try:
        sharded = [torch.nn.Parameter(distribute_tensor(t.detach().clone(), mesh, placements)) for t in whole]
        cls(sharded, **defaults)
    except Exception:  # a class not built from its defaults (a wrapper of another optimizer): not tried
        return

    start = [t.detach().clone() for t in whole]

    def sharded_grads(step: int) -> list[torch.Tensor]:
        return [distribute_tensor(g, mesh, placements) for g in _grads(start, step)]

    try:
        _run(cls, defaults, sharded, sharded_grads)
    except Exception as error:  # any failure of the user's update on DTensors is the finding
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise ValueError(
            f"ZeroPPStrategy: {cls.__name__} cannot step the model's sharded parameters (FSDP2 gives it DTensors, each"
            f" rank a shard of dimension 0): a trial step on two small sharded tensors raised {type(error).__name__}:"
            f" {first[:300]}; use an optimizer whose update works element-wise or on DTensors (AdamW, SGD, ...)."
        ) from error
    try:
        _run(cls, defaults, whole, lambda step: _grads(start, step))
    except Exception:  # it fails on whole tensors too: nothing to say about shards
        return
    for s, w in zip(sharded, whole, strict=True):
        got = s.detach().full_tensor() if isinstance(s, DTensor) else s.detach()
        if not torch.allclose(got.float(), w.detach().float(), rtol=1e-4, atol=1e-6):
            raise ValueError(
                f"ZeroPPStrategy: {cls.__name__} computes another update on the model's sharded parameters than on"
                " whole ones (a trial step on a small sharded tensor differs by"
                f" {float((got.float() - w.detach().float()).abs().max()):.3g}): its update reads statistics of the"
                " whole tensor that a shard does not hold; use an optimizer whose update works element-wise."
            )
