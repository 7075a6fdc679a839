"""Triton symbols that are private or changed between the versions lightning-zeropp supports (triton >= 3.5).

Only the compile gate (``lightning_zeropp.kernels.aot``) uses them: it records the launchers' kernel launches
instead of running them, specializes each with Triton's own binder for GPU targets this machine does not have,
compiles it, and reads the bundled toolchain's output. The kernels and their launchers use Triton's public API only
and never import this module, so a Triton that moves one of these symbols breaks the gate, not a training run.
Importing ``lightning_zeropp.kernels`` imports neither this module nor triton.

Each symbol is looked up when this module is imported; a Triton without it fails at import with the symbol, the
installed version and the supported range.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .versions import TRITON_VERSION, require

require(TRITON_VERSION is not None and TRITON_VERSION >= (3, 5), "triton", "the kernels' compile gate")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

_GATE = "the kernels' compile gate"


def _lookup(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        require(False, "triton", f"{_GATE} ({module}.{name})")


GPUTarget = _lookup("triton.backends.compiler", "GPUTarget")
ASTSource = _lookup("triton.compiler", "ASTSource")
make_backend = _lookup("triton.compiler", "make_backend")
JITFunction = _lookup("triton.runtime.jit", "JITFunction")
# what a kernel is under TRITON_INTERPRET=1 (its ``[grid]`` is replaced to record or stub a launch)
InterpretedFunction = _lookup("triton.runtime.interpreter", "InterpretedFunction")
# the binder a launch builds (the i32/i64, divisibility-by-16 and value-1 decisions) and what turns its result into
# a compilable signature: Triton's private launch internals
create_function_from_signature = _lookup("triton.runtime.jit", "create_function_from_signature")
require(hasattr(JITFunction, "_pack_args"), "triton", f"{_GATE} (JITFunction._pack_args)")
require(
    {"grid", "warmup"} <= set(inspect.signature(JITFunction.run).parameters),
    "triton",
    f"{_GATE} (JITFunction.run(*args, grid, warmup, **kwargs))",
)
# cuobjdump and nvdisasm ship beside ptxas in the NVIDIA backend's folder
TOOLCHAIN = Path(_lookup("triton.backends.nvidia.compiler", "__file__")).parent / "bin"
require(all((TOOLCHAIN / b).exists() for b in ("ptxas", "cuobjdump", "nvdisasm")), "triton", f"{_GATE} ({TOOLCHAIN})")

__all__ = [
    "Binary",
    "Specialization",
    "compile_specialization",
    "record_launches",
    "specialize",
    "stub_launches",
    "target_supported",
    "toolchain",
]


@contextlib.contextmanager
def _launches_replaced(launch: Callable[..., Any]) -> Iterator[None]:
    """Inside the block, ``kernel[grid](*args, **kwargs)`` calls ``launch(kernel, *args, grid=grid, warmup=False,
    **kwargs)`` instead of compiling, running or interpreting anything. A compiled kernel launches through
    ``JITFunction.run``; an interpreted one's ``[grid]`` is ``InterpretedFunction.__getitem__`` (its own before Triton
    3.7, which returns the grid executor directly; inherited after), so that is what is replaced for it."""
    run = JITFunction.run
    own_getitem = InterpretedFunction.__dict__.get("__getitem__")

    def getitem(self, grid):
        return lambda *args, **kwargs: launch(self, *args, grid=grid, warmup=False, **kwargs)

    JITFunction.run = launch
    InterpretedFunction.__getitem__ = getitem
    try:
        yield
    finally:
        JITFunction.run = run
        if own_getitem is None:
            del InterpretedFunction.__getitem__
        else:
            InterpretedFunction.__getitem__ = own_getitem


@contextlib.contextmanager
def record_launches() -> Iterator[list[tuple[Any, tuple, dict, tuple]]]:
    """Inside the block, ``kernel[grid](*args, **kwargs)`` appends ``(kernel, args, kwargs, grid)`` to the yielded
    list instead of compiling or running anything (compiled or interpreted kernels alike)."""
    launches: list[tuple[Any, tuple, dict, tuple]] = []

    def record(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, dict(kwargs), tuple(grid)))

    with _launches_replaced(record):
        yield launches


@contextlib.contextmanager
def stub_launches() -> Iterator[None]:
    """Inside the block, ``kernel[grid](*args, **kwargs)`` returns at once (no binding, compile or launch; compiled
    or interpreted): what is left of a call is the launcher's own host time (``benchmarks/host_cost.py``)."""

    def nothing(self, *args, grid, warmup, **kwargs):
        return None

    with _launches_replaced(nothing):
        yield


@dataclasses.dataclass(frozen=True)
class Specialization:
    """What Triton compiles for one launch on one target."""

    kernel: Any
    target: Any
    options: Any
    signature: dict[str, str]
    """Parameter -> Triton type (``"*fp32"``, ``"i32"``, ...; ``"constexpr"`` for the constants)."""
    constexprs: dict[str, Any]
    """Constexpr parameter -> value."""
    divisible_by_16: frozenset[str]
    """Parameters Triton assumes are multiples of 16 (for pointers: 16-byte aligned)."""
    num_warps: int
    raw: tuple[dict, dict] = dataclasses.field(repr=False)
    """Triton's own constexprs and attributes, keyed by argument path, as ``ASTSource`` takes them."""

    @property
    def key(self) -> str:
        """What makes two specializations compile to the same code (Triton's own cache key ingredients)."""
        constexprs, attrs = self.raw
        return repr((self.kernel.__name__, self.signature, sorted(constexprs.items()), sorted(attrs.items()),
                     sorted(self.options.__dict__.items())))  # fmt: skip


def specialize(kernel: Any, args: tuple, kwargs: dict, arch: int) -> Specialization:
    """What ``JITFunction.run`` computes before compiling, for CUDA compute capability ``arch`` instead of the
    current device."""
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = dict(kwargs, debug=False)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    names = kernel.arg_names
    by_name = {names[path[0]] if len(path) == 1 else str(path): value for path, value in constexprs.items()}
    divisible = {names[path[0]] for path, values in attrs.items() if ["tt.divisibility", 16] in map(list, values)}
    return Specialization(kernel, target, options, dict(signature), by_name, frozenset(divisible),
                          options.num_warps, (constexprs, attrs))  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Binary:
    """A compiled kernel: the cubin, the PTX it was assembled from, and its static shared memory."""

    cubin: bytes
    ptx: str
    shared_bytes: int


def compile_specialization(spec: Specialization) -> Binary:
    """Compiles TTIR -> TTGIR -> LLIR -> PTX -> cubin with the bundled ptxas; raises what the compiler raises."""
    constexprs, attrs = spec.raw
    source = ASTSource(spec.kernel, spec.signature, constexprs, attrs)
    compiled = triton.compile(source, target=spec.target, options=spec.options.__dict__)
    return Binary(compiled.asm["cubin"], compiled.asm["ptx"], int(compiled.metadata.shared))


def toolchain(name: str) -> str:
    """The path of a binary of the CUDA toolchain Triton bundles (``cuobjdump``, ``nvdisasm``, ``ptxas``)."""
    return str(TOOLCHAIN / name)


@triton.jit
def _probe(x_ptr, BLOCK: tl.constexpr):
    tl.store(x_ptr + tl.arange(0, BLOCK), tl.zeros((BLOCK,), tl.float32))


def target_supported(arch: int) -> bool:
    """Whether this Triton (its LLVM and bundled ptxas) compiles for compute capability ``arch`` at all."""
    try:
        triton.compile(ASTSource(_probe, {"x_ptr": "*fp32", "BLOCK": "constexpr"}, {(1,): 16}),
                       target=GPUTarget("cuda", arch, 32))  # fmt: skip
    except Exception:  # whatever the toolchain raises, it lacks the target
        return False
    return True
