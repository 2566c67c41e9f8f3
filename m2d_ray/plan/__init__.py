"""Know before spending: the memory, devices and storage of every stage of a run, from configs alone.

    shapes.py   a teacher's and its student's sizes from config.json on the meta device (no weights)
    memory.py   bytes per device of each stage, part by part (weights, optimizer, activations, buffers)
    devices.py  GPUs by accelerator type, node types, and whether a stage's request fits one
    run_plan.py the plan of a run (`m2d plan`, and `m2d run` before calibration): table, JSON, the first
                stage that does not fit as one line with its fix

The estimates are checked against measured peaks (tests/unit/test_plan_measured.py, benchmarks/RESULTS.md).
"""
