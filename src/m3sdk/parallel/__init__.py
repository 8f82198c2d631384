"""Tensor (and expert) parallel serving over torch.distributed: see group.py for the run-time design and
sharding.py for who holds which weights."""

from m3sdk.parallel.graphs import MirroredGraphs
from m3sdk.parallel.group import TensorParallel
from m3sdk.parallel.sharding import ExpertParallelMoE, Shard, load_shard, local_config

__all__ = ["ExpertParallelMoE", "MirroredGraphs", "Shard", "TensorParallel", "load_shard", "local_config"]
