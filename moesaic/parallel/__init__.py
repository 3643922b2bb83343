"""Tensor and expert parallelism on torch.distributed: a model split over N ranks, each reading only its
shard, equal to one rank. `plan.py` is the sharding plan (the families' tables, applied to their tensor
contracts), `comm.py` the process groups and the weights that need a collective, `workers.py` starting
the ranks, the workers' loop and the engine in lockstep. docs/parallel.md says how to run it."""

from .comm import WorkerError
from .plan import local_config, rank_bytes, sharded_plan, sharded_specs
from .workers import build_model, close_pools, start, under_torchrun

__all__ = [
    "WorkerError",
    "build_model",
    "close_pools",
    "local_config",
    "rank_bytes",
    "sharded_plan",
    "sharded_specs",
    "start",
    "under_torchrun",
]
