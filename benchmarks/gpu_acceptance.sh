#!/usr/bin/env bash
# GPU acceptance call (issues 42, 47, 52, 61): what stage 2 runs now, within a device budget. First the paper's student
# (48 x 2048, vocabulary 151,936, 4 x 4096 tokens, from cached hidden states on one rank, checkpointed as `m2d plan`
# decides for the card): the platform's step against a plain PyTorch loop and each lever (checkpointing, compiled
# layers, attention), one path at a time: tokens/s, MFU against the data sheet and the measured matmul rate, each
# path's peak beside the plan's; it fits plan.efficiency (hidden). Then P7 at the paper student's head at the same
# micro-batch (each kernel's speed, step peak and trajectory against bf16-mixed's own spread vs fp32; it sets auto's
# kernel), then the memory plan against torch.cuda.max_memory_allocated; then, as the budget allows, the calibration
# rate at Qwen3-30B-A3B's layer shapes (P5), P7 at the h100 preset (online / hidden / sampled:64 and the DeepSpeed
# path), a whole `m2d run` on the GPU and the Ray Data token pass. Parts are planned against --budget-s (default
# 540 s), shrunk or skipped with a line saying so; one table at the end (WORK/table.md), every figure in
# WORK/results.json, logs in WORK/logs, and WORK/measured_gpu.json: the figures the code reads (see
# benchmarks/gpu/acceptance.py).
#
#   bash benchmarks/gpu_acceptance.sh [--budget-s 540] [--work /tmp/m2d-gpu-acceptance] [--parts P7-paper,P7-head,memory,P5,P7,run,tokens]
#   python -m benchmarks.gpu.acceptance --cpu-smoke      # the same plumbing on the CPU with tiny shapes (no GPU figures;
#                                                          the head's GPU branch at its real shapes on meta tensors)
#
# From a session that is lent a GPU (the device tool; ../shared/gpu/README.md):
#   1. once per checkout, here (about 4 minutes, ~48 MB; needs PyPI; liger-kernel for distill.kl_kernel=liger):
#        echo /.gpu-bundle/ >> "$(git rev-parse --git-common-dir)/info/exclude" &&
#        EXTRA="liger-kernel==0.8.5" bash ../shared/gpu/make_bundle.sh .gpu-bundle
#   2. one call (the project and the bundle fit one; install < 1 min, then the budget):
#        run(timeout_s=600, carry=[".gpu-bundle"], command=
#            "bash .gpu-bundle/install.sh && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH HF_HUB_OFFLINE=1 &&
#             (bash benchmarks/gpu_acceptance.sh --budget-s 520 --work /tmp/acc; echo rc=$?);
#             cp /tmp/acc/table.md /tmp/acc/results.json /tmp/acc/measured_gpu.json $OUT/ 2>/dev/null;
#             tar czf $OUT/logs.tgz -C /tmp/acc logs")
#   3. Paste WORK/table.md into benchmarks/RESULTS.md ("GPU acceptance") with the card's name, and copy
#      WORK/measured_gpu.json over m2d_ray/measured_gpu.json: plan.efficiency, plan.gpu_start_s, the auto kernel and
#      the next call's priors follow from it (tests/unit/test_plan_gpu.py holds the bill to its walls).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_acceptance.sh: no CUDA device (torch.cuda.is_available() is False): run it on a GPU machine," \
         "or check the plumbing on the CPU with: $PY -m benchmarks.gpu.acceptance --cpu-smoke" >&2
    exit 2
fi
"$PY" -c 'import deepspeed' 2>/dev/null || { echo "gpu_acceptance.sh: deepspeed does not import (it also breaks transformers' loading); fix the environment first" >&2; exit 2; }
exec "$PY" -m benchmarks.gpu.acceptance "$@"
