"""`moesaic inspect`: what a checkpoint is and what it will cost, from its config (and headers when present)."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

from . import parallel
from .config import is_demo
from .errors import CheckpointError
from .models import num_layers, read_config
from .weights.contract import check_scale, plan_load, quantization_config, shard_bytes
from .weights.dtypes import NAMES
from .weights.experts import parse_size, plan_bytes
from .weights.precision import PrecisionSchedule
from .weights.store import WeightStore


def inspect_checkpoint(
    path: str | Path,
    kv_dtype_bytes: int = 2,
    precision: str | None = None,
    expert_cache=None,
    tensor_parallel_size: int = 1,
    expert_parallel: bool = False,
    dtype: str = "bfloat16",
) -> dict:
    """expert_cache (a size, as LLM takes it): also plan expert streaming (`expert_streaming`).
    tensor_parallel_size > 1 adds `tensor_parallel`: what each rank holds (parameters, state, and with
    the tensor files present the bytes each rank reads), checked as a load would check it.
    dtype: the model dtype the weights would load in (`precision_bytes`)."""
    store = WeightStore(path, require_files=False)
    family, raw, cfg = read_config(store)
    # the tensors count only when their headers were read (an index alone may list a few, as a sketch)
    check_scale(num_layers(family, cfg), len(store.infos) if not store.unread else 0)
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
    schedule.check(specs)
    info["precision"] = schedule.describe(specs)
    plan = None
    if store.infos and not store.unread:
        try:
            plan = plan_load(specs, store, family.namings(cfg, store.layout, store.names()))
            info["contract"] = "ok"
            info["quantized_formats"] = dict(Counter(plan.quantized.values()))
        except CheckpointError as e:
            info["contract"] = str(e)
    else:
        info["contract"] = "not checked (tensor files absent)"
    # bytes each role holds once loaded under the schedule, in a `dtype` model (weights stored quantized
    # and kept packed, and integer / mapped tables, at their stored size when the headers were read)
    itemsize = NAMES[dtype].itemsize if dtype in NAMES else 2
    info["precision_bytes"] = schedule.loaded_bytes(specs, itemsize, _stored_bytes(plan, store))
    if expert_cache is not None:
        info["expert_streaming"] = _streaming_plan(expert_cache, plan, store, specs, info)
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


def _stored_bytes(plan, store):
    """spec -> the bytes the checkpoint stores it in, where the load keeps it as stored (quantized parts
    with their companions, integer and mapped tables), else None; None without a plan."""
    if plan is None:
        return None
    by_base: dict[str, int] = {}  # "layers.0.attn.wq" -> bytes of it and its companions
    for c in store.names():
        base = c.rsplit(".", 1)[0]
        by_base[base] = by_base.get(base, 0) + store.info(c).nbytes

    def stored(spec):
        src = plan.sources.get(spec.name)
        if src is None or not (spec.integer or spec.mapped or any(n in plan.quantized for n, _ in src.parts)):
            return None
        total = 0
        for n, _ in src.parts:
            if n not in plan.quantized:
                total += store.info(n).nbytes
                continue
            total += by_base.get(n.rsplit(".", 1)[0], 0)
        return total

    return stored


def _streaming_plan(expert_cache, plan, store, specs, info) -> dict:
    """What `LLM(..., expert_cache=...)` would hold: the trunk (everything but the routed experts), the
    experts left in the shards, the expert bytes one token reads cold (each MoE layer's top-k), and the
    planned resident total. Sizes as stored, from the headers; without them, bf16 from the config."""
    budget = parse_size(expert_cache)
    if plan is not None:
        units = plan_bytes(plan, store).values()
        source = "checkpoint headers"
        total = store.total_bytes
    else:  # no tensor files: 2 bytes a parameter
        units = {}
        for s in specs:
            if s.streamable:
                u = units.setdefault(s.name.rsplit(".", 1)[0], {"layer": s.layer, "experts": s.shape[0]})
                u["expert_bytes"] = u.get("expert_bytes", 0) + 2 * math.prod(s.shape[1:])
        units = units.values()
        source = "config (bf16 estimate: no tensor files)"
        total = 2 * info["params_total"]
    expert_bytes = sum(u["experts"] * u["expert_bytes"] for u in units)
    top_k = info.get("experts_per_token") or 0
    main = [u for u in units if u["layer"] is None or u["layer"] < info["num_layers"]]  # not MTP
    per_token = sum(top_k * u["expert_bytes"] for u in main)
    experts = sum(u["experts"] for u in units)
    each = max((u["expert_bytes"] for u in units), default=0)
    cache = int(budget * experts) * each if isinstance(budget, float) else min(budget, expert_bytes)
    return {
        "source": source,
        "trunk_bytes": total - expert_bytes,
        "expert_bytes": expert_bytes,
        "moe_layers": len(main),
        "expert_bytes_each": each,
        "per_token_expert_bytes": per_token,
        "cache_bytes": cache,
        "cache_experts": cache // each if each else 0,
        "planned_resident_bytes": total - expert_bytes + cache,
    }


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
            "precision_bytes",
            "expert_streaming",
        }:
            lines.append(f"  {k}: {v}")
    if any(v != "inherit" for v in info["precision"].values()):
        lines.append(f"  precision: {info['precision']}")
        b = info["precision_bytes"]
        lines.append(
            f"  weight bytes under it: {sum(b.values()):,} B ("
            + ", ".join(f"{r} {v:,}" for r, v in sorted(b.items()))
            + ")"
        )
    if "expert_streaming" in info:
        x = info["expert_streaming"]
        lines.append(
            f"  expert streaming ({x['source']}): trunk {x['trunk_bytes']:,} B, experts {x['expert_bytes']:,} B "
            f"({x['moe_layers']} MoE layers, {x['expert_bytes_each']:,} B an expert), "
            f"{x['per_token_expert_bytes']:,} B of experts per cold token; cache {x['cache_bytes']:,} B "
            f"({x['cache_experts']} experts); planned resident {x['planned_resident_bytes']:,} B"
        )
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
