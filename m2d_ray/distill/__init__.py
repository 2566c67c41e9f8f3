"""Distillation of a dense student from its MoE teacher.

losses.py (chunked KL over the vocabulary), data.py (packed training sequences), loop.py (the
per-worker training loop: plain torch + optional DeepSpeed, no Ray) and trainer.py (Ray Train).
"""
