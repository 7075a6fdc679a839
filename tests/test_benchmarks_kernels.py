"""benchmarks/device_timer.py, the kernel table's timer, proved on a simulated stream: a stand-in kernel with a known
device time and a known host delay comes out as exactly those two, where the old timer (a mark on each side of one
call on an idle stream) gives their sum; a hold too short to cover the host is caught and lengthened. Then
benchmarks/kernels.py's CPU smoke run writes both columns."""

import json
import re
from pathlib import Path

import pytest

from lightning_zeropp.testing.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
timer = load_script(ROOT / "benchmarks" / "device_timer.py", "device_timer")


@pytest.mark.parametrize(
    "device_s, host_s",
    [
        (7e-6, 40e-6),  # a small kernel behind a slow launcher: the case the old table got wrong
        (600e-6, 12e-6),  # a large kernel: the host hides behind the device
        (3e-6, 3e-6),
    ],
)
def test_a_stand_in_kernel_comes_out_as_its_device_time_and_its_host_delay(device_s, host_s):
    stream = timer.SimulatedStream()
    timing = timer.measure(stream.kernel(device_s, host_s), stream, reps=20, clock=stream.clock)
    assert timing.device_s == pytest.approx(device_s, rel=1e-9, abs=1e-15)
    assert timing.host_s == pytest.approx(host_s, rel=1e-9, abs=1e-15)
    assert not timing.starved and timing.holds == 1


def test_the_old_timer_counts_the_launcher_in_the_kernel():
    """A mark on each side of one call, synchronized after each: the start fires on the idle device at once, the
    kernel only after the launcher returns."""
    stream = timer.SimulatedStream(mark_host_s=1e-6)
    old = timer.launch_inclusive(stream.kernel(7e-6, 40e-6), stream, reps=5)
    assert old == pytest.approx(7e-6 + 40e-6)  # launcher + kernel


class ShortHolds(timer.SimulatedStream):
    """A stream whose first ``short`` holds last a hundredth of what was asked (a device faster than calibrated)."""

    def __init__(self, short: int):
        super().__init__()
        self.short = short

    def hold(self, seconds: float) -> None:
        if self.short > 0:
            self.short -= 1
            seconds /= 100
        super().hold(seconds)


def test_a_hold_too_short_to_cover_the_host_is_caught_and_lengthened():
    # the first three holds (the host timings of the kernel and of the flush, the first device attempt) fall short
    stream = ShortHolds(short=3)
    timing = timer.measure(stream.kernel(5e-6, 30e-6), stream, reps=20, clock=stream.clock)
    assert timing.holds == 2 and not timing.starved
    assert timing.device_s == pytest.approx(5e-6, rel=1e-9)
    assert timing.host_s == pytest.approx(30e-6, rel=1e-9)


def test_a_device_that_always_waits_for_the_host_is_flagged_not_reported_as_kernel_time():
    # a launcher slower than the flush between repeats (which otherwise hides it): the kernel waits for it
    for attempts in (1, 3):
        stream = ShortHolds(short=10**6)
        timing = timer.measure(stream.kernel(5e-6, 80e-6), stream, reps=20, clock=stream.clock, attempts=attempts)
        assert timing.starved and timing.holds == attempts
    stream = ShortHolds(short=10**6)
    timing = timer.measure(stream.kernel(5e-6, 80e-6), stream, reps=20, clock=stream.clock, attempts=1)
    assert timing.device_s > 5e-6  # what it measured includes the launcher: hence the flag


@pytest.mark.slow
def test_the_cpu_smoke_run_writes_device_and_host_time_per_row(tmp_path):
    kernels = load_script(ROOT / "benchmarks" / "kernels.py", "kernels_benchmark")
    out = tmp_path / "kernels.json"
    kernels.main(["--smoke", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["timer"].startswith("device_timer")
    names = {r["kernel"] for r in data["rows"]}
    assert {"quantize int8 param-blocks", "dequantize_reduce_quantize 8->4", "dequantize_reduce int4"} <= names
    for row in data["rows"]:
        assert row["device_s"] > 0 and row["host_s"] > 0
        assert row["starved"]  # on a CPU the host is the device: every row says so


def test_the_default_sizes_include_a_7b_layers_per_rank_shard_and_the_whole_layer():
    kernels = load_script(ROOT / "benchmarks" / "kernels.py", "kernels_benchmark_sizes")
    layer = 4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096  # Llama-2-7B's decoder layer, counted here by hand
    assert layer == 202_383_360
    assert kernels.SIZES_MB[0] == pytest.approx(layer / 32 * 2 / 1e6, abs=0.01)
    assert layer * 2 / 1e6 == pytest.approx(kernels.SIZES_MB[3], abs=0.1)


def test_host_cost_times_every_kernel_of_the_table_with_the_launch_stubbed(tmp_path):
    host_cost = load_script(ROOT / "benchmarks" / "host_cost.py", "host_cost_benchmark")
    out = tmp_path / "host.json"
    host_cost.main(["--numel", "4096", "--reps", "5", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    (entry,) = host_cost.record.read_manifest(out)  # loaded as a test loads it, the script still finds record.py
    assert entry["command"] == f"python benchmarks/host_cost.py --numel 4096 --reps 5 --json {out}"
    kernels = load_script(ROOT / "benchmarks" / "kernels.py", "kernels_benchmark_names")
    assert [r["kernel"] for r in rows] == [name for name, _, _ in kernels.cases(4096, "cpu")]
    assert all(r["median_us"] > 0 and r["first_call_us"] > 0 for r in rows)


@pytest.mark.slow
def test_the_gpu_checks_table_leaves_the_twins_out_and_still_writes_its_rows(tmp_path):
    """What gpu_check.sh runs (--no-compile --no-eager, to fit its time limit): the Triton rows alone (two of them
    here: the whole table is the smoke run's above)."""
    kernels = load_script(ROOT / "benchmarks" / "kernels.py", "kernels_benchmark_no_twins")
    out = tmp_path / "kernels.json"
    chosen = ["quantize int8 param-blocks", "dequantize_reduce int4"]
    kernels.main(["--smoke", "--no-eager", "--kernels", *chosen, "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert sorted(r["kernel"] for r in rows) == sorted(chosen)
    assert all(r["speedup_vs_eager"] is None and r["device_s"] > 0 for r in rows)


def test_the_gpu_check_leaves_no_more_files_than_a_device_run_returns():
    """A device run returns at most 8 files from $OUT: gpu_check.sh's own files, plus a manifest beside each JSON
    file a benchmark writes through benchmarks/record.py."""
    script = (Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.sh").read_text()
    written = set(re.findall(r'"\$OUT/([\w.-]+)"', script))
    manifests = {name.replace(".json", ".manifest.json") for name in written if name.endswith(".json")}
    assert len(written | manifests) <= 8, sorted(written | manifests)
