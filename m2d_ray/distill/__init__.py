"""Distillation of a dense student from its MoE teacher.

losses.py (chunked KL over the vocabulary), targets.py (cached teacher targets: top-K or sampled,
sharded with checksums), data.py (packed training sequences), loop.py (the
per-worker training loop: plain torch + optional DeepSpeed, no Ray) and trainer.py (Ray Train).

The names a config may give (losses, precision policies, KL kernels, targets modes) are declared in `catalog/`.
"""
