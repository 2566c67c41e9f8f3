"""Scorings: name -> function(stats, K) -> Selection (the K kept experts and per-expert scores).

The names are declared in `catalog/methods.py`; `methods.py` here implements them.
"""
