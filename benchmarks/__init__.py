"""Benchmarks of m2d_ray, a package of parts run as `python -m benchmarks.<part>.<name>` (README.md maps old names)."""
