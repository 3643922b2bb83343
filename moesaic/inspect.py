"""`moesaic inspect`: what a checkpoint is and what it will cost, from its config (and headers when present)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from . import parallel
from .config import is_demo
from .errors import CheckpointError
from .models import family_for
from .weights.contract import plan_load, quantization_config, shard_bytes
from .weights.precision import PrecisionSchedule
from .weights.store import WeightStore


def inspect_checkpoint(
    path: str | Path,
    kv_dtype_bytes: int = 2,
    precision: str | None = None,
    tensor_parallel_size: int = 1,
    expert_parallel: bool = False,
) -> dict:
    """tensor_parallel_size > 1 adds `tensor_parallel`: what each rank holds (parameters, state, and with
    the tensor files present the bytes each rank reads), checked as a load would check it."""
    store = WeightStore(path, require_files=False)
    family, raw = family_for(store.config, store.layout)
    cfg = family.parse_config(raw, store.layout)
    specs = family.tensor_specs(cfg)
    params_by_role: Counter = Counter()
    for s in specs:
        n = 1
        for d in s.shape:
            n *= d
        params_by_role[s.role] += n
    per_token, fixed = family.state_bytes(cfg, kv_dtype_bytes)
    ctx = family.max_context(cfg)
    formats = Counter(i.dtype for i in store.infos.values())
    qc = quantization_config(store)
    info = {
        "path": str(path),
        "family": family.__name__.rsplit(".", 1)[-1],
        "model_type": cfg.model_type,
        "layout": store.layout,
        "num_layers": len(family.layer_schedule(cfg)),
        "layer_schedule": family.layer_schedule(cfg),
        "params_by_role": dict(params_by_role),
        "params_total": sum(params_by_role.values()),
        "tensor_count": len(store.infos) + len(store.unread) if (store.infos or store.unread) else len(specs),
        "tensor_count_source": "checkpoint" if (store.infos or store.unread) else "contract",
        "weight_formats": dict(formats) if formats else ({"quantization_config": qc} if qc else {}),
        "kv_dtype_bytes": kv_dtype_bytes,
        "max_context": ctx,
        "state_bytes_per_token": per_token,
        "state_bytes_per_sequence": per_token * ctx + fixed,
        "state_bytes_fixed_per_sequence": fixed,
        "random_weights_demo": is_demo(store.config),
    }
    info.update(family.facts(cfg) if hasattr(family, "facts") else {})
    schedule = PrecisionSchedule.parse(precision)
    schedule.check_roles(specs)
    info["precision"] = schedule.describe(specs)
    if store.infos and not store.unread:
        try:
            plan = plan_load(specs, store, family.namings(cfg, store.layout, store.names()))
            info["contract"] = "ok"
            info["quantized_formats"] = dict(Counter(plan.quantized.values()))
        except CheckpointError as e:
            info["contract"] = str(e)
    else:
        info["contract"] = "not checked (tensor files absent)"
    if tensor_parallel_size > 1:
        info["tensor_parallel"] = _per_rank(
            store, family, cfg, kv_dtype_bytes, tensor_parallel_size, expert_parallel
        )
    return info


def _per_rank(store, family, cfg, kv_dtype_bytes: int, world: int, expert_parallel: bool) -> dict:
    specs = parallel.sharded_specs(family, cfg, expert_parallel)
    out = {
        "expert_parallel": expert_parallel,
        **parallel.rank_bytes(family, cfg, specs, world, kv_dtype_bytes),
    }
    if store.infos and not store.unread:
        plan = plan_load(specs, store, family.namings(cfg, store.layout, store.names()))
        out["weight_bytes_per_rank"] = [shard_bytes(plan, store, r, world) for r in range(world)]
    return out


def format_text(info: dict) -> str:
    lines = [f"{info['path']}: {info['family']} ({info['model_type']}, {info['layout']} layout)"]
    if info.get("random_weights_demo"):
        lines.append("  built-in demo model: RANDOM weights, its output is noise")
    sched = info["layer_schedule"]
    runs, prev, count = [], None, 0
    for k in sched + [None]:
        if k == prev:
            count += 1
            continue
        if prev is not None:
            runs.append(f"{count}x {prev}")
        prev, count = k, 1
    lines.append(f"  layers: {info['num_layers']}  ({', '.join(runs)})")
    lines.append(
        f"  parameters: {info['params_total']:,}  "
        + ", ".join(f"{r} {n:,}" for r, n in sorted(info["params_by_role"].items()))
    )
    lines.append(
        f"  tensors: {info['tensor_count']} ({info['tensor_count_source']})  formats: {info['weight_formats']}"
    )
    lines.append(
        f"  state: {info['state_bytes_per_token']:,} B/token + {info['state_bytes_fixed_per_sequence']:,} B/sequence; "
        f"{info['state_bytes_per_sequence']:,} B at the full context of {info['max_context']:,}"
    )
    for k, v in info.items():
        if k not in {
            "path",
            "family",
            "model_type",
            "layout",
            "num_layers",
            "layer_schedule",
            "params_by_role",
            "params_total",
            "tensor_count",
            "tensor_count_source",
            "weight_formats",
            "kv_dtype_bytes",
            "max_context",
            "state_bytes_per_token",
            "state_bytes_per_sequence",
            "state_bytes_fixed_per_sequence",
            "random_weights_demo",
            "contract",
            "precision",
            "tensor_parallel",
        }:
            lines.append(f"  {k}: {v}")
    if any(v != "inherit" for v in info["precision"].values()):
        lines.append(f"  precision: {info['precision']}")
    lines.append(f"  contract: {info['contract']}")
    tp = info.get("tensor_parallel")
    if tp:
        n = tp["tensor_parallel_size"]
        split = "experts by expert" if tp["expert_parallel"] else "experts by width"
        read = tp.get("weight_bytes_per_rank")
        lines.append(
            f"  per rank of {n} ({split}): {tp['params_per_rank']:,} parameters "
            f"({tp['params_sharded_per_rank']:,} split, {tp['params_replicated']:,} replicated)"
            + (f"; weights read {', '.join(f'{b:,}' for b in read)} B" if read else "")
            + f"; state {tp['state_bytes_per_token_per_rank']:,} B/token + "
            f"{tp['state_bytes_fixed_per_sequence_per_rank']:,} B/sequence"
        )
    return "\n".join(lines)
