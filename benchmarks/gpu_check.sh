#!/usr/bin/env bash
# One-shot GPU check, for the day a CUDA device is at hand (about 5 minutes on one H200):
#   1. kernel bit-exactness on CUDA against the torch twins (tests/test_kernels_gpu.py),
#   2. the bandwidth table (benchmarks/kernels.py: GB/s, % of device copy, x eager, x torch.compile),
#   3. qgZ/qwZ kernel pipelines at production shapes and a short training run with kernel_backend="triton".
# Results land in $OUT (default benchmarks/gpu_check/); the script stops at the first failure.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/gpu_check}
mkdir -p "$OUT"
python -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.cuda.get_device_name())'
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv | tee "$OUT/device.txt" || true
echo "== 1/3 kernel bit-exactness on CUDA"
python -m pytest tests/test_kernels_gpu.py -q -p no:cacheprovider 2>&1 | tee "$OUT/kernels_gpu.txt"
echo "== 2/3 bandwidth table"
python benchmarks/kernels.py --sizes-mb 1 16 64 256 1024 --reps 20 --json "$OUT/kernels.json" | tee "$OUT/kernels.txt"
echo "== 3/3 pipelines and training smoke"
python benchmarks/gpu_smoke.py --steps 30 --json "$OUT/gpu_smoke.json" | tee "$OUT/gpu_smoke.txt"
echo "gpu_check: all passed; results in $OUT"
