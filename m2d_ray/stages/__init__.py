"""The Ray stages of a run: stage 1 (the recipe grid by pre-distillation perplexity), stage 2
(distillation of the promoted students and the baselines), stage 3 (lm-eval). Everything a worker
reads or writes is named by `run_storage.RunStorage`; results go through `record.StageRecorder`.
"""
