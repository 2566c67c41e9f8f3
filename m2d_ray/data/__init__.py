"""Data sources: a deterministic synthetic multi-domain corpus (``m2d_ray.data.synthetic``)."""
