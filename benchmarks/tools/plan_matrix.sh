#!/bin/bash
# usage: benchmarks/tools/plan_matrix.sh CODE_DIR OUT_DIR: `m2d plan` of a matrix of configs (JSON line + table, the refusals)
# with the code in CODE_DIR; two such directories compare with `python -m benchmarks.tools.run_equal --plans A B`
code=$1; out=$2; mkdir -p $out; cd $code; export PYTHONPATH=$code
i=0
while IFS= read -r line; do
  [ -z "$line" ] && continue
  i=$((i+1))
  eval "m2d plan $line plan.cpu_flops=1e10" > $out/$i.out 2> $out/$i.err; echo "$? $line" > $out/$i.cmd
done <<'LIST'
tiny
tiny stage2.targets=hidden
tiny stage2.targets=sampled:64 stage2.asha=true
tiny-grid
tiny --gpu-memory 24GB distill.gpus_per_worker=1 ray.gpus_per_trial=0.5 stage2.targets=topk:32
wiki4
qwen3_30b_a3b --model Qwen/Qwen3-30B-A3B --cluster cluster.yaml
qwen3_30b_a3b --model Qwen/Qwen3-30B-A3B --cluster cluster.yaml stage2.targets=online
qwen3_30b_a3b --model Qwen/Qwen3-30B-A3B --cluster cluster.yaml distill.steps=2600 plan.max_dollars=100
qwen3_30b_a3b --model Qwen/Qwen3-30B-A3B --gpu-memory 80GB stage2.targets=sampled:64
qwen3_30b_a3b --model Qwen/Qwen3-30B-A3B --cluster cluster.yaml stage2.asha=false stage3.tasks=local
deepseek_v2_lite --model deepseek-ai/DeepSeek-V2-Lite --cluster cluster.yaml
gpt_oss_20b --model openai/gpt-oss-20b --cluster cluster.yaml
tiny stage2.baselines=[random-ffn] stage3.teacher=false
qwen3_30b_a3b --model Qwen/Qwen3-30B-A3B --cluster cluster.yaml distill.gpus_per_worker=0.5 stage3.gpus_per_task=0.5
LIST
