"""The stages of a run, one module each (calibrate, stage1, targets, stage2, stage3, analysis, report; the contract in
contract.py, their order in m2d_ray/pipeline.py), the baselines (baselines/) and what the students are (students.py,
student.py). The Ray plumbing they share (the run's context, storage, shards, resource waiters, recorder) is
m2d_ray/runtime/.
"""
