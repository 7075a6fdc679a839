"""Each public op's arguments, declared once: a frozen dataclass per op (its fields are the op's arguments after the
input tensor, with their defaults) that checks a call in full and is handed whole to the implementations.

The public op in ``lightning_zeropp.kernels`` builds the spec from its call, checks it against the input tensor
(:meth:`check`: one message per fault, naming the argument, its value and what is allowed), and passes
``(tensor, spec)`` to the torch twin (``reference``) or the Triton launcher (``triton_ops``). The op's signature is
the spec's, so a new keyword is one field here (and its check), then used where it matters. Arguments several ops
share (rounding, error feedback, parameter-aligned blocks) are declared once, in the keyword-only bases below.
Never imports triton.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from .layout import Blocks, check_format, num_blocks, stage_bounds, wire_size

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FLOATS = "float32, bfloat16 or float16"
_SEED_LIMIT = 2**63  # torch.Generator.manual_seed takes any seed below it; the kernels reduce it mod 2**31 - 1
_FROZEN = dict(frozen=True, eq=False)  # eq=False: some fields are tensors, which do not compare to a bool
_RESIDUAL_BITS = {torch.float32: 32, torch.bfloat16: 16, torch.int8: 8}  # an error feedback residual's width


# ------------------------------------------------------------------------------------------------------------------
# Argument checks: each raises for one fault, naming the argument, its value and what is allowed


def _describe(t: torch.Tensor) -> str:
    return f"a {t.dtype} tensor of shape {tuple(t.shape)} on {t.device}"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite_real(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)


def _check_seed(op: str, name: str, seed: object, none_means: str) -> None:
    """``seed``: None (``none_means``) or an int in [0, 2**63)."""
    if seed is None:
        return
    allowed = f"use None ({none_means}) or an int in [0, 2**63)"
    if not _is_int(seed):
        raise TypeError(f"{op}: `{name}={seed!r}` is not an int; {allowed}.")
    if not 0 <= seed < _SEED_LIMIT:
        raise ValueError(f"{op}: `{name}={seed!r}` is not allowed; {allowed}.")


def _check_tensor(op: str, name: str, t: object) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: `{name}` must be a torch.Tensor, got {type(t).__name__}.")


def _check_float_input(op: str, name: str, x: object, ranks: tuple[int, ...]) -> None:
    _check_tensor(op, name, x)
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{op}: `{name}` is {_describe(x)}; use a {_FLOATS} tensor.")
    if x.dim() not in ranks:
        allowed = "a 1-D tensor" if ranks == (1,) else "a 1-D tensor or 2-D rows"
        raise ValueError(f"{op}: `{name}` is {_describe(x)}; use {allowed}.")


def _check_wire(
    op: str, buf: object, rank: tuple[int, ...], layout: str, numel: int, bits: int, block: int, blocks=None
) -> None:
    """``buf``: uint8, ``rank`` dimensions (``layout`` names them), rows of ``wire_size(numel, bits, block)`` bytes
    (or ``blocks.wire_size(bits)``)."""
    _check_tensor(op, "buf", buf)
    if buf.dtype != torch.uint8:
        raise TypeError(f"{op}: `buf` is {_describe(buf)}; use the uint8 wire buffer quantize returns.")
    if buf.dim() not in rank:
        raise ValueError(f"{op}: `buf` is {_describe(buf)}; use {layout}.")
    if blocks is not None:
        expected = blocks.wire_size(bits)
        if buf.shape[-1] != expected:
            raise ValueError(
                f"{op}: `buf` is {_describe(buf)}, but a row of {blocks} at {bits} bits takes {expected} bytes; use"
                f" rows of blocks.wire_size(bits) = {expected} bytes (the buffer quantize returned with these blocks)."
            )
        return
    expected = wire_size(numel, bits, block)
    if buf.shape[-1] != expected:
        raise ValueError(
            f"{op}: `buf` is {_describe(buf)}, but a row of `numel={numel}` elements at {bits} bits in blocks of"
            f" {block} takes {expected} bytes; use rows of wire_size(numel, bits, block_size) = {expected} bytes."
        )


def _check_count(op: str, name: str, value: object, minimum: int) -> None:
    if not _is_int(value):
        raise TypeError(f"{op}: `{name}={value!r}` is not an int; use an int >= {minimum}.")
    if value < minimum:
        raise ValueError(f"{op}: `{name}={value!r}` is not allowed; use an int >= {minimum}.")


def _check_dtype(op: str, name: str, dtype: object, *, optional: bool = False) -> None:
    if dtype not in _FLOAT_DTYPES and not (optional and dtype is None):
        allowed = "torch.float32, torch.bfloat16 or torch.float16" + (" (or None)" if optional else "")
        raise TypeError(f"{op}: `{name}={dtype!r}` is not allowed; use {allowed}.")


def _check_out(op: str, out: object, shapes: list[tuple[int, ...]], device: torch.device, dtype) -> None:
    """``out``: exactly one of ``shapes``, of ``dtype`` (or any float dtype when None), on ``device``, contiguous."""
    _check_tensor(op, "out", out)
    allowed = " or ".join(str(s) for s in shapes)
    if tuple(out.shape) not in shapes:
        raise ValueError(f"{op}: `out` is {_describe(out)}; use shape {allowed}.")
    if dtype is None and out.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{op}: `out` is {_describe(out)}; use a {_FLOATS} tensor.")
    if dtype is not None and out.dtype != dtype:
        raise TypeError(f"{op}: `out` is {_describe(out)}, but `dtype={dtype}`; pass dtype=out.dtype.")
    if out.device != device:
        raise ValueError(f"{op}: `out` is {_describe(out)}, but the input is on {device}; use one device.")
    if not out.is_contiguous():
        raise ValueError(f"{op}: `out` is {_describe(out)} with strides {out.stride()}; use a contiguous tensor.")


# ------------------------------------------------------------------------------------------------------------------
# Arguments several ops share: keyword-only, so each op's own positional arguments keep their order


@dataclass(**_FROZEN, kw_only=True)
class _Spec:
    """What every op's spec has: the op's name, and parameter-aligned blocks.

    Args:
        blocks: parameter-aligned blocks of a row (:class:`~lightning_zeropp.kernels.layout.Blocks`, none longer
            than ``block_size``) instead of uniform blocks of ``block_size``; a wire buffer is read in the blocks it
            was written in.
    """

    name: ClassVar[str]
    blocks: Blocks | None = None

    @property
    def op(self) -> str:
        """How messages name the public op."""
        return f"lightning_zeropp.kernels.{self.name}"

    def _check_blocks(self, op: str, numel: int, block_size: int, what: str) -> None:
        """``blocks``: None, or of ``numel`` elements (``what`` says whose), built for ``block_size``."""
        blocks = self.blocks
        if blocks is None:
            return
        if not isinstance(blocks, Blocks):
            raise TypeError(f"{op}: `blocks` must be None or a layout.Blocks, got {type(blocks).__name__}.")
        if blocks.numel != numel:
            raise ValueError(
                f"{op}: `blocks` covers {blocks.numel} elements, but {what} has {numel}; build the blocks for this"
                " row (Blocks.of_segments of its segment lengths)."
            )
        if blocks.block_size != block_size:  # the block size sets the wire layout (``Blocks.padded``)
            raise ValueError(
                f"{op}: `blocks` were built for blocks of {blocks.block_size} elements, but `block_size={block_size}`;"
                " build them with Blocks.of_segments(segments, block_size)."
            )


@dataclass(**_FROZEN, kw_only=True)
class _Rounding:
    """Args:
    stochastic: round stochastically (unbiased) instead of to the nearest (half to even).
    seed: the noise's seed (a non-negative int below 2**63); None draws a fresh one.
    """

    stochastic: bool = False
    seed: int | None = None

    def _check_rounding(self, op: str) -> None:
        if not isinstance(self.stochastic, bool):
            raise TypeError(f"{op}: `stochastic={self.stochastic!r}` is not allowed; use True or False.")
        _check_seed(op, "seed", self.seed, "a fresh seed")


@dataclass(**_FROZEN, kw_only=True)
class _Rotation:
    """Args:
    rotation_seed: rotated blocks: each block multiplied by signs drawn from this seed and transformed by a
        Walsh-Hadamard matrix before it is quantized (a quantization), or after the dequantized rows are summed (a
        reduction: the inverse); blocks that are not a power of two in the power-of-two pieces of their length (see
        ``reference``). A non-negative int below 2**63; None: no rotation.
    """

    rotation_seed: int | None = None

    def _check_rotation(self, op: str) -> None:
        _check_seed(op, "rotation_seed", self.rotation_seed, "no rotation")


@dataclass(**_FROZEN, kw_only=True)
class _Feedback:
    """Args:
    residual: error feedback: one value per element quantized, ``v = values + decay * residual`` is quantized and
        ``residual`` overwritten with what that quantization lost, in the residual's own width: float32 (exact),
        bfloat16 (rounded to nearest even), or int8 codes with ``residual_scales`` (the error block-quantized again
        in the same blocks: ``scale = max|error| / 127`` per block, codes rounded to nearest, half to even). Int8 rows
        may be padded (any row stride >= the row length; a multiple of 16 keeps the kernels' accesses vectorized).
    residual_scales: with int8 ``residual``: one float32 scale per block of each row, contiguous; the residual is
        ``codes * scale``.
    decay: the factor the residual is carried over with.
    """

    residual: torch.Tensor | None = None
    residual_scales: torch.Tensor | None = None
    decay: float = 1.0

    @property
    def feedback_bits(self) -> int:
        """The residual's width in bits (32, 16 or 8), or 0 without error feedback."""
        return 0 if self.residual is None else _RESIDUAL_BITS[self.residual.dtype]

    def _check_feedback(self, op: str, shape: tuple[int, ...], device: torch.device, blocks_per_row: int) -> None:
        """``residual``: None, a contiguous fp32 or bf16 tensor of ``shape`` on ``device``, or int8 codes of ``shape``
        (rows of unit stride) with ``residual_scales`` (fp32, ``blocks_per_row`` per row, contiguous); ``decay``: a
        finite float."""
        residual, scales, decay = self.residual, self.residual_scales, self.decay
        if not _is_finite_real(decay):
            raise ValueError(f"{op}: `decay={decay!r}` is not allowed; use a finite float (0.8, say).")
        if residual is None:
            if scales is not None:
                raise ValueError(
                    f"{op}: `residual_scales` is given without `residual`; pass both (an 8-bit residual) or neither."
                )
            return
        _check_tensor(op, "residual", residual)
        if residual.dtype not in _RESIDUAL_BITS or tuple(residual.shape) != shape:
            raise ValueError(
                f"{op}: `residual` is {_describe(residual)}; use a float32 or bfloat16 tensor of shape {shape} (one"
                " value per element quantized), or int8 codes of that shape with `residual_scales`."
            )
        if residual.device != device:
            raise ValueError(f"{op}: `residual` is {_describe(residual)}; use a tensor on {device}.")
        if residual.dtype != torch.int8:
            if not residual.is_contiguous():
                raise ValueError(f"{op}: `residual` is {_describe(residual)}; use a contiguous tensor.")
            if scales is not None:
                raise ValueError(
                    f"{op}: `residual_scales` is given with a {residual.dtype} `residual`; scales belong to an int8"
                    " residual only: leave them out."
                )
            return
        if residual.stride(-1) != 1 or (residual.dim() == 2 and residual.stride(0) < shape[-1]):
            raise ValueError(
                f"{op}: `residual` is {_describe(residual)} with strides {residual.stride()}; use rows of unit stride"
                " that do not overlap."
            )
        want = (*shape[:-1], blocks_per_row)
        if scales is None:
            raise ValueError(
                f"{op}: `residual` is int8 codes but `residual_scales` is missing; pass the float32 scales, shape"
                f" {want} (one per block of each row)."
            )
        _check_tensor(op, "residual_scales", scales)
        if scales.dtype != torch.float32 or tuple(scales.shape) != want:
            raise ValueError(
                f"{op}: `residual_scales` is {_describe(scales)}; use a float32 tensor of shape {want} (one scale per"
                " block of each row)."
            )
        if scales.device != device or not scales.is_contiguous():
            raise ValueError(f"{op}: `residual_scales` is {_describe(scales)}; use a contiguous tensor on {device}.")


@dataclass(**_FROZEN)
class _WireRows(_Spec):
    """Wire rows to read back.

    Args:
        numel: elements per row.
        bits, block_size: the format the rows were quantized in.
        blocks: the blocks the rows were quantized in (None: uniform).
    """

    numel: int
    bits: int
    block_size: int

    def _check_rows(self, op: str, buf: object, rank: tuple[int, ...], layout: str) -> None:
        """``numel``, the format, ``blocks``, then ``buf``: ``rank`` dimensions (``layout`` names them) of rows."""
        _check_count(op, "numel", self.numel, 0)
        check_format(self.bits, self.block_size, op=op)
        self._check_blocks(op, self.numel, self.block_size, "`numel`")
        _check_wire(op, buf, rank, layout, self.numel, self.bits, self.block_size, self.blocks)


# ------------------------------------------------------------------------------------------------------------------
# The ops' specs


@dataclass(**_FROZEN)
class QuantizeSpec(_Rotation, _Feedback, _Rounding, _Spec):
    """:func:`~lightning_zeropp.kernels.quantize`'s arguments after ``x``.

    Args:
        bits: 8 or 4.
        block_size: elements per fp32 scale (even for 4 bits).
        stochastic, seed, blocks, residual, residual_scales, decay, rotation_seed: as the bases say; ``residual``
            is shaped like ``x``.
    """

    name: ClassVar[str] = "quantize"
    bits: int
    block_size: int

    def check(self, x: object) -> None:
        op = self.op
        _check_float_input(op, "x", x, (1, 2))
        check_format(self.bits, self.block_size, op=op)
        self._check_rounding(op)
        self._check_rotation(op)
        self._check_blocks(op, x.shape[-1], self.block_size, "a row of `x`")
        blocks = self.blocks.count if self.blocks is not None else num_blocks(x.shape[-1], self.block_size)
        self._check_feedback(op, tuple(x.shape), x.device, blocks)


@dataclass(**_FROZEN)
class DequantizeSpec(_WireRows):
    """:func:`~lightning_zeropp.kernels.dequantize`'s arguments after ``buf``.

    Args:
        numel, bits, block_size, blocks: the rows of ``buf`` (see the base).
        dtype: the output dtype: fp32, bf16 or fp16.
        out: written instead of a new tensor: contiguous, ``dtype``, on ``buf``'s device, of the shape returned or
            (2-D ``buf``) its flat ``(rows * numel,)`` (FSDP's all-gather output is flat).
    """

    name: ClassVar[str] = "dequantize"
    dtype: torch.dtype
    out: torch.Tensor | None = field(default=None, kw_only=True)

    def check(self, buf: object) -> None:
        op = self.op
        self._check_rows(op, buf, (1, 2), "a 1-D row (wire,) or 2-D rows (rows, wire)")
        _check_dtype(op, "dtype", self.dtype)
        if self.out is not None:
            numel = self.numel
            shapes = [(numel,)] if buf.dim() == 1 else [(buf.shape[0], numel), (buf.shape[0] * numel,)]
            _check_out(op, self.out, shapes, buf.device, self.dtype)


@dataclass(**_FROZEN)
class SwizzleQuantizeSpec(_Rounding, _Spec):
    """:func:`~lightning_zeropp.kernels.swizzle_quantize`'s arguments after ``x``.

    Args:
        ranks_per_node, num_nodes: N and K, each >= 1.
        stages, stage: the pipeline's piece count (>= 1) and this piece (``0 <= stage < stages``); see
            :func:`~lightning_zeropp.kernels.layout.stage_bounds`.
        bits, block_size, stochastic, seed: as :class:`QuantizeSpec`.
        blocks: the parameter-aligned blocks of a whole chunk; the pieces are then ``blocks.stages(stages)``.
    """

    name: ClassVar[str] = "swizzle_quantize"
    ranks_per_node: int
    num_nodes: int
    stages: int
    stage: int
    bits: int
    block_size: int

    def check(self, x: object) -> None:
        op = self.op
        _check_float_input(op, "x", x, (1,))
        _check_count(op, "ranks_per_node", self.ranks_per_node, 1)
        _check_count(op, "num_nodes", self.num_nodes, 1)
        _check_count(op, "stages", self.stages, 1)
        _check_count(op, "stage", self.stage, 0)
        if self.stage >= self.stages:
            raise ValueError(f"{op}: `stage={self.stage}` is not allowed; use 0 <= stage < stages={self.stages}.")
        W = self.ranks_per_node * self.num_nodes
        if x.numel() % W:
            raise ValueError(
                f"{op}: `x` is {_describe(x)}, which is not {W} equal chunks (ranks_per_node={self.ranks_per_node} x"
                f" num_nodes={self.num_nodes}); use numel == ranks_per_node * num_nodes * chunk."
            )
        check_format(self.bits, self.block_size, op=op)
        self._check_rounding(op)
        self._check_blocks(op, x.numel() // W, self.block_size, "a chunk of `x`")

    def piece(self, numel: int) -> tuple[int, int, int, QuantizeSpec]:
        """For an input of ``numel`` elements: the chunk length, where this stage's piece starts in a chunk, its
        length, and how the pieces are quantized (in their own blocks, when aligned)."""
        chunk = numel // (self.ranks_per_node * self.num_nodes)
        if self.blocks is None:
            start, size = stage_bounds(chunk, self.stages, self.stage, self.block_size)
            blocks = None
        else:
            start, blocks = self.blocks.stages(self.stages)[self.stage]
            size = blocks.numel
        spec = QuantizeSpec(self.bits, self.block_size, stochastic=self.stochastic, seed=self.seed, blocks=blocks)
        return chunk, start, size, spec


@dataclass(**_FROZEN)
class DequantizeReduceQuantizeSpec(_Rotation, _Feedback, _Rounding, _Spec):
    """:func:`~lightning_zeropp.kernels.dequantize_reduce_quantize`'s arguments after ``buf``.

    Args:
        numel: elements per piece.
        in_bits, out_bits: the received and the returned bit width (8 or 4).
        block_size, stochastic, seed: as :class:`QuantizeSpec` (the rounding is the re-quantization's).
        blocks: the pieces' blocks (both bit widths), as :class:`QuantizeSpec`.
        residual, residual_scales, decay: error feedback on the re-quantization, as :class:`QuantizeSpec`;
            ``residual`` is ``(K, numel)``.
        rotation_seed: the re-quantization's blocks rotated, as :class:`QuantizeSpec` (the received pieces are not).
    """

    name: ClassVar[str] = "dequantize_reduce_quantize"
    numel: int
    in_bits: int
    out_bits: int
    block_size: int

    def check(self, buf: object) -> None:
        op = self.op
        numel = self.numel
        _check_count(op, "numel", numel, 0)
        check_format(self.in_bits, self.block_size, op=op, bits_name="in_bits")
        check_format(self.out_bits, self.block_size, op=op, bits_name="out_bits")
        self._check_blocks(op, numel, self.block_size, "`numel`")
        layout = "(N, K, wire): K pieces from each of N peers"
        _check_wire(op, buf, (3,), layout, numel, self.in_bits, self.block_size, self.blocks)
        if buf.shape[0] == 0:
            raise ValueError(f"{op}: `buf` is {_describe(buf)}, pieces from no peer; use N >= 1 rows of pieces.")
        self._check_rounding(op)
        self._check_rotation(op)
        blocks = self.blocks.count if self.blocks is not None else num_blocks(numel, self.block_size)
        self._check_feedback(op, (buf.shape[1], numel), buf.device, blocks)


@dataclass(**_FROZEN)
class DequantizeReduceSpec(_Rotation, _WireRows):
    """:func:`~lightning_zeropp.kernels.dequantize_reduce`'s arguments after ``buf``.

    Args:
        numel, bits, block_size, blocks: the rows of ``buf`` (see the base).
        multiplier: a finite number the sum is scaled by (in fp32).
        out: written instead of a new tensor: ``(numel,)``, contiguous, fp32/bf16/fp16, on ``buf``'s device.
        dtype: the output dtype (fp32, bf16 or fp16; None: ``out``'s, or fp32); with ``out``, None or ``out.dtype``.
        rotation_seed: the rows were quantized rotated with this seed: their fp32 sum is un-rotated before the
            multiplier (see :class:`QuantizeSpec`).
    """

    name: ClassVar[str] = "dequantize_reduce"
    multiplier: float = field(default=1.0, kw_only=True)
    out: torch.Tensor | None = field(default=None, kw_only=True)
    dtype: torch.dtype | None = field(default=None, kw_only=True)

    def check(self, buf: object) -> None:
        op = self.op
        self._check_rows(op, buf, (2,), "2-D rows (M, wire)")
        if buf.shape[0] == 0:
            raise ValueError(f"{op}: `buf` is {_describe(buf)}, no rows to sum; use M >= 1 rows.")
        if not _is_finite_real(self.multiplier):
            raise ValueError(f"{op}: `multiplier={self.multiplier!r}` is not allowed; use a finite float.")
        self._check_rotation(op)
        _check_dtype(op, "dtype", self.dtype, optional=True)
        if self.out is not None:
            _check_out(op, self.out, [(self.numel,)], buf.device, self.dtype)
