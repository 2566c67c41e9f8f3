"""Groupings: partition the K selected experts into exactly k non-empty groups.

The names are declared in `catalog/methods.py`; `methods.py` here implements them.
"""
