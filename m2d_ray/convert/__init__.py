"""Conversion: plan (select, group, scale) -> merge -> concatenate -> dense student (`build.py`).

The names of the scalings (`scaling.py`) and of the random baseline students (`baselines.py`) are declared in
`catalog/methods.py`.
"""
