"""The compile gate for sm_100 (B200), where the toolchain knows it: the rotated specializations of the hand-picked
list (``aot.strategy_launches``), the kernels with the most registers live, compiled without a spill. A module of
its own so that it runs beside ``test_compile_gate.py`` (sm_90) and ``test_compile_gate_sm80.py`` on another worker.
"""

import pytest

from lightning_zeropp.testing.capture import without_interpreter

pytest.importorskip("triton")
pytestmark = pytest.mark.slow  # compiles about 50 kernels (minutes cold)


def test_rotated_blocks_compile_for_sm100_without_spills():
    """Compiled, no stack, no local memory, registers read."""
    code = """
from lightning_zeropp.compat import triton as compat
from lightning_zeropp.kernels import aot
if not compat.target_supported(100):
    print("unsupported")
    raise SystemExit
launches = [l for l in aot.unique_launches(aot.strategy_launches())
            if l.kwargs.get("ROTATE") or l.kernel.__name__ == "_rotation_table_kernel"]
bad = []
for launch in launches:
    c = aot.compile_launch(launch, 100)
    if c.error or c.stack_bytes or c.local_bytes or c.registers <= 0:
        bad.append(f"{c.kernel} {c.constexprs} [{c.label}]: {c.error[-300:]} {c.stack_bytes} {c.local_bytes}")
print("compiled", len(launches))
print("\\n".join(bad[:10]))
"""
    done = without_interpreter(code)
    assert done.returncode == 0, done.stderr[-4000:]
    if "unsupported" in done.stdout:
        pytest.skip("this Triton's toolchain does not compile for sm_100")
    count = int(done.stdout.split("compiled ")[1].split()[0])
    assert count >= 40 and done.stdout.strip().endswith(f"compiled {count}"), done.stdout[-4000:]
