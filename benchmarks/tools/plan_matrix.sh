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
experiments/tiny.yaml
experiments/tiny.yaml stage2.targets=hidden
experiments/tiny.yaml stage2.targets=sampled:64 stage2.asha=true
experiments/tiny-grid.yaml
experiments/tiny.yaml --gpu-memory 24GB distill.gpus_per_worker=1 ray.gpus_per_trial=0.5 stage2.targets=topk:32
experiments/wiki4.yaml
experiments/qwen3_30b_a3b.yaml --model experiments/configs/Qwen--Qwen3-30B-A3B --cluster cluster.yaml
experiments/qwen3_30b_a3b.yaml --model experiments/configs/Qwen--Qwen3-30B-A3B --cluster cluster.yaml stage2.targets=online
experiments/qwen3_30b_a3b.yaml --model experiments/configs/Qwen--Qwen3-30B-A3B --cluster cluster.yaml distill.steps=2600 plan.max_dollars=100
experiments/qwen3_30b_a3b.yaml --model experiments/configs/Qwen--Qwen3-30B-A3B --gpu-memory 80GB stage2.targets=sampled:64
experiments/qwen3_30b_a3b.yaml --model experiments/configs/Qwen--Qwen3-30B-A3B --cluster cluster.yaml stage2.asha=false stage3.tasks=local
experiments/deepseek_v2_lite.yaml --model experiments/configs/deepseek-ai--DeepSeek-V2-Lite --cluster cluster.yaml
experiments/gpt_oss_20b.yaml --model experiments/configs/openai--gpt-oss-20b --cluster cluster.yaml
experiments/tiny.yaml stage2.baselines=[random-ffn] stage3.teacher=false
experiments/qwen3_30b_a3b.yaml --model experiments/configs/Qwen--Qwen3-30B-A3B --cluster cluster.yaml distill.gpus_per_worker=0.5 stage3.gpus_per_task=0.5
LIST
