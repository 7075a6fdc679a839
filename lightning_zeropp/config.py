"""The arguments of :class:`~lightning_zeropp.ZeroPPStrategy` (both front doors), defined once.

:class:`ZeroPPConfig` is the single definition of every argument: its type (what LightningCLI parses), its default,
its check and its documentation. The strategies' signatures and ``Arguments:`` docstrings, LightningCLI's help and the
docs' table (docs/arguments.md) are generated from it (:mod:`lightning_zeropp.arguments`): adding a field is all it
takes.

Every argument is checked here, once, at construction. Arguments that can only be checked against the running job
(the world size, the model's module classes) are checked by :meth:`ZeroPPConfig.resolve` and by the sharding code,
with errors of the same form: the argument, the value, what is allowed.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import Field, dataclass, field, fields
from datetime import timedelta
from typing import Any, Literal, get_args

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.utilities.rank_zero import rank_zero_deprecation
from torch import nn
from torch.distributed.fsdp import CPUOffload, CPUOffloadPolicy, OffloadPolicy

from lightning_zeropp.kernels import Backend as KernelBackend

StateDictType = Literal["sharded", "full"]
GradientRounding = Literal["nearest", "stochastic"]
GradientRotation = Literal["none", "hadamard"]
BlockAlignment = Literal["parameter", "flat"]
SecondMomentScope = Literal["all", "matrices"]
GradientQuantizationScope = Literal["auto", "all", "matrices"]
ShardingStrategy = Literal["FULL_SHARD", "HYBRID_SHARD"]
ModulePolicy = Callable[[nn.Module], bool]
ModuleSelection = set[type[nn.Module]] | list[str] | ModulePolicy | None
"""What ``auto_wrap_policy`` and ``activation_checkpointing_policy`` take, as Lightning's FSDP strategies do: a set (or
list) of module classes, their names (YAML), or a callable ``(module) -> bool`` that selects modules."""
CpuOffload = bool | CPUOffloadPolicy
"""What ``cpu_offload`` takes: a bool, or FSDP2's ``CPUOffloadPolicy`` (its ``pin_memory``); FSDP1's ``CPUOffload`` is
read as its ``offload_params``."""

Check = Callable[[str, Any], None]
"""An argument's own check: ``check(name, value)`` raises naming the argument, the value and the fix."""

# Types for the numeric arguments, so that LightningCLI (jsonargparse) refuses a bad YAML value at parse time in one
# line naming the key. Constructed in Python they are plain ints and floats, checked by ZeroPPConfig with its own
# messages (and the parser's int and float subclasses become plain numbers); without jsonargparse (an optional extra)
# they are int and float.
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
_STATE_DICT_TYPES = get_args(StateDictType)
_GRADIENT_ROUNDINGS = get_args(GradientRounding)
_GRADIENT_ROTATIONS = get_args(GradientRotation)
_BLOCK_ALIGNMENTS = get_args(BlockAlignment)
_SECOND_MOMENT_SCOPES = get_args(SecondMomentScope)
_GRADIENT_QUANTIZATION_SCOPES = get_args(GradientQuantizationScope)
_SHARDING_STRATEGIES = get_args(ShardingStrategy)


def _fail(name: str, value: object, allowed: str) -> ValueError:
    return ValueError(f"ZeroPPStrategy: `{name}={value!r}` is not allowed; {allowed}.")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"ZeroPPStrategy: `{name}` must be True or False, got {value!r} ({type(value).__name__}).")


def _check_bool_or_auto(name: str, value: object) -> None:
    if value != "auto" or not isinstance(value, str):
        _check_bool(name, value)


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"ZeroPPStrategy: `{name}` must be an int, got {value!r} ({type(value).__name__}).")


def _check_bits(name: str, value: object, allowed: tuple[int, ...]) -> None:
    _check_int(name, value)
    if value not in allowed:
        raise _fail(name, value, f"choose one of {', '.join(map(str, allowed))} bits")


def _bits(*allowed: int) -> Check:
    return lambda name, value: _check_bits(name, value, allowed)


def _check_block(name: str, value: object) -> None:
    _check_int(name, value)
    if not _MIN_BLOCK_SIZE <= value <= _MAX_BLOCK_SIZE:
        raise _fail(name, value, f"use a block size between {_MIN_BLOCK_SIZE} and {_MAX_BLOCK_SIZE} elements")


def _check_even_block(name: str, value: int, bits: int) -> None:
    if bits == 4 and value % 2:
        raise _fail(name, value, "INT4 packs two values per byte, so use an even block size such as 128 or 256")


def _one_of(allowed: tuple) -> Check:
    def check(name: str, value: object) -> None:
        if value not in allowed:
            raise _fail(name, value, f"choose one of {allowed}")

    return check


def _steps(zero: str) -> Check:
    """The check of a count of optimizer steps: an int >= 1, or 0, which means ``zero``."""

    def check(name: str, value: object) -> None:
        _check_int(name, value)
        if value < 0:
            raise _fail(name, value, f"use a number of steps >= 1, or 0 ({zero})")

    return check


def _check_pieces(name: str, value: object) -> None:
    _check_int(name, value)
    if value < 1:
        raise _fail(name, value, "use 1 (no overlap) or more")


def _check_decay(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"ZeroPPStrategy: `{name}` must be a float, got {value!r} ({type(value).__name__}).")
    if not 0.0 < value <= 1.0:
        raise _fail(name, value, "use a float in (0, 1]: 1.0 for classic feedback (the default)")


def _check_process_group_backend(name: str, value: object) -> None:
    if value is None:
        return
    known = [b for b in dist.Backend.backend_list if b != "undefined"]
    # "gloo", or per device type as torch accepts it: "cpu:gloo,cuda:nccl"
    names = [part.split(":")[-1] for part in str(value).split(",")]
    if not isinstance(value, str) or not all(n in known for n in names):
        allowed = f"choose one of {known}, a per-device form such as 'cpu:gloo,cuda:nccl', or None (automatic)"
        raise _fail(name, value, allowed)


def _check_timeout(name: str, value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (timedelta, int, float)):
        raise TypeError(
            f"ZeroPPStrategy: `{name}` must be a datetime.timedelta, a number of seconds or None, got {value!r}"
            f" ({type(value).__name__}). Example: {name}=timedelta(minutes=30) or {name}=1800."
        )
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if not seconds > 0 or seconds == float("inf"):
        raise _fail(name, value, "use a positive, finite duration, e.g. timedelta(minutes=30) or 1800 (seconds)")


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
    """The FSDP2 offload policy for a valid ``cpu_offload`` argument (see :class:`ZeroPPConfig`)."""
    if isinstance(cpu_offload, OffloadPolicy):
        return cpu_offload
    if isinstance(cpu_offload, CPUOffload):
        cpu_offload = cpu_offload.offload_params
    return CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()


def offloads(cpu_offload: object) -> bool:
    """Whether a valid ``cpu_offload`` argument keeps the shards in host memory."""
    return isinstance(offload_policy(cpu_offload), CPUOffloadPolicy)


def _check_cpu_offload(name: str, value: object) -> None:
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


def _check_tensor_parallel_size(name: str, value: object) -> None:
    _check_int(name, value)
    if value < 1:
        raise _fail(name, value, "use 1 (no tensor parallelism) or the size of the model's tensor-parallel groups")


def tensor_parallel_fits(tensor_parallel_size: int, ranks_per_node: int, given: object) -> None:
    """Refuses a tensor-parallel size that does not divide the node (``given``: ``ranks_per_node`` as the user gave
    it): its groups would span two nodes, and tensor parallelism's activation traffic would cross them."""
    if ranks_per_node % tensor_parallel_size:
        said = f"ranks_per_node={given!r}" if given != "auto" else "the launcher's ranks per node"
        raise _fail(
            "tensor_parallel_size",
            tensor_parallel_size,
            f"tensor parallelism runs inside a node, so it must divide the {ranks_per_node} ranks per node ({said});"
            f" use one of {_divisors(ranks_per_node)}",
        )


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


def argument(
    default: Any, doc: str, *, check: Check | None = None, shown: str | None = None, when: str | None = None
) -> Any:
    """A field of :class:`ZeroPPConfig` (or of a front door's own arguments): its default, its documentation (the
    strategies' docstrings, LightningCLI's help, the docs' table; ``shown`` replaces the default's repr there), when
    a user should change it (``when``: the docs' table has a column for it, the docstrings append it) and the check
    of its value alone, ``check(name, value)``, run at construction."""
    return field(default=default, metadata={"doc": doc, "check": check, "shown": shown, "when": when})


def doc(f: Field) -> str:
    """The documentation of a field made by :func:`argument`."""
    return f.metadata.get("doc", "")


def when(f: Field) -> str:
    """When a user should change the field (empty: its documentation says it)."""
    return f.metadata.get("when") or ""


def shown_default(f: Field) -> str:
    """How the docs show a field's default: strings in double quotes, as YAML and the docs write them."""
    if f.metadata.get("shown"):
        return f.metadata["shown"]
    return f'"{f.default}"' if isinstance(f.default, str) else repr(f.default)


RENAMED: dict[str, tuple[str, str]] = {
    "wrap_modules": ("auto_wrap_policy", "Lightning's name"),
    "activation_checkpointing": ("activation_checkpointing_policy", "Lightning's name"),
    "pipeline_stages": ("gradient_pieces", "what they are: pieces of the gradient reduce-scatter"),
}
"""Deprecated spellings: old name -> (its field, why renamed). Both front doors still take them, warn, and refuse one
given together with its field (set to other than its default)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class ZeroPPConfig:
    """Every argument of the strategy (both front doors), with its type, default, check and documentation.

    ``ZeroPPStrategy.from_config(config)`` (either front door) builds a strategy from one; ``strategy.zeropp_config``
    is the strategy's. Fields are checked in their order by their own check, then the rules across fields.
    """

    quantize_weights: bool | Literal["auto"] = argument(
        "auto",
        "qwZ: all-gather the weights in the forward pass as block-quantized integers."
        ' "auto": on with more than one node; on one node weights gather exactly (nothing crosses nodes, so'
        " quantizing them would lose precision and save no cross-node byte). True: on everywhere, one node included.",
        check=_check_bool_or_auto,
        when="False: exact forward weights across nodes, at twice qwZ's forward bytes. True on one node only to"
        " measure qwZ.",
    )
    weight_bits: Literal[8, 4] = argument(
        8,
        "qwZ: 8 or 4 bits per weight element on the wire.",
        check=_bits(8, 4),
        when="4 halves the forward gather's bytes again at 16x the weight error: for very slow links, after measuring"
        " accuracy.",
    )
    hpz_partition_size: PositiveIntOrAuto = argument(
        "auto",
        "hpZ: after forward each rank keeps 1/R of the dequantized weights, so that the backward all-gather runs among"
        ' R consecutive ranks. "auto": ranks per node (never leaves the node); 1: off. Must divide the world size.'
        " With tensor parallelism it counts data-parallel ranks (ranks per node / tensor_parallel_size per node).",
        check=_check_size_or_auto,
        when="1 when memory is short (hpZ keeps 1/R of the gathered weights from forward to backward).",
    )
    quantize_gradients: bool = argument(
        True,
        "qgZ: reduce gradients by an intra-node then an inter-node all-to-all of quantized blocks, summed in fp32. On"
        " one node the exact reduce-scatter is used (nothing crosses nodes).",
        check=_check_bool,
        when="False to rule qgZ out when accuracy suffers, or where the gradient reduction is not the bottleneck.",
    )
    quantize_gradients_steps: NonNegativeInt = argument(
        0,
        "qgZ for the first this many optimizer steps, then the exact reduce-scatter (the paper's remedy for"
        " late-training accuracy); 0: throughout.",
        check=_steps("qgZ throughout"),
        when="Half the run's optimizer steps when the last fraction of a percent of loss matters and the link has no"
        " room for gradient_bits=8 (docs: Accuracy); ZeRO-3's gradient bytes after it.",
    )
    gradient_bits: Literal[4, 8] = argument(
        4,
        "qgZ: 4 or 8 bits per gradient element on the inter-node hop.",
        check=_bits(4, 8),
        when="8 for long runs where the last fraction of a percent of loss matters, the optimizer is not Adam-family"
        " (with Adam or AdamW the default second_moment_correction does it at no byte more) and the link has room:"
        " it removes most of the late loss gap for more cross-node bytes (docs: Accuracy).",
    )
    intra_node_gradient_bits: Literal[4, 8] = argument(
        8,
        "qgZ: 4 or 8 bits per gradient element on the intra-node hop.",
        check=_bits(4, 8),
        when="4 only when the links inside a node are slow (PCIe): INT8 keeps the first hop's error 16x smaller.",
    )
    weight_block_size: BlockSize = argument(
        256,
        f"Weight elements that share one fp32 scale ({_MIN_BLOCK_SIZE} .. {_MAX_BLOCK_SIZE}; even for INT4).",
        check=_check_block,
        when="Rarely: smaller for less error (more scales on the wire), larger for fewer bytes.",
    )
    gradient_block_size: BlockSize = argument(
        128,
        f"Gradient elements that share one fp32 scale ({_MIN_BLOCK_SIZE} .. {_MAX_BLOCK_SIZE}; even for INT4).",
        check=_check_block,
        when="Rarely: smaller for less error (more scales on the wire), larger for fewer bytes.",
    )
    gradient_rounding: GradientRounding = argument(
        "nearest",
        'Rounding of gradients: "nearest" (half to even) or "stochastic" (unbiased).',
        check=_one_of(_GRADIENT_ROUNDINGS),
        when='Leave "nearest": at 500 steps "stochastic" lost more loss than it (docs: Accuracy).',
    )
    gradient_rotation: GradientRotation = argument(
        "none",
        'qgZ: "hadamard" rotates each gradient block before the inter-node hop quantizes it (random signs from a'
        " per-reduction seed every rank derives alike, then a Walsh-Hadamard transform; the inverse after the sum),"
        " so that one large element no longer sets a scale that rounds its neighbours to zero. Same bytes on the"
        ' wire. The Triton kernels fuse it (docs: Kernels). "none": blocks quantized as they are.',
        check=_one_of(_GRADIENT_ROTATIONS),
        when='Leave "none": at 500 steps "hadamard" lost more loss than it (docs: Accuracy).',
    )
    second_moment_correction: bool | Literal["auto"] = argument(
        "auto",
        "qgZ: before each optimizer step, take the inter-node hop's rounding noise out of an Adam-family optimizer's"
        " second moment (exp_avg_sq), its variance estimated per block from the scales the rank received: no byte"
        " more on the wire, 4 bytes per gradient block of the rank's shard. Without it the noise lengthens the"
        " denominator and shortens every step (docs: Accuracy), a loss gap that grows"
        ' with training. "auto": on wherever qgZ runs across nodes (FULL_SHARD, bf16 or fp32 gradients), for each'
        " optimizer of torch's Adam family (Adam, AdamW, NAdam, RAdam, their fused / foreach / amsgrad forms and"
        " subclasses that keep their step); any other optimizer is left alone (no estimate, no pass), and rank 0"
        " says once which. True: on, refused where it cannot act (no qgZ, HYBRID_SHARD, fp16 gradients) and for"
        " an optimizer it cannot correct.",
        check=_check_bool_or_auto,
        when='Leave "auto": it keeps the late loss gap from growing with training, at no cost in bytes (docs:'
        " Accuracy). False only to measure qgZ without it.",
    )
    second_moment_scope: SecondMomentScope = argument(
        "matrices",
        'The parameters whose second moment second_moment_correction lowers: "all", or "matrices" (parameters'
        " of two or more dimensions; norm gains and biases keep their second moment as the optimizer made it). A"
        " norm's gain sums its gradient over every token, so one block holds a few large coordinates and many that"
        " the rounding noise dominates; there the estimate often exceeds the coordinate's own square, the floor"
        " binds, and the run's trajectory parts from the exact run's (docs: Accuracy).",
        check=_one_of(_SECOND_MOMENT_SCOPES),
        when='Leave "matrices": with "all" a Llama\'s runs parted from the exact run\'s, seed by seed, by several'
        ' times the quantization\'s own gap (docs: Accuracy). "all" only to compare.',
    )
    gradient_quantization_scope: GradientQuantizationScope = argument(
        "auto",
        'qgZ and quantized HSDP: the parameters whose gradients are quantized: "all", "matrices" (parameters of two or'
        " more dimensions; the gradients of norm gains and biases then cross nodes exactly, summed in fp32 and sent in"
        " FSDP's reduce dtype as raw bytes inside qgZ's, or quantized HSDP's rail's, own all-to-alls: no collective"
        ' more, a few bytes more per step), or "auto": "matrices" where the strategy runs tensor parallelism'
        ' (tensor_parallel_size > 1), "all" otherwise. With block_alignment="flat" every gradient is quantized. A'
        " norm's gain sums its gradient over every token: its blocks hold a few large coordinates and many that INT4"
        " rounds to noise, and its steps are shortened by that noise (docs: Accuracy).",
        check=_one_of(_GRADIENT_QUANTIZATION_SCOPES),
        when='Leave "auto". With tensor parallelism the exact vectors brought a Llama\'s final loss closer to the exact'
        " run's at every seed, at no measurable step; without it they gained no measurable loss and cost a few"
        ' percent of the step on the emulated cluster (docs: Accuracy, Decisions). "matrices" or "all" to set it'
        " outright.",
    )
    block_alignment: BlockAlignment = argument(
        "parameter",
        '"parameter": no quantization block (weights or gradients) holds elements of two parameters, so a small'
        ' parameter never shares a scale with a large neighbour; "flat": fixed blocks over each unit\'s flat buffer'
        " (the reference implementation's layout; an ablation: small parameters next to large ones can be rounded to"
        " zero).",
        check=_one_of(_BLOCK_ALIGNMENTS),
        when='"flat" only to reproduce the reference implementation.',
    )
    gradient_error_feedback: bool = argument(
        False,
        "qgZ error feedback: each rank keeps what the INT4 inter-node hop's quantization lost (in error_feedback_bits,"
        " for the M/N elements it sends) and adds it, times error_feedback_decay, to the next reduction's values."
        " Saved in checkpoints.",
        check=_check_bool,
        when="Off by default: 1 byte more per element of M/N and a longer step, for a gain over the defaults not"
        " resolved. On with the default second_moment_correction for a long run with the memory, where it comes"
        " closest to ZeRO-3; without the correction it makes the gap worse (docs: Accuracy, Error feedback).",
    )
    error_feedback_bits: Literal[8, 16, 32] = argument(
        8,
        "The error feedback residual's width: 8 (INT8 codes and one fp32 scale per gradient block, about 1 byte per"
        " element of the M/N a rank sends, as LoCo keeps its error), 16 (bf16, 2 bytes) or 32 (fp32, 4 bytes).",
        check=_bits(8, 16, 32),
        when="16 or 32 when the residual's own rounding matters more than its memory.",
    )
    error_feedback_decay: Decay = argument(
        1.0,
        "The error feedback residual's carry-over factor to the next step, in (0, 1]. 1.0: classic error feedback,"
        " whose error over many steps is the last residual alone; below 1 a share of every residual is never sent.",
        check=_check_decay,
        when="Below 1 only to compare with the reference implementation's 0.8 (docs: Error feedback).",
    )
    error_feedback_reset: NonNegativeInt = argument(
        1024,
        "Zero the error feedback residuals every this many optimizer steps (0: never).",
        check=_steps("never"),
        when="0 never resets; smaller when the gradients' scale shifts quickly.",
    )
    weight_deltas: bool = argument(
        False,
        "Keep each node's hpZ copy of the weights across steps and, after each optimizer step, update it with deltas"
        " (per parameter-aligned block) of what the step changed, each shard sent to one rank per node; the forward"
        " all-gather is then built from that copy inside the node (exact), replacing qwZ's. Needs hpZ"
        " (hpz_partition_size >= 2). Costs M / R elements per rank in the compute dtype, plus M / W for what the"
        " other nodes hold of this rank's shard (persistent_memory).",
        check=_check_bool,
        when="A slow cross-node link and memory to spare: the planner says whether it beats the defaults.",
    )
    weight_delta_bits: Literal[4, 8] = argument(
        4,
        "weight_deltas: 4 or 8 bits per delta element on the wire. 4 halves the bytes; 8 cuts the error 16x, for"
        " training whose weights move more than a few percent per step.",
        check=_bits(4, 8),
        when="8 when the weights move more than a few percent per step.",
    )
    weight_delta_refresh: NonNegativeInt = argument(
        1000,
        "weight_deltas: rebuild the node copies exactly every this many optimizer steps (0: never). They are also"
        " rebuilt when the weights change outside an optimizer step (a checkpoint load, an EMA swap: any in-place"
        " write to the parameters; after writes through param.data, call refresh_weight_copies()).",
        check=_steps("never"),
        when="Smaller if the node copies drift on long runs; 0 never rebuilds.",
    )
    gradient_pieces: PositiveInt = argument(
        2,
        "qgZ pipelining: the pieces each rank's chunk of the gradient reduce-scatter is cut into, so that piece s+1"
        " crosses the node's links while piece s crosses nodes. 1: no overlap.",
        check=_check_pieces,
        when="1 when a unit's chunks are small (latency dominates); more when one piece's hops are long.",
    )
    ranks_per_node: PositiveIntOrAuto = argument(
        "auto",
        'Node emulation: "auto" (a real cluster) takes the node size from the launcher (its local world size). A'
        " number makes the processes of one machine act as nodes of that many ranks each, so that 4 processes on one"
        " box run as 2 nodes x 2 (tests, demos); it must divide the ranks launched per machine.",
        check=_check_size_or_auto,
        when="Only to make one machine act as several nodes (tests, demos).",
    )
    tensor_parallel_size: PositiveInt = argument(
        1,
        "Tensor parallelism inside each node, as Lightning's ModelParallelStrategy lays it out: a 2-D mesh"
        ' ("data_parallel", "tensor_parallel") whose consecutive groups of this many ranks split the layers by the'
        " model's own plan (parallelize_module(..., self.device_mesh['tensor_parallel'], plan) in configure_model, or"
        " in Fabric's parallelize_fn); ZeRO++ shards over the data-parallel dimension. 1: no tensor parallelism (a"
        " 1-D mesh). Must divide the ranks per node. Not combined yet with HYBRID_SHARD or weight_deltas.",
        check=_check_tensor_parallel_size,
        when="The size of the tensor-parallel groups a ModelParallelStrategy configure_model expects (its"
        " tensor_parallel_size), when the model's layers are split inside each node.",
    )
    data_parallel_size: PositiveIntOrAuto = argument(
        "auto",
        'The data-parallel dimension of the mesh: the world size / tensor_parallel_size, which "auto" takes. A'
        " number (as ModelParallelStrategy takes it) is checked against the job.",
        check=_check_size_or_auto,
        when='Leave "auto"; a number only states the size the job must have.',
    )
    auto_wrap_policy: ModuleSelection = argument(
        None,
        "The modules that each become one FSDP unit: a set of module classes, their names (as in YAML), or a callable"
        " (module) -> bool, as Lightning's FSDP strategies take it. None: every module held in an nn.ModuleList"
        " (transformer blocks). The root is always sharded last.",
        check=_check_module_selection,
        when="When the blocks are not held in an nn.ModuleList, or to shard at another granularity.",
    )
    activation_checkpointing_policy: ModuleSelection = argument(
        None,
        "The modules whose activations are recomputed in backward, in the same forms as auto_wrap_policy.",
        check=_check_module_selection,
        when="When the activations do not fit in memory.",
    )
    cpu_offload: CpuOffload = argument(
        False,
        "Keep sharded parameters, gradients and optimizer state in host memory: True, or a"
        " torch.distributed.fsdp.CPUOffloadPolicy (its pin_memory chosen); FSDP1's CPUOffload is read as its"
        " offload_params.",
        check=_check_cpu_offload,
        when="When the sharded parameters, gradients and optimizer state do not fit on the device.",
    )
    state_dict_type: StateDictType = argument(
        "sharded",
        '"sharded": a checkpoint folder written by every rank; "full": one file.',
        check=_one_of(_STATE_DICT_TYPES),
        when='"full" for one file other tools read.',
    )
    kernel_backend: KernelBackend = argument(
        "auto",
        '"auto": Triton on CUDA tensors, pure torch elsewhere; "triton" or "torch" to force one.',
        check=_one_of(_KERNEL_BACKENDS),
        when='"torch" to debug the kernels (they are twins of the Triton ones, rotated blocks included).',
    )
    process_group_backend: str | None = argument(
        None,
        '"nccl", "gloo", ...; None: chosen for the device.',
        check=_check_process_group_backend,
        when="When the device's default (nccl on CUDA, gloo on CPU) is not the one wanted.",
    )
    timeout: timedelta | float | None = argument(
        default_pg_timeout,
        "How long any collective waits for a peer: Lightning's default group and every group of the strategy's own"
        " (world, node, rail, hpZ) get it, so a frozen rank ends the job on the others after it. A timedelta, or a"
        " number of seconds (as YAML writes it: 1800); None: torch's default.",
        check=_check_timeout,
        shown="Lightning's (30 min)",
        when="Shorter to end a job with a frozen rank sooner; longer for slow checkpoint storage.",
    )
    sharding_strategy: ShardingStrategy = argument(
        "FULL_SHARD",
        '"FULL_SHARD": ZeRO-3, every parameter sharded over all ranks (ZeRO++ builds on it); "HYBRID_SHARD": HSDP,'
        " sharded over the ranks of each node and replicated across nodes (weights are gathered inside the node,"
        " gradients reduce-scattered inside it, then all-reduced across nodes). With quantize_gradients=False"
        ' (strategy="hsdp") that all-reduce is exact; with quantize_gradients=True (strategy="qhsdp") it runs as'
        " an INT4 reduce-scatter and an INT8 all-gather (hsdp_gather_bits) with qgZ's rounding, error feedback and"
        " rotation. HYBRID_SHARD needs quantize_weights off (weights never leave the node).",
        check=_one_of(_SHARDING_STRATEGIES),
        when='"HYBRID_SHARD" when the model\'s state fits sharded over one node: only gradients cross nodes;'
        ' strategy="qhsdp" where the link between nodes is slow.',
    )
    hsdp_gather_bits: Literal[4, 8, 16] = argument(
        8,
        "Quantized HSDP: the width of the reduced gradient pieces all-gathered across nodes: 4 or 8 (INT4 / INT8"
        " blocks of gradient_block_size) or 16 (bf16). With gradient_error_feedback the piece's owner keeps what its"
        " rounding lost and adds it to the next step's piece.",
        check=_bits(4, 8, 16),
        when="4 for the fewest bytes on slow links, after measuring its accuracy (INT4 costs more than INT8: the"
        " results pages have both); 16 when quantized HSDP costs too much accuracy, for more cross-node bytes.",
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            check = f.metadata.get("check")
            if check is not None:
                check(f.name, getattr(self, f.name))
        self._check_rules()
        for f in fields(self):  # the CLI's restricted types (int and float subclasses) become plain numbers
            value = getattr(self, f.name)
            if isinstance(value, (int, float)) and type(value) not in (int, float, bool):
                object.__setattr__(self, f.name, float(value) if isinstance(value, float) else int(value))
        if isinstance(self.timeout, (int, float)):  # seconds, as YAML writes a duration: torch takes a timedelta
            object.__setattr__(self, "timeout", timedelta(seconds=self.timeout))

    def _check_rules(self) -> None:
        """The rules across fields (each field's own value is checked already)."""
        if self.tensor_parallel_size > 1:
            self._check_tensor_parallel()
        if self.sharding_strategy == "HYBRID_SHARD":
            self._check_hybrid()
        _check_even_block("weight_block_size", self.weight_block_size, self.weight_bits)
        bits = min(self.gradient_bits, self.intra_node_gradient_bits, self.hsdp_gather_bits)
        _check_even_block("gradient_block_size", self.gradient_block_size, bits)
        if self.gradient_error_feedback and not self.quantize_gradients:
            raise ValueError(
                "ZeroPPStrategy: `gradient_error_feedback=True` corrects qgZ's quantization error, but"
                " `quantize_gradients=False` reduces gradients exactly; turn qgZ on or leave error feedback off."
            )
        if self.second_moment_correction is True and not self.quantize_gradients:
            raise ValueError(
                "ZeroPPStrategy: `second_moment_correction=True` removes qgZ's rounding noise from the optimizer's"
                " second moment, but `quantize_gradients=False` reduces gradients exactly; turn qgZ on or leave the"
                " correction off."
            )
        if self.second_moment_correction is True and self.sharding_strategy == "HYBRID_SHARD":
            raise ValueError(
                "ZeroPPStrategy: `second_moment_correction=True` is not supported with"
                " `sharding_strategy='HYBRID_SHARD'` yet (its rail reduction does not report its noise); use"
                " FULL_SHARD or leave the correction off."
            )
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
            if offloads(self.cpu_offload):
                raise ValueError(
                    "ZeroPPStrategy: `weight_deltas=True` keeps 1/R of the weights on the device across steps, which"
                    " `cpu_offload=True` exists to avoid; turn one of them off."
                )

    def _check_tensor_parallel(self) -> None:
        """What tensor parallelism does not combine with yet (this first version), each refused naming both."""
        t = self.tensor_parallel_size
        if isinstance(self.ranks_per_node, int):
            tensor_parallel_fits(t, self.ranks_per_node, self.ranks_per_node)
        if self.sharding_strategy == "HYBRID_SHARD":
            raise ValueError(
                f"ZeroPPStrategy: `tensor_parallel_size={t}` does not combine with `sharding_strategy='HYBRID_SHARD'`"
                " yet; use sharding_strategy='FULL_SHARD' (ZeRO++ over the data-parallel dimension) or"
                " tensor_parallel_size=1."
            )
        if self.weight_deltas:
            raise ValueError(
                f"ZeroPPStrategy: `weight_deltas=True` does not combine with `tensor_parallel_size={t}` yet; turn"
                " weight_deltas off or set tensor_parallel_size=1."
            )

    @property
    def hybrid(self) -> bool:
        """Whether the model is sharded HSDP-style (``sharding_strategy="HYBRID_SHARD"``)."""
        return self.sharding_strategy == "HYBRID_SHARD"

    def _check_hybrid(self) -> None:
        """HYBRID_SHARD gathers weights and reduce-scatters gradients inside each node and replicates across nodes:
        the weight techniques, which shrink FULL_SHARD's cross-node all-gathers, do not apply; quantize_gradients
        quantizes the cross-node all-reduce (quantized HSDP)."""
        reasons = {
            "quantize_weights": "qwZ quantizes the cross-node weight all-gather; HSDP gathers weights inside the node",
            "weight_deltas": "weight deltas keep hpZ's node copy; HSDP's weights never leave the node",
        }
        wrong = [name for name in reasons if getattr(self, name) is True]  # "auto" resolves to off under HSDP
        if wrong:
            raise ValueError(
                "ZeroPPStrategy: `sharding_strategy='HYBRID_SHARD'` (HSDP) does not combine with "
                + "; ".join(f"`{name}=True` ({reasons[name]})" for name in wrong)
                + f'. Set {", ".join(f"{name}=False" for name in wrong)} (strategy="hsdp" and "qhsdp" do), or'
                " use sharding_strategy='FULL_SHARD' for ZeRO++."
            )
        if self.hpz_partition_size not in ("auto", 1):
            raise _fail(
                "hpz_partition_size",
                self.hpz_partition_size,
                "with sharding_strategy='HYBRID_SHARD' the backward all-gather already runs inside the node (HSDP's"
                " shard group); leave it at 'auto'",
            )

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any]) -> ZeroPPConfig:
        """The config from a strategy's arguments by name, the deprecated spellings (:data:`RENAMED`) mapped to their
        fields with a warning; one given together with its field is refused, naming both."""
        given = dict(arguments)
        defaults = {f.name: f.default for f in fields(cls)}
        for old, (new, why) in RENAMED.items():
            value = given.pop(old, None)
            if value is None:
                continue
            if new in given and given[new] is not None and given[new] != defaults[new]:
                raise ValueError(
                    f"ZeroPPStrategy: `{old}` is the deprecated spelling of `{new}`, and both were given"
                    f" ({old}={value!r}, {new}={given[new]!r}); pass only `{new}`."
                )
            rank_zero_deprecation(f"ZeroPPStrategy: `{old}` is deprecated and will be removed; use `{new}` ({why}).")
            given[new] = value
        return cls(**given)

    def resolve(self, world_size: int, local_world_size: int) -> tuple[int, int]:
        """Returns ``(ranks_per_node, hpz_partition_size)`` for a job of ``world_size`` ranks launched
        ``local_world_size`` per machine (ranks of the whole job; with tensor parallelism the data-parallel topology
        divides both by ``tensor_parallel_size``: :func:`lightning_zeropp.commplan.job_topology`), or raises naming the
        argument at fault."""
        ranks_per_node = local_world_size if self.ranks_per_node == "auto" else self.ranks_per_node
        if local_world_size % ranks_per_node:
            raise _fail(
                "ranks_per_node",
                self.ranks_per_node,
                f"it must divide the {local_world_size} ranks launched per machine, or ranks of different machines"
                f" would count as one node; use 'auto' or one of {_divisors(local_world_size)}",
            )
        t = self.tensor_parallel_size
        tensor_parallel_fits(t, ranks_per_node, self.ranks_per_node)
        if self.data_parallel_size not in ("auto", world_size // t):
            raise _fail(
                "data_parallel_size",
                self.data_parallel_size,
                f"this job has {world_size} ranks, so with tensor_parallel_size={t} it is {world_size // t}; set"
                f" data_parallel_size={world_size // t} or 'auto'",
            )
        if self.sharding_strategy == "HYBRID_SHARD":  # the shard group is the node: FSDP's own reshard is hpZ's
            return ranks_per_node, 1
        # hpZ counts data-parallel ranks: with tensor parallelism a node holds ranks_per_node / t of them
        hpz = ranks_per_node // t if self.hpz_partition_size == "auto" else self.hpz_partition_size
        if self.weight_deltas and hpz == 1:
            raise ValueError(
                f"ZeroPPStrategy: `weight_deltas=True` needs hpZ, but hpz_partition_size={self.hpz_partition_size!r}"
                f" resolves to 1 here (ranks_per_node={ranks_per_node}): there is no node copy to keep. Set"
                " hpz_partition_size (and ranks_per_node) to 2 or more, or turn weight_deltas off."
            )
        data_parallel, per_node = world_size // t, ranks_per_node // t
        if data_parallel % hpz:
            what = f"the world size {world_size}" if t == 1 else f"the {data_parallel} data-parallel ranks"
            counts = (
                f": with tensor_parallel_size={t} it counts data-parallel ranks, {per_node} per node" if t > 1 else ""
            )
            raise _fail(
                "hpz_partition_size",
                self.hpz_partition_size,
                f"the secondary partition must divide {what}; use one of {_divisors(data_parallel)}"
                f" (1 turns hpZ off, {per_node} keeps it inside a node{counts})",
            )
        return ranks_per_node, hpz


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
