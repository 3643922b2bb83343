"""The tensor contract as data, and the load plan that checks a checkpoint against it.

A family declares the tensors its model needs (`TensorSpec`: the model's own name, shape from the
config, role). A `Naming` says where each one lives in a checkpoint: one checkpoint tensor, or
several combined (per-expert tensors stacked into one, gate and up concatenated). `plan_load`
checks the whole checkpoint before anything is allocated and reports every missing, misshaped
and unexpected tensor in one CheckpointError.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..errors import CheckpointError
from .store import WeightStore


@dataclass(frozen=True)
class TensorSpec:
    name: str  # the model's own name (transformers' in-memory name)
    shape: tuple[int, ...]
    role: str  # embedding | attention | norm | router | expert | shared_expert | mlp | lm_head | ...
    layer: int | None = None
    optional: bool = False
    keep_fp32: bool = False  # kept in fp32 whatever the model dtype (norm gains, routers where the reference does)


@dataclass
class Source:
    """Checkpoint tensors (name, expected shape) and how they combine into the model's tensor."""

    parts: list[tuple[str, tuple[int, ...]]]
    combine: Callable[[list[torch.Tensor]], torch.Tensor] | None = None
    split: Callable[[torch.Tensor], list[torch.Tensor]] | None = None  # the inverse, for checkpoint writers


def direct(name: str, shape) -> Source:
    return Source([(name, tuple(shape))])


def stacked(names: list[str], shape) -> Source:
    """One checkpoint tensor per expert, stacked along a new leading dim."""
    return Source([(n, tuple(shape)) for n in names], lambda ts: torch.stack(ts), lambda t: list(t.unbind(0)))


def stacked_pairs(first: list[str], second: list[str], shape) -> Source:
    """Per-expert (a, b) tensors concatenated along rows, then stacked: gate|up fusions."""
    parts = [p for a, b in zip(first, second) for p in ((a, tuple(shape)), (b, tuple(shape)))]
    return Source(parts, lambda ts: torch.stack([torch.cat(ts[i : i + 2]) for i in range(0, len(ts), 2)]),
                  lambda t: [half for e in t.unbind(0) for half in e.chunk(2)])


@dataclass
class Naming:
    """One checkpoint naming scheme. `source(spec)` -> Source; `ignore` patterns are tensors the
    checkpoint may carry that this model does not use (e.g. vision towers)."""

    name: str
    source: Callable[[TensorSpec], Source]
    ignore: list[str] = field(default_factory=list)

    def ignores(self, ckpt_name: str) -> bool:
        return any(re.fullmatch(p, ckpt_name) for p in self.ignore)


@dataclass
class LoadPlan:
    sources: dict[str, Source]  # model tensor name -> where it comes from
    specs: dict[str, TensorSpec]
    skipped_optional: list[str]


def plan_load(specs: list[TensorSpec], store: WeightStore, naming: Naming) -> LoadPlan:
    problems: list[str] = []
    sources: dict[str, Source] = {}
    used: set[str] = set()
    skipped: list[str] = []
    for spec in specs:
        src = naming.source(spec)
        absent = [n for n, _ in src.parts if n not in store]
        if absent:
            if spec.optional and len(absent) == len(src.parts):
                skipped.append(spec.name)
                continue
            shown = ", ".join(absent[:3]) + (f" (+{len(absent) - 3} more)" if len(absent) > 3 else "")
            problems.append(f"missing: {shown} (for {spec.name}, shape {list(spec.shape)})")
            continue
        for n, shape in src.parts:
            got = store.info(n).shape
            if tuple(got) != tuple(shape):
                problems.append(f"misshaped: {n} is {list(got)}, expected {list(shape)}")
        used.update(n for n, _ in src.parts)
        sources[spec.name] = src
    unexpected = [n for n in store.names() if n not in used and not naming.ignores(n)]
    for n in unexpected[:20]:
        problems.append(f"unexpected: {n} {list(store.info(n).shape)}")
    if len(unexpected) > 20:
        problems.append(f"... and {len(unexpected) - 20} more unexpected tensors")
    if problems:
        raise CheckpointError(
            f"checkpoint {store.folder} does not match the {naming.name} naming of this model "
            f"({len(problems)} problem(s)):\n  " + "\n  ".join(problems)
        )
    return LoadPlan(sources, {s.name: s for s in specs}, skipped)


def load_tensors(plan: LoadPlan, store: WeightStore, dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
    """Reads each planned checkpoint tensor once and converts it to the model's dtype/device."""
    out = {}
    for name, src in plan.sources.items():
        spec = plan.specs[name]
        target = torch.float32 if spec.keep_fp32 else dtype
        parts = [store.get(n) for n, _ in src.parts]
        if src.combine is None:
            t = parts[0].to(device=device, dtype=target, copy=True)
        else:
            t = src.combine([p.to(device=device, dtype=target) for p in parts])
        out[name] = t
    return out


def to_checkpoint(specs: list[TensorSpec], naming: Naming, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's tensors renamed (and split) the way `naming` stores them: what a checkpoint writer saves."""
    out = {}
    for spec in specs:
        if spec.name not in tensors:
            continue
        src = naming.source(spec)
        pieces = [tensors[spec.name]] if src.split is None else src.split(tensors[spec.name])
        for (n, _), t in zip(src.parts, pieces, strict=True):
            out[n] = t.contiguous()
    return out
