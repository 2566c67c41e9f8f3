"""The stages of a run, one module each (calibrate, stage1, targets, stage2, stage3, report; the contract in
contract.py, their order in m2d_ray/pipeline.py), on one run context (context.py), and the Ray pieces they share:
the run's storage (run_storage.py), its resource waiter (demand.py), its recorder (record.py), the baselines
(baselines/) and what the students read (students.py, shards.py).
"""
