"""The Triton implementations of the public ops, gathered for the dispatch in ``triton_kernels/__init__.py``."""

from .quantize_kernel import dequantize, quantize
from .reduce_kernel import dequantize_reduce, dequantize_reduce_quantize
from .swizzle_quantize_kernel import swizzle_quantize

__all__ = ["dequantize", "dequantize_reduce", "dequantize_reduce_quantize", "quantize", "swizzle_quantize"]
