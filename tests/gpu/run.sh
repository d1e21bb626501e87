#!/usr/bin/env bash
# The GPU checks as one command, on a machine with a CUDA device (docs/gpu.md):
#   bash tests/gpu/run.sh [OUT_DIR]        (BENCH_ARGS="--sizes 1.6" to shorten the benchmark)
# The CUDA tests, then `python -m bench gpu`; logs and bench/results/gpu.md's table land in OUT_DIR.
set -uo pipefail
out=${1:-gpu-check}
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
python3 -m pytest -q -p no:cacheprovider -rfE --durations=5 -m cuda tests/gpu tests/distributed/test_memory_tier_ranks.py 2>&1 | tee "$out/tests.log"
python3 -m bench gpu --out "$out/gpu.md" ${BENCH_ARGS:-} 2>&1 | tee "$out/bench.log"
