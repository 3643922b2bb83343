"""`moesaic inspect`: what a checkpoint is and what it will cost, from its config (and headers when present)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from .config import is_demo
from .errors import CheckpointError
from .models import num_layers, read_config
from .weights.contract import check_scale, plan_load, quantization_config
from .weights.precision import PrecisionSchedule
from .weights.store import WeightStore


def inspect_checkpoint(path: str | Path, kv_dtype_bytes: int = 2, precision: str | None = None) -> dict:
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
    if store.infos and not store.unread:
        try:
            plan = plan_load(specs, store, family.namings(cfg, store.layout, store.names()))
            info["contract"] = "ok"
            info["quantized_formats"] = dict(Counter(plan.quantized.values()))
        except CheckpointError as e:
            info["contract"] = str(e)
    else:
        info["contract"] = "not checked (tensor files absent)"
    return info


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
        }:
            lines.append(f"  {k}: {v}")
    if any(v != "inherit" for v in info["precision"].values()):
        lines.append(f"  precision: {info['precision']}")
    lines.append(f"  contract: {info['contract']}")
    return "\n".join(lines)
