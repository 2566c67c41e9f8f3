"""Sweeps on Ray Tune: stage 1 (conversion recipes by pre-distillation perplexity)."""
