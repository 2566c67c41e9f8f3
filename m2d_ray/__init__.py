"""m2d_ray: convert a trained Mixture-of-Experts language model into a dense one.

Data flow: calibrate/ -> scoring/ -> grouping/ -> convert/ -> distill/ -> evaluate/ -> report/; above them the
stages of a run on Ray (stages/: one module per stage says what it checks, needs, runs and reports; runtime/ is the
Ray plumbing they share; plan/ is the arithmetic they price themselves with), in order in pipeline.py; one module
per command on top (commands/, cli.py).
ARCHITECTURE.md draws it.

Layers, lowest first. A module imports only from its own layer or a lower one, and there are no import
cycles, except that arch/ registers its families by importing them (tests/unit/test_imports.py checks
this list against the code):

    1. errors, console, registry, artifacts, storage, checkpoint, assets, accelerators, peaks, sizes, numerics, measured
    2. catalog, shipped
    3. config
    4. arch, quant
    5. models, weights, data
    6. calibrate
    7. scoring
    8. grouping
    9. convert
    10. evaluate
    11. prune
    12. distill
    13. plan
    14. run_dir
    15. track
    16. report
    17. runtime
    18. stages
    19. pipeline
    20. commands
    21. cli
"""

__version__ = "0.1.0"
