#!/usr/bin/env bash
# The prepared GPU check: `make gpu-check`, or bench/gpu_check.sh [REPORT.json].
# What it checks and how long it takes: bench/gpu_check.py's docstring. The report goes to the
# argument, else $GPU_CHECK_OUT, else results/gpu_check.json. The interpreter is
# $GPU_CHECK_PYTHON, else .venv's (make setup), else python3 (a GPU host's own CUDA torch).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${GPU_CHECK_PYTHON:-}
if [ -z "$python" ]; then
  if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python3; fi
fi
exec "$python" bench/gpu_check.py ${1:+--out "$1"}
