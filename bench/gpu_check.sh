#!/usr/bin/env bash
# The prepared GPU check: `make gpu-check`, or bench/gpu_check.sh [REPORT.json].
# What it checks and how long it takes: bench/gpu_check.py's docstring. The report goes to the
# argument, else $GPU_CHECK_OUT, else results/gpu_check.json. The interpreter is
# $GPU_CHECK_PYTHON, else .venv's (make setup), else python3 (a GPU host's own CUDA torch).
#
# A bare GPU host has no network and lacks some of astranb's dependencies: when the interpreter
# cannot import them and .gpu-wheels/ (make gpu-wheels, on a networked machine; or
# $GPU_CHECK_WHEELS) is there, the wheels it lacks are unpacked into a scratch folder of this
# run's own, put on PYTHONPATH with the checkout, and removed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${GPU_CHECK_PYTHON:-}
if [ -z "$python" ]; then
  if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python3; fi
fi
wheels=${GPU_CHECK_WHEELS:-.gpu-wheels}
pythonpath=$PWD
if ! "$python" -c "import zstandard, fastapi, uvicorn" 2>/dev/null; then
  if [ ! -d "$wheels" ]; then
    echo "[gpu-check] $python lacks zstandard, fastapi or uvicorn and there is no $wheels/:" \
         "run 'make gpu-wheels' on a networked machine and copy that folder with the checkout" >&2
    exit 2
  fi
  scratch=$(mktemp -d "${TMPDIR:-/tmp}/astranb-gpu-check.XXXXXX")
  trap 'rm -rf "$scratch"' EXIT
  "$python" bench/gpu_wheels.py install "$wheels" "$scratch"
  pythonpath=$scratch:$pythonpath
fi
export PYTHONPATH=$pythonpath${PYTHONPATH:+:$PYTHONPATH}
status=0
"$python" bench/gpu_check.py ${1:+--out "$1"} || status=$?
exit $status
