"""Validated configuration of :class:`~lightning_zeropp.ZeroPPStrategy`.

Every user-facing argument is checked here, once, at construction. Arguments that can only be checked against the
running job (the world size, the model's module classes) are checked by :meth:`ZeroPPConfig.resolve` and by the
sharding code, with errors of the same form: the argument, the value, what is allowed.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffload, CPUOffloadPolicy, OffloadPolicy

from lightning_zeropp.kernels import Backend as KernelBackend

StateDictType = Literal["sharded", "full"]
GradientRounding = Literal["nearest", "stochastic"]
BlockAlignment = Literal["parameter", "flat"]
ModulePolicy = Callable[[nn.Module], bool]
ModuleSelection = set[type[nn.Module]] | list[str] | ModulePolicy | None
"""What ``auto_wrap_policy`` and ``activation_checkpointing_policy`` take, as Lightning's FSDP strategies do: a set (or
list) of module classes, their names (YAML), or a callable ``(module) -> bool`` that selects modules."""
CpuOffload = bool | CPUOffloadPolicy
"""What ``cpu_offload`` takes: a bool, or FSDP2's ``CPUOffloadPolicy`` (its ``pin_memory``); FSDP1's ``CPUOffload`` is
read as its ``offload_params``."""

# Types for the numeric arguments, so that LightningCLI (jsonargparse) refuses a bad YAML value at parse time in one
# line naming the key. Constructed in Python they are plain ints and floats, checked by ZeroPPConfig with its own
# messages; without jsonargparse (an optional extra) they are int and float.
_MIN_BLOCK_SIZE = 8  # a block's scale is one fp32 (4 bytes): smaller blocks make the scales outweigh the payload
_MAX_BLOCK_SIZE = 1 << 16
try:
    from jsonargparse.typing import NonNegativeInt, PositiveInt, restricted_number_type
except ImportError:  # pragma: no cover - jsonargparse is installed with the cli and test extras
    BlockSize = NonNegativeInt = PositiveInt = int
    Decay = float
else:
    BlockSize = restricted_number_type(
        "BlockSize", int, [(">=", _MIN_BLOCK_SIZE), ("<=", _MAX_BLOCK_SIZE)], docstring="elements per fp32 scale"
    )
    Decay = restricted_number_type("Decay", float, [(">", 0), ("<=", 1)], docstring="a float in (0, 1]")
PositiveIntOrAuto = PositiveInt | Literal["auto"]

_KERNEL_BACKENDS = get_args(KernelBackend)
_STATE_DICT_TYPES = ("sharded", "full")
_GRADIENT_ROUNDINGS = ("nearest", "stochastic")
_BLOCK_ALIGNMENTS = ("parameter", "flat")


def _fail(name: str, value: object, allowed: str) -> ValueError:
    return ValueError(f"ZeroPPStrategy: `{name}={value!r}` is not allowed; {allowed}.")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"ZeroPPStrategy: `{name}` must be True or False, got {value!r} ({type(value).__name__}).")


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"ZeroPPStrategy: `{name}` must be an int, got {value!r} ({type(value).__name__}).")


def _check_bits(name: str, value: object, allowed: tuple[int, ...]) -> None:
    _check_int(name, value)
    if value not in allowed:
        raise _fail(name, value, f"choose one of {', '.join(map(str, allowed))} bits")


def _check_block(name: str, value: object, bits: int) -> None:
    _check_int(name, value)
    if not _MIN_BLOCK_SIZE <= value <= _MAX_BLOCK_SIZE:
        raise _fail(name, value, f"use a block size between {_MIN_BLOCK_SIZE} and {_MAX_BLOCK_SIZE} elements")
    if bits == 4 and value % 2:
        raise _fail(name, value, "INT4 packs two values per byte, so use an even block size such as 128 or 256")


def _is_module_class(value: object) -> bool:
    return isinstance(value, type) and issubclass(value, nn.Module)


def _check_policy_signature(name: str, policy: Callable) -> None:
    """A policy is called with one module. FSDP1's auto-wrap policies (``size_based_auto_wrap_policy``, a
    ``ModuleWrapPolicy``) take ``(module, recurse, nonwrapped_numel)`` and decide by parameter counts of a recursion
    FSDP2 does not have: refused, with the forms that work."""
    try:
        signature = inspect.signature(policy)
    except (TypeError, ValueError):  # a builtin without a signature: it will be called with one module
        return
    try:
        signature.bind(nn.Module())
    except TypeError:
        raise TypeError(
            f"ZeroPPStrategy: `{name}` is a callable that cannot be called with one module (its signature is"
            f" {signature}). FSDP1's wrap policies take (module, recurse, nonwrapped_numel); this strategy shards with"
            f" FSDP2, which wraps whole modules: pass a callable (module) -> bool, a set of classes ({name}={{Block}})"
            f" or class names ({name}=['Block'])."
        ) from None


def offload_policy(cpu_offload: object) -> OffloadPolicy:
    """The FSDP2 offload policy for a valid ``cpu_offload`` argument (see :func:`check_strategy_arguments`)."""
    if isinstance(cpu_offload, OffloadPolicy):
        return cpu_offload
    if isinstance(cpu_offload, CPUOffload):
        cpu_offload = cpu_offload.offload_params
    return CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()


def offloads(cpu_offload: object) -> bool:
    """Whether a valid ``cpu_offload`` argument keeps the shards in host memory."""
    return isinstance(offload_policy(cpu_offload), CPUOffloadPolicy)


def _check_cpu_offload(value: object) -> None:
    if isinstance(value, (bool, OffloadPolicy, CPUOffload)):
        return
    raise TypeError(
        f"ZeroPPStrategy: `cpu_offload` must be True, False or a torch.distributed.fsdp.CPUOffloadPolicy, got {value!r}"
        f" ({type(value).__name__}). Example: cpu_offload=True or cpu_offload=CPUOffloadPolicy(pin_memory=True)."
    )


def _check_size_or_auto(name: str, value: object) -> None:
    if value == "auto":
        return
    _check_int(name, value)
    if value < 1:
        raise _fail(name, value, 'use a positive int or "auto"')


def _check_module_selection(name: str, value: object) -> None:
    if value is None or _is_module_class(value):
        return
    if callable(value) and not isinstance(value, str):
        _check_policy_signature(name, value)
        return
    if isinstance(value, str) or not isinstance(value, (set, frozenset, list, tuple)):
        raise TypeError(
            f"ZeroPPStrategy: `{name}` must be a set of nn.Module classes, a list of class names or a callable"
            f" (module) -> bool, got {value!r} ({type(value).__name__}). Example: {name}={{Block}},"
            f" {name}=['Block'] or {name}=lambda m: isinstance(m, Block)."
        )
    for item in value:
        if isinstance(item, str):
            continue
        if isinstance(item, type) and issubclass(item, nn.Module):
            continue
        raise TypeError(
            f"ZeroPPStrategy: `{name}` holds {item!r}, which is neither an nn.Module subclass nor a class name."
        )


@dataclass(kw_only=True, slots=True, frozen=True)
class ZeroPPConfig:
    """The ZeRO++ knobs. Field docs are the user documentation; see the strategy's docstring for the full table."""

    quantize_weights: bool = True
    """qwZ: all-gather weights in block-quantized INT8 (or INT4) in the forward pass."""
    weight_bits: Literal[8, 4] = 8
    """Bits per weight element on the wire for qwZ."""
    hpz_partition_size: int | Literal["auto"] = "auto"
    """hpZ: ranks that hold a secondary copy of the weights after forward. "auto" = ranks per node; 1 = off."""
    quantize_gradients: bool = True
    """qgZ: reduce gradients with the 2-hop quantized all-to-all instead of a reduce-scatter."""
    gradient_bits: Literal[4, 8] = 4
    """Bits per gradient element on the inter-node hop of qgZ."""
    intra_node_gradient_bits: Literal[4, 8] = 8
    """Bits per gradient element on the intra-node hop of qgZ."""
    weight_block_size: int = 256
    """Weight elements that share one fp32 scale."""
    gradient_block_size: int = 128
    """Gradient elements that share one fp32 scale."""
    gradient_rounding: GradientRounding = "nearest"
    """Rounding of gradients: "nearest" (half to even) or "stochastic" (unbiased)."""
    block_alignment: BlockAlignment = "parameter"
    """"parameter": no quantization block holds elements of two parameters (a small parameter never shares a scale
    with a large one); "flat": fixed blocks over each unit's flat buffer, as the reference implementation (an
    ablation: small parameters next to large ones can be rounded to zero)."""
    gradient_error_feedback: bool = False
    """qgZ: keep what the INT4 inter-node hop's quantization lost and add it (decayed) to the next step's values."""
    error_feedback_decay: float = 0.8
    """The factor the error feedback residual is carried to the next step with (0 < decay <= 1)."""
    error_feedback_reset: int = 1024
    """Zero the error feedback residuals every this many optimizer steps (0: never)."""
    weight_deltas: bool = False
    """Keep each node's hpZ copy of the weights across steps and update it with INT4 deltas of what each optimizer
    step changed, sent once per node (needs hpZ); the forward all-gather is built from that copy inside the node."""
    weight_delta_bits: Literal[4, 8] = 4
    """weight_deltas: bits per element of the deltas on the wire."""
    weight_delta_refresh: int = 1000
    """weight_deltas: rebuild the node copy exactly every this many optimizer steps (0: never); it is also rebuilt
    whenever the weights change outside an optimizer step (checkpoint loads, EMA swaps)."""
    pipeline_stages: int = 2
    """qgZ: pieces each chunk is cut into, so one piece's intra-node hop overlaps another's inter-node hop."""
    ranks_per_node: int | Literal["auto"] = "auto"
    """Ranks per (real or emulated) node. "auto" = the launcher's local world size."""
    kernel_backend: KernelBackend = "auto"
    """"auto": Triton on CUDA tensors, pure torch elsewhere; "triton" or "torch" to force one."""

    def __post_init__(self) -> None:
        _check_bool("quantize_weights", self.quantize_weights)
        _check_bool("quantize_gradients", self.quantize_gradients)
        _check_bits("weight_bits", self.weight_bits, (8, 4))
        _check_bits("gradient_bits", self.gradient_bits, (4, 8))
        _check_bits("intra_node_gradient_bits", self.intra_node_gradient_bits, (4, 8))
        _check_block("weight_block_size", self.weight_block_size, self.weight_bits)
        _check_block(
            "gradient_block_size", self.gradient_block_size, min(self.gradient_bits, self.intra_node_gradient_bits)
        )
        if self.gradient_rounding not in _GRADIENT_ROUNDINGS:
            raise _fail("gradient_rounding", self.gradient_rounding, f"choose one of {_GRADIENT_ROUNDINGS}")
        if self.block_alignment not in _BLOCK_ALIGNMENTS:
            raise _fail("block_alignment", self.block_alignment, f"choose one of {_BLOCK_ALIGNMENTS}")
        _check_bool("gradient_error_feedback", self.gradient_error_feedback)
        decay = self.error_feedback_decay
        if isinstance(decay, bool) or not isinstance(decay, (int, float)):
            raise TypeError(
                f"ZeroPPStrategy: `error_feedback_decay` must be a float, got {decay!r} ({type(decay).__name__})."
            )
        if not 0.0 < decay <= 1.0:
            raise _fail("error_feedback_decay", decay, "use a float in (0, 1]: 0.8 as LoCo, 1.0 for plain feedback")
        if self.gradient_error_feedback and not self.quantize_gradients:
            raise ValueError(
                "ZeroPPStrategy: `gradient_error_feedback=True` corrects qgZ's quantization error, but"
                " `quantize_gradients=False` reduces gradients exactly; turn qgZ on or leave error feedback off."
            )
        _check_int("error_feedback_reset", self.error_feedback_reset)
        if self.error_feedback_reset < 0:
            raise _fail("error_feedback_reset", self.error_feedback_reset, "use a number of steps >= 1, or 0 (never)")
        _check_bool("weight_deltas", self.weight_deltas)
        _check_bits("weight_delta_bits", self.weight_delta_bits, (4, 8))
        _check_int("weight_delta_refresh", self.weight_delta_refresh)
        if self.weight_delta_refresh < 0:
            raise _fail("weight_delta_refresh", self.weight_delta_refresh, "use a number of steps >= 1, or 0 (never)")
        if self.weight_deltas:
            if self.hpz_partition_size == 1:
                raise ValueError(
                    "ZeroPPStrategy: `weight_deltas=True` keeps the hpZ copy of the weights across steps, but"
                    " `hpz_partition_size=1` turns hpZ off; leave hpz_partition_size at 'auto' (ranks per node) or"
                    " turn weight_deltas off."
                )
            if self.weight_delta_bits == 4 and self.weight_block_size % 2:
                raise _fail(
                    "weight_block_size",
                    self.weight_block_size,
                    "weight_deltas sends INT4 deltas, which pack two values per byte; use an even block size",
                )
        _check_int("pipeline_stages", self.pipeline_stages)
        if self.pipeline_stages < 1:
            raise _fail("pipeline_stages", self.pipeline_stages, "use 1 (no overlap) or more")
        _check_size_or_auto("hpz_partition_size", self.hpz_partition_size)
        _check_size_or_auto("ranks_per_node", self.ranks_per_node)
        if self.kernel_backend not in _KERNEL_BACKENDS:
            raise _fail("kernel_backend", self.kernel_backend, f"choose one of {_KERNEL_BACKENDS}")
        for name in _NUMBERS:  # the CLI's restricted types (int and float subclasses) become plain numbers
            value = getattr(self, name)
            if not isinstance(value, (str, bool)):
                object.__setattr__(self, name, (float if isinstance(value, float) else int)(value))

    def resolve(self, world_size: int, local_world_size: int) -> tuple[int, int]:
        """Returns ``(ranks_per_node, hpz_partition_size)`` for a job of ``world_size`` ranks launched
        ``local_world_size`` per machine, or raises naming the argument at fault."""
        ranks_per_node = local_world_size if self.ranks_per_node == "auto" else self.ranks_per_node
        if local_world_size % ranks_per_node:
            raise _fail(
                "ranks_per_node",
                self.ranks_per_node,
                f"it must divide the {local_world_size} ranks launched per machine, or ranks of different machines"
                f" would count as one node; use 'auto' or one of {_divisors(local_world_size)}",
            )
        hpz = ranks_per_node if self.hpz_partition_size == "auto" else self.hpz_partition_size
        if self.weight_deltas and hpz == 1:
            raise ValueError(
                f"ZeroPPStrategy: `weight_deltas=True` needs hpZ, but hpz_partition_size={self.hpz_partition_size!r}"
                f" resolves to 1 here (ranks_per_node={ranks_per_node}): there is no node copy to keep. Set"
                " hpz_partition_size (and ranks_per_node) to 2 or more, or turn weight_deltas off."
            )
        if world_size % hpz:
            raise _fail(
                "hpz_partition_size",
                self.hpz_partition_size,
                f"the secondary partition must divide the world size {world_size}; use one of {_divisors(world_size)}"
                f" (1 turns hpZ off, {ranks_per_node} keeps it inside a node)",
            )
        return ranks_per_node, hpz


_NUMBERS = (
    "weight_bits", "gradient_bits", "intra_node_gradient_bits", "weight_block_size", "gradient_block_size",
    "error_feedback_decay", "error_feedback_reset", "weight_delta_bits", "weight_delta_refresh", "pipeline_stages",
    "hpz_partition_size", "ranks_per_node",
)  # fmt: skip


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_strategy_arguments(
    *,
    auto_wrap_policy: object,
    activation_checkpointing_policy: object,
    cpu_offload: object,
    state_dict_type: object,
    process_group_backend: object,
) -> None:
    """Checks the strategy arguments that are not part of :class:`ZeroPPConfig`."""
    _check_module_selection("auto_wrap_policy", auto_wrap_policy)
    _check_module_selection("activation_checkpointing_policy", activation_checkpointing_policy)
    _check_cpu_offload(cpu_offload)
    if state_dict_type not in _STATE_DICT_TYPES:
        raise _fail("state_dict_type", state_dict_type, f"choose one of {_STATE_DICT_TYPES}")
    if process_group_backend is not None:
        known = [b for b in dist.Backend.backend_list if b != "undefined"]
        # "gloo", or per device type as torch accepts it: "cpu:gloo,cuda:nccl"
        names = [part.split(":")[-1] for part in str(process_group_backend).split(",")]
        if not isinstance(process_group_backend, str) or not all(name in known for name in names):
            raise _fail(
                "process_group_backend",
                process_group_backend,
                f"choose one of {known}, a per-device form such as 'cpu:gloo,cuda:nccl', or None (automatic)",
            )
