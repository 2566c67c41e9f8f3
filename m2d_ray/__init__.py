"""m2d_ray: convert a trained Mixture-of-Experts language model into a dense one.

Data flow: calibrate/ -> stats -> scoring/ -> grouping/ -> convert/ -> evaluate/ (see pipeline.py).
"""

__version__ = "0.1.0"
