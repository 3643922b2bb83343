"""The sharding plan: which tensors N ranks split and how, and the config each rank runs.

A family says it as data at the end of its module: `TP_HEADS`, the config counts a rank takes 1/N of
(attention heads, KDA / Mamba-2 heads and groups, DeepSeek-V4's output groups), and `tp_plan(cfg)`,
(regex of contract names, axis or `Shard`) for its mixers' tensors. The rest is common to every family
and written once here (`COMMON`): the routed expert stacks (split by expert with expert parallelism,
else by width: gate|up rows, down columns), the dense MLPs and shared experts (gate and up rows, down
columns) and the embedding and lm_head (vocabulary rows). Everything else is replicated: routers,
norms, mHC and AttnRes mixing, MLA's latent projections, indexers, compressors, Engram.

The family's forward then runs unchanged on the local shapes: `local_config` divides the head counts,
column-parallel weights are this rank's output rows, and the few places that need a collective are
the row-parallel and vocabulary-parallel weights (moesaic/parallel/comm.py) and the MoE block
(layers/moe.py `MoeWeights.reduce`). Like gpt-fast's `tp.py`: walk the weights, slice them, no framework.
"""

from __future__ import annotations

import dataclasses
import re

from ..errors import ConfigError
from ..weights.contract import LoadPlan, Shard, TensorSpec, plan_load, shard_bytes

VOCAB = Shard(0, uneven=True)


def _experts(spec: TensorSpec, expert_parallel: bool) -> Shard:
    if expert_parallel:
        return Shard(0)  # whole experts: rank r owns experts r*E/N .. (r+1)*E/N - 1
    if spec.name.endswith("gate_up_proj"):  # [E, 2I, d]: gate rows and up rows each split
        half = spec.shape[1] // 2
        return Shard(1, (half, half))
    return Shard(1) if spec.name.endswith("up_proj") else Shard(2)  # up [E, I, d] rows, down [E, d, I] cols


# (regex of contract names, Shard or a function of (spec, expert_parallel)), after the family's own table
COMMON = [
    (r".*\.experts\.(gate_up_proj|up_proj|down_proj)", _experts),
    (r".*\.(mlp|shared_experts)\.(gate_proj|up_proj)\.weight", Shard(0)),
    (r".*\.(mlp|shared_experts)\.down_proj\.weight", Shard(1)),
]


def shard_of(spec: TensorSpec, table: list, expert_parallel: bool) -> Shard | None:
    """How `spec` is split: the family's table first, then the common rules; None = replicated."""
    if spec.role in ("embedding", "lm_head"):
        return VOCAB
    for pattern, how in table + COMMON:
        if re.fullmatch(pattern, spec.name):
            if callable(how):
                return how(spec, expert_parallel)
            return Shard(how) if isinstance(how, int) else how
    return None


def has_plan(family) -> bool:
    return hasattr(family, "tp_plan") and hasattr(family, "TP_HEADS")


def sharded_specs(family, cfg, expert_parallel: bool = False) -> list[TensorSpec]:
    """The family's tensor contract with each tensor's `shard` set."""
    if not has_plan(family):
        raise ConfigError(
            f"{family.__name__.rsplit('.', 1)[-1]} has no tensor-parallel plan: run it with tensor_parallel_size=1"
        )
    table = family.tp_plan(cfg)
    return [
        dataclasses.replace(s, shard=shard_of(s, table, expert_parallel)) for s in family.tensor_specs(cfg)
    ]


def local_config(family, cfg, world: int):
    """The config one of `world` ranks runs: each of the family's TP_HEADS counts divided by `world`
    (a dotted name reaches into a nested config). A count that does not divide is a ConfigError naming
    it, raised before any process starts."""
    if world == 1:
        return cfg
    if not has_plan(family):
        sharded_specs(family, cfg)  # raises: no plan
    return _divide(cfg, [f.split(".") for f in family.TP_HEADS], world, "")


def _divide(cfg, paths: list[list[str]], world: int, where: str):
    changes = {}
    for head in dict.fromkeys(p[0] for p in paths):
        inner = [p[1:] for p in paths if p[0] == head and len(p) > 1]
        value = getattr(cfg, head)
        if inner:
            changes[head] = _divide(value, inner, world, f"{where}{head}.")
        elif value % world:
            raise ConfigError(
                f"tensor_parallel_size={world} does not divide {where}{head}={value}: each rank takes an "
                f"equal share of it; choose a size that divides it"
            )
        else:
            changes[head] = value // world
    return dataclasses.replace(cfg, **changes)


def sharded_plan(ckpt, world: int, expert_parallel: bool = False) -> LoadPlan:
    """The load plan of one of `world` ranks, checked: the config's counts divide, the checkpoint matches
    the contract, and every piece of every sharded tensor divides and keeps its scale blocks (all before
    any process starts; a ConfigError names the tensor or field and N)."""
    local_config(ckpt.family, ckpt.cfg, world)
    specs = sharded_specs(ckpt.family, ckpt.cfg, expert_parallel)
    plan = plan_load(specs, ckpt.store, ckpt.family.namings(ckpt.cfg, ckpt.store.layout, ckpt.store.names()))
    shard_bytes(plan, ckpt.store, 0, world)  # views only: raises on a piece that does not divide
    return plan


def rank_bytes(family, cfg, specs: list[TensorSpec], world: int, dtype_bytes: int = 2) -> dict:
    """What one of `world` ranks holds, from the config alone: parameters (sharded and replicated) and
    the state planner's bytes on the local config (`inspect --tensor-parallel-size`)."""
    sharded = replicated = 0
    for s in specs:
        n = 1
        for d in s.shape:
            n *= max(d, 1)
        if s.shard is None:
            replicated += n
        else:
            size = s.shard.parts or (s.shape[s.shard.axis],)
            kept = sum(-(-b // world) for b in size)  # rank 0's share (the largest with uneven vocab rows)
            sharded += n * kept // max(s.shape[s.shard.axis], 1)
    per_token, fixed = family.state_bytes(local_config(family, cfg, world), dtype_bytes)
    return {
        "tensor_parallel_size": world,
        "params_per_rank": sharded + replicated,
        "params_sharded_per_rank": sharded,
        "params_replicated": replicated,
        "state_bytes_per_token_per_rank": per_token,
        "state_bytes_fixed_per_sequence_per_rank": fixed,
    }
