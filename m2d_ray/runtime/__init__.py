"""The Ray plumbing every stage of a run shares, apart from the stages themselves (m2d_ray/stages/): the run's context
(context.py: built once by the command), Ray's start and its node types (ray_env.py), the storage its workers read and
write (run_storage.py), the token and targets shards students read (shards.py), each stage's resource waiter
(demand.py), its recorder (record.py) and stage 1's early-stopping scheduler (scheduler.py).
"""
