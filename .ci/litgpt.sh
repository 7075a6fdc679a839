#!/usr/bin/env bash
# The litgpt example and its test (tests/test_litgpt.py), in a virtual environment of its own: litgpt pins
# jsonargparse <= 4.41, older than the one the main suite tests the CLI with. The environment sees the packages
# already installed (--system-site-packages) and adds the `litgpt` extra.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${LITGPT_VENV:-${TMPDIR:-/tmp}/lightning-zeropp-litgpt}
python -m venv --system-site-packages "$venv"
"$venv/bin/pip" install -q torch==2.13.0 -e ".[litgpt,test]"
"$venv/bin/pip" list 2>/dev/null | grep -iE '^(litgpt|lightning|torch|jsonargparse) ' || true
"$venv/bin/python" -m pytest -p no:cacheprovider -q tests/test_litgpt.py
