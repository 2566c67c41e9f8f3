"""The workshop: what the tests and the benchmarks share to build and measure m2d, and the GPU acceptance call's
plumbing, kept outside the shipped package (the wheel holds m2d_ray/ only; tests/unit/test_imports.py holds that
m2d_ray never imports this). Tests and benchmarks import it from the repository's root, as they import `benchmarks`.

    random_models.py    random teachers and students at a preset's shapes (the tests', the benchmarks', the paper's)
    trajectories.py     loss trajectories per path and precision policy, on one rank or a gloo group
    local_group.py      a gloo process group on this machine (the multi-rank tests and benchmarks)
    asha_ray.py         Ray Tune's own ASHAScheduler over simulated students: the reference plan/asha.py is held to
    time_budget.py      the GPU acceptance call's parts, each within its share of the call's time
    measured_write.py   m2d_ray/measured_gpu.json as the acceptance call measured it
"""
