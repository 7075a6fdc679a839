"""What the Triton launchers share: input checks, tile shapes, grids, index width and launch options."""

from __future__ import annotations

import os

import torch
import triton

from .layout import num_blocks, scale_offset

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# FMA contraction would fuse ``q * scale`` into the following add (or ``x * inv`` into the rounding add) and round
# once where the torch twins round twice: the kernels would no longer match the twins bit for bit.
LAUNCH_OPTIONS = {"enable_fp_fusion": False}

_INT32_LIMIT = 2**31 - 1


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def tile_shape(block_size: int) -> tuple[int, int]:
    """(G, HALF): blocks per program and the padded half-block; about 4096 elements per program."""
    half = triton.next_power_of_2(-(-block_size // 2))
    return max(1, 2048 // half), half


def quantize_grid(numel: int, bits: int, block_size: int, G: int) -> int:
    """Programs along a row for a kernel that writes a wire row: enough to cover the data and to write the padding
    after the payload (up to the 16-byte aligned scale offset) and after the last scale (up to 4 scales)."""
    so_elements = scale_offset(numel, bits) * (8 // bits)
    blocks = max(num_blocks(so_elements, block_size), -(-num_blocks(numel, block_size) // 4) * 4)
    return triton.cdiv(blocks, G)


def needs_int64(*extents: int) -> bool:
    """Whether offsets into buffers of these sizes (elements or bytes) overflow int32."""
    return max(extents) > _INT32_LIMIT


def check_input(x: torch.Tensor, op: str) -> torch.Tensor:
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: expected float32, bfloat16 or float16 input, got {x.dtype}.")
    if x.dim() not in (1, 2):
        raise ValueError(f"{op}: expected a 1-D tensor or 2-D rows, got shape {tuple(x.shape)}.")
    return x if x.stride(-1) == 1 else x.contiguous()


def output_view(out: torch.Tensor) -> torch.Tensor:
    """What the kernels store into: under the interpreter, bf16 outputs as their int16 bits (``store_values``)."""
    return out.view(torch.int16) if out.dtype == torch.bfloat16 and interpreting() else out


def bf16_by_hand(out: torch.Tensor) -> bool:
    return out.dtype == torch.bfloat16 and interpreting()


def stochastic_seed(seed: int | None) -> int:
    return int(torch.randint(0, 2**31 - 1, ()).item()) if seed is None else seed % (2**31 - 1)
