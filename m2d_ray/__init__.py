"""m2d_ray: convert a trained Mixture-of-Experts language model into a dense one.

Data flow: calibrate/ -> scoring/ -> grouping/ -> convert/ -> distill/ -> evaluate/ -> report/; above them the
stages of a run on Ray (stages/: one module per stage says what it checks, needs, runs and reports; plan/ is the
arithmetic they price themselves with), in order in pipeline.py; one module per command on top (commands/, cli.py).
ARCHITECTURE.md draws it.

Layers, lowest first. A module imports only from its own layer or a lower one, and there are no import
cycles, except that arch/ registers its families by importing them (tests/unit/test_imports.py checks
this list against the code):

    1. errors, console, registry, artifacts, storage, checkpoint, assets, accelerators, peaks, sizes, numerics, measured
    2. arch
    3. models, weights, data
    4. calibrate
    5. scoring
    6. grouping
    7. convert
    8. evaluate
    9. prune
    10. distill
    11. config
    12. plan
    13. run_dir
    14. track
    15. report
    16. stages
    17. pipeline
    18. commands
    19. cli
"""

__version__ = "0.1.0"
