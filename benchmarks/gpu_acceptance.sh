#!/usr/bin/env bash
# GPU acceptance run (issue 13): calibrate (whole and streamed, P5 rate vs the bf16 matmul rate), convert,
# a small stage-1 grid on fractional GPUs, a few DeepSpeed ZeRO-2 bf16 distillation steps and stage 3 on the
# offline lm-eval task, on a random-weight bf16 teacher with Qwen3-30B-A3B's full layer shapes (d 2048,
# expert width 768, E 128, k 8; LAYERS layers). Prints one table; logs under WORK/logs.
#
#   bash benchmarks/gpu_acceptance.sh [--layers 4] [--calib-tokens 262144] [--work /tmp/m2d-gpu-acceptance]
#   python benchmarks/gpu_acceptance.py --cpu-smoke      # the same stages on the CPU with tiny shapes (no GPU figures)
#
# On the lent GPU machine, first install the bundle (../shared/gpu/README.md) and export PYTHONPATH/PATH as it says.
# The P7 stage (issue 17) runs benchmarks/p7_distill_throughput.py --preset h100 when that file exists.
# First: the memory plan's estimates against the GPU's measured peaks (benchmarks/plan_measured.py --device cuda).
# Last (P7): the efficiency the platform's stage-2 step reaches against the GPU's data-sheet peak -> WORK/efficiency.json, the
# figure PlanConfig.efficiency (m2d plan's time and dollars) should default to once a GPU has measured it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_acceptance.sh: no CUDA device (torch.cuda.is_available() is False): run it on a GPU machine," \
         "or check the plumbing on the CPU with: $PY benchmarks/gpu_acceptance.py --cpu-smoke" >&2
    exit 2
fi
"$PY" -c 'import deepspeed' 2>/dev/null || { echo "gpu_acceptance.sh: deepspeed does not import (it also breaks transformers' loading); fix the environment first" >&2; exit 2; }
# The memory plan (issue 24) against torch.cuda.max_memory_allocated: training steps, calibration and lm-eval in bf16.
echo "== memory plan vs measured (benchmarks/plan_measured.py --device cuda) =="
"$PY" benchmarks/plan_measured.py --device cuda || echo "plan_measured: failed (see above); the acceptance run goes on" >&2
exec "$PY" benchmarks/gpu_acceptance.py "$@"
