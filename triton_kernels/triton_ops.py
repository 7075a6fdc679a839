"""The Triton implementations of the public ops, gathered for the dispatch in ``lightning_zeropp.kernels``."""

from .dequantize_kernel import dequantize, dequantize_reduce
from .quantize_kernel import quantize, swizzle_quantize
from .requantize_kernel import dequantize_reduce_quantize

__all__ = ["dequantize", "dequantize_reduce", "dequantize_reduce_quantize", "quantize", "swizzle_quantize"]
