#!/usr/bin/env bash
# One device call: GPU tests, then the GPU benchmark (extra args go to `deft bench attention`).
# Run from the repo root on the GPU machine; results land in $OUT (default ./out).
# Wheels the machine lacks (gguf, for the engine tests) may be carried in .whl/.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && PYTHONPATH=/tmp/site:$PYTHONPATH
fi
[ -d .workloads ] && export DEFT_WORKLOADS=$PWD/.workloads
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  python3 -m pytest -q -m gpu -p no:cacheprovider tests/ 2>&1 | tee "$OUT/pytest_gpu.log" | tail -15
fi
python3 -m deft.cli bench attention --device cuda --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.md"
