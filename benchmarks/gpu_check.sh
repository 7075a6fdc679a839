#!/usr/bin/env bash
# One-shot GPU check, for the day a CUDA device is at hand (under 10 minutes on one H200):
#   1. kernel bit-exactness on CUDA against the torch twins (tests/test_kernels_gpu.py, and the rotated
#      specializations' checks in tests/test_kernels_rotation.py),
#   2. the bandwidth table (benchmarks/kernels.py: device time and host time per call measured apart, GB/s by
#      device time, % of the device's copy bandwidth; the twins' columns left out, measured before) at a 7B
#      layer's per-rank shard (12.65 MB), 64 MB, 256 MB and a whole 7B layer (404.8 MB); and the launchers' own
#      host time with the launch stubbed (benchmarks/host_cost.py), on this machine's host CPU,
#   3. qgZ/qwZ kernel pipelines at production shapes and a short training run with kernel_backend="triton",
#   4. the second-moment correction's step on the GPU, lowered per parameter and per unit (benchmarks/moments_cost.py).
# Each step has its own time limit and the script goes on past a failed step, so one run reports all four; it exits
# non-zero if any failed. Results land in $OUT (default benchmarks/gpu_check/) as 8 files, the most a device run
# returns: summary.txt (the device, each step's exit), log.txt (every step's output), and kernels.json, host_cost.json
# and gpu_smoke.json, each with its manifest (benchmarks/record.py).
# Runs from a checkout without installing: it links lightning_zeropp/kernels to triton_kernels/ (what the editable
# install maps) when the package does not import.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ! python -c 'import lightning_zeropp.kernels' 2>/dev/null; then
  ln -sfn ../triton_kernels lightning_zeropp/kernels
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
{
  python -c 'import torch, triton, lightning; print(torch.cuda.get_device_name(), "torch", torch.__version__,
"triton", triton.__version__, "lightning", lightning.__version__)'
  nvidia-smi --query-gpu=name,clocks.max.sm,memory.total,driver_version --format=csv || true
} 2>&1 | tee "$OUT/summary.txt"
python -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"' || exit 2
failed=()
step() {  # step NAME LIMIT_S COMMAND...: runs COMMAND under a time limit, its output appended to $OUT/log.txt
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit} s)" | tee -a "$OUT/log.txt"
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee -a "$OUT/log.txt"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
  [ "$rc" = 0 ] || failed+=("$name")
}
kernel_tests() {  # five groups side by side (the suite's xdist scheduler keeps a module on one worker)
  local groups=("tests/test_kernels_gpu.py -k quantize_dequantize or rows or every_code"
    "tests/test_kernels_gpu.py -k not (quantize_dequantize or rows or every_code)"
    "tests/test_kernels_rotation.py -k test_quantize and not cpu"
    "tests/test_kernels_rotation.py -k requantize and not cpu"
    "tests/test_kernels_rotation.py -k not cpu and not test_quantize and not requantize")
  local pids=() rc=0 i
  for i in "${!groups[@]}"; do
    local file=${groups[$i]%% -k *} filter=${groups[$i]#* -k }
    timeout "$((TESTS_S - 15))" python -m pytest "$file" -k "$filter" -q -p no:cacheprovider -p no:xdist \
      >"/tmp/gpu_tests_$i.log" 2>&1 &
    pids+=($!)
  done
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}" || rc=1
    echo "-- ${groups[$i]}"
    tail -n 40 "/tmp/gpu_tests_$i.log"
  done
  return $rc
}
export TESTS_S=${GPU_CHECK_TESTS_S:-240}
export -f kernel_tests
step kernels_gpu "$TESTS_S" bash -c kernel_tests
step kernels "${GPU_CHECK_BANDWIDTH_S:-200}" python benchmarks/kernels.py --no-compile --no-eager \
  --sizes-mb ${GPU_CHECK_SIZES_MB:-12.65 64 256 404.8} --reps 20 --json "$OUT/kernels.json"
step host_cost "${GPU_CHECK_HOST_S:-60}" python benchmarks/host_cost.py --reps 500 --json "$OUT/host_cost.json"
step gpu_smoke "${GPU_CHECK_SMOKE_S:-120}" python benchmarks/gpu_smoke.py --steps 30 --json "$OUT/gpu_smoke.json"
step moments_cost "${GPU_CHECK_MOMENTS_S:-40}" python benchmarks/moments_cost.py --device cuda --both \
  --n-embd 256 1024 2048 --repeats 10
if [ ${#failed[@]} -gt 0 ]; then
  echo "gpu_check: FAILED: ${failed[*]}; results in $OUT" | tee -a "$OUT/summary.txt"
  exit 1
fi
echo "gpu_check: all passed; results in $OUT" | tee -a "$OUT/summary.txt"
