"""The catalog: every name a config or a command may give (scorings, groupings, scalings, baselines, losses,
precision policies, KL kernels, targets modes, task suites, judges, question sets), with its one-line doc and its
checks, importable without torch, transformers or Ray. The config, the CLI and the plan stand on it; the packages that
implement the names import it to register them.

    methods.py   scorings, groupings, scalings, the random baseline students
    distill.py   losses, precision policies, KL kernels, `auto`
    targets.py   stage2.targets: the modes, their parsing and the bytes they store
    evaluate.py  task suites, judges, question sets, batch sizes
"""
