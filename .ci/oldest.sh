#!/usr/bin/env bash
# The oldest dependencies pyproject.toml allows (torch 2.9.0, Lightning 2.6.0, and the triton torch 2.9 ships), in a
# virtual environment of their own, running the tests that touch what changes between versions: the compat layer,
# FSDP2's hooks, the strategy's lifecycle and steps, checkpoints, preemption (Lightning's SLURM signal handler), qgZ,
# the kernels (interpreted).
# PyPI's torch 2.9.0 for Linux x86-64 is the CUDA build (it runs on the CPU): about 4 GB to download, 7 GB on disk.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${OLDEST_VENV:-${TMPDIR:-/tmp}/lightning-zeropp-oldest}
free_gb=$(df -Pk "$(dirname "$venv")" | awk 'NR == 2 { print int($4 / 1048576) }')
if (( free_gb < 12 )); then  # a failure, not a skip: CI must not turn green without this run
    echo "oldest.sh: FAILED: $free_gb GB free next to $venv; the oldest torch (a CUDA build) needs about 12." \
        " Set OLDEST_VENV to a folder on a disk with room." >&2
    exit 1
fi
python -m venv "$venv"
"$venv/bin/pip" install -q "torch==2.9.0" "lightning==2.6.0" "pytest>=8" "pytest-xdist>=3.5"
"$venv/bin/pip" install -q --no-deps -e .
"$venv/bin/python" - <<'PY'
import lightning, torch, triton
print(f"oldest.sh: torch {torch.__version__}, lightning {lightning.__version__}, triton {triton.__version__}")
PY
"$venv/bin/python" -m pytest -p no:cacheprovider -q -n 2 -m version_sensitive tests
