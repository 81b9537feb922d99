#!/usr/bin/env bash
# One entry point for a fresh clone:
#   bash scripts/run.sh demo    compile the embedded tiny model with the passes and print the rewrite report
#   bash scripts/run.sh test    run the test suite (CPU: Triton kernels under the interpreter)
# The first call makes .venv: the CPU build of torch 2.13 (a local wheel on CPU machines) and this package.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c "import dsv41_passes, torch, triton, matplotlib, xdist" 2>/dev/null; then
  "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  # pin the CPU torch first so the open range in pyproject does not pull a multi-GB CUDA build
  .venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -e ".[triton,tilelang,dev,examples]"
fi
# the GPU image's Triton (3.6), beside this one, for the tests that build the kernels for sm_90 (tests/sm90.py)
if [ "${1:-demo}" = test ] && [ ! -d .venv/gpu-triton/triton ]; then
  .venv/bin/python -m pip install -q --no-deps --target .venv/gpu-triton "triton==3.6.0" >/dev/null 2>&1 ||
    echo "note: triton 3.6.0 could not be installed; the sm_90 builds use this environment's Triton only" >&2
fi
cmd=${1:-demo}
shift || true
case "$cmd" in
  demo) exec .venv/bin/python -m dsv41_passes inspect --model tiny "$@" ;;
  # one worker per core, at most TEST_JOBS (default 2: the interpreter tests are single-threaded);
  # worksteal: an idle worker takes tests still queued on the other (the slow model tests come last)
  test) exec .venv/bin/python -m pytest -q -n "$(.venv/bin/python -c "import os; print(min(len(os.sched_getaffinity(0)), int(os.environ.get('TEST_JOBS', 2))))")" --dist worksteal "$@" ;;
  *) echo "usage: bash scripts/run.sh {demo|test} [args]" >&2; exit 2 ;;
esac
