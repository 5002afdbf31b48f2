"""Independent learners as the points of a sweep (docs/distributed.md §11): learner m = 0 … M−1 of one run, each
point its own job, all pushing to one `diloco syncer` started with the same config (replicas = M).

  diloco syncer --config experiments/toy.py:streaming --config.replicas=4 --port 7070 --host 0.0.0.0 --tls_cert … &
  diloco sweep sweeps/learners.py:4 --root /shared/runs --launch slurm --set sync=grpc://SYNC_HOST:7070
"""
from diloco.sweep import product


def get_sweep(arg: str = "4"):
    return {"name": f"learners_{arg}", "experiment": "experiments/toy.py:streaming",
            "points": product(replicas=[int(arg)], learner=list(range(int(arg))))}
