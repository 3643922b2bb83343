"""The tensor contract as data, and the load plan that checks a checkpoint against it.

A family declares the tensors its model needs (`TensorSpec`: the model's own name, shape from the
config, role). A `Naming` says where each one lives in a checkpoint: one checkpoint tensor, or
several combined (per-expert tensors stacked into one, gate and up concatenated). `plan_load`
checks the whole checkpoint before anything is allocated and reports every missing, misshaped
and unexpected tensor in one CheckpointError.

Tensor parallelism: a spec's `shard` (a `Shard`) says how N ranks split it; `load_tensors(...,
rank, world)` then reads only this rank's piece of each checkpoint tensor (views of the file map,
narrowed before the one copy; a packed weight with its scales), and `shard_bytes` is what a rank
reads, checked before any process starts (a piece that does not divide, or that cuts a scale block
or group, is a ConfigError naming the tensor and N).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..errors import CheckpointError, ConfigError
from .dtypes import FLOAT_CODES, INTEGER_CODES, NAMES
from .precision import PrecisionSchedule
from .quant import (
    COMPANION_SUFFIXES,
    ConcatRows,
    QuantizedTensor,
    from_suffix_dict,
    load_quantized,
    quantize_fp8_block,
    resolve_format,
)
from .store import WeightStore


@dataclass(frozen=True)
class TensorSpec:
    """One tensor the model needs. Flags:
    keep_fp32   kept in fp32 whatever the model dtype (norm gains, routers where the reference does);
    dense       used other than through `linear` (views, einsums): dequantized at load if stored packed;
    integer     an integer table (e.g. hash routing), not a float weight;
    mapped      left in the file: handed over as stored (dtype included), a view of the file's map, never
                copied or converted (tables read a few rows at a time: V4.1's Engram);
    shard       how tensor parallelism splits it among ranks (a Shard; None: replicated on every rank);
    streamable  a routed expert stack, which expert streaming may leave on disk and read on demand."""

    name: str  # the model's own name (transformers' in-memory name)
    shape: tuple[int, ...]
    role: str  # embedding | attention | norm | router | expert | shared_expert | mlp | lm_head | ...
    layer: int | None = None
    optional: bool = False
    keep_fp32: bool = False
    dense: bool = False
    integer: bool = False
    mapped: bool = False
    shard: Shard | None = None
    streamable: bool = False


@dataclass(frozen=True)
class Shard:
    """How tensor parallelism splits a tensor among N ranks: along `axis`, each of the consecutive blocks
    `parts` (their sizes; () = the whole axis as one block) cut into N equal pieces, rank r keeping piece
    r of each, concatenated (fused gate|up rows, Mamba-2's z|x|B|C|dt). Blocks that sum to less than the
    axis leave the rest out (Kimi K3's A_log, stored wider than its heads). `uneven`: vocabulary rows,
    ceil(size / N) a rank and fewer on the last, so any vocabulary size splits."""

    axis: int
    parts: tuple[int, ...] = ()
    uneven: bool = False


def shape_matches(got, want) -> bool:
    """`want` may hold -1 for a size the config does not fix (e.g. Kimi K3's A_log, stored wider
    than its head count)."""
    return len(got) == len(want) and all(w == -1 or g == w for g, w in zip(got, want))


@dataclass
class Source:
    """Checkpoint tensors (name, expected shape; -1 = any size) and how they combine into the model's tensor."""

    parts: list[tuple[str, tuple[int, ...]]]
    combine: Callable[[list[torch.Tensor]], torch.Tensor] | None = None
    split: Callable[[torch.Tensor], list[torch.Tensor]] | None = None  # the inverse, for checkpoint writers


# Roles whose weights may stay packed when the checkpoint stores them quantized (they are only
# used through `linear`). Anything else, or a spec marked dense, is dequantized at load.
PACKABLE_ROLES = {"expert", "shared_expert", "mlp", "attention", "lm_head", "mamba", "kda", "engram"}


def direct(name: str, shape) -> Source:
    return Source([(name, tuple(shape))])


def stacked(names: list[str], shape) -> Source:
    """One checkpoint tensor per expert, stacked along a new leading dim."""
    return Source([(n, tuple(shape)) for n in names], _stack_any, lambda t: list(t.unbind(0)))


def stacked_pairs(first: list[str], second: list[str], shape) -> Source:
    """Per-expert (a, b) tensors concatenated along rows, then stacked: gate|up fusions."""
    parts = [p for a, b in zip(first, second) for p in ((a, tuple(shape)), (b, tuple(shape)))]
    return Source(parts, _stack_pairs, lambda t: [half for e in t.unbind(0) for half in e.chunk(2)])


def _stack_any(ts: list):
    if all(isinstance(t, torch.Tensor) for t in ts):
        return torch.stack(ts)
    return QuantizedTensor.stack(ts)


def _stack_pairs(ts: list):
    if all(isinstance(t, torch.Tensor) for t in ts):
        return torch.stack([torch.cat(ts[i : i + 2]) for i in range(0, len(ts), 2)])
    # quantized parts keep their own scales: stack each half, read them as one fused weight
    return ConcatRows([_stack_any(ts[0::2]), _stack_any(ts[1::2])])


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
    quantized: dict[str, str] = field(default_factory=dict)  # checkpoint part name -> quantized format
    quant_config: dict | None = None


def quantization_config(store: WeightStore) -> dict | None:
    """config.json's `quantization_config` (also in a nested text_config), or Mistral's `quantization`."""
    c = store.config
    return (
        c.get("quantization_config")
        or (c.get("text_config") or {}).get("quantization_config")
        or c.get("quantization")
    )


_FLOAT_DTYPES = FLOAT_CODES
_INTEGER_DTYPES = INTEGER_CODES + FLOAT_CODES  # tables saved as floats too


def _base(name: str) -> str:
    return name[: -len(".weight")] if name.endswith(".weight") else name


def _quant_format(store: WeightStore, name: str, qc, dtypes) -> str | None:
    """The quantized format of checkpoint weight `name`, or None when it is stored dense."""
    base = _base(name)
    has_companion = any(f"{base}.{s}" in store for s in COMPANION_SUFFIXES)
    packed_weight = name in store and store.info(name).dtype in ("U8", "I8", "F8_E4M3")
    if not (has_companion or packed_weight):
        return None
    return resolve_format(qc, dtypes, base)


def plan_load(specs: list[TensorSpec], store: WeightStore, naming: Naming) -> LoadPlan:
    problems: list[str] = []
    sources: dict[str, Source] = {}
    used: set[str] = set()
    skipped: list[str] = []
    quantized: dict[str, str] = {}
    qc = quantization_config(store)
    dtypes = {n: (i.dtype, i.shape) for n, i in store.infos.items()}
    for spec in specs:
        src = naming.source(spec)
        formats = {}
        if spec.mapped and len(src.parts) != 1:
            problems.append(
                f"{spec.name}: a mapped tensor must come from one checkpoint tensor, not {len(src.parts)}"
            )
            continue
        for n, _ in [] if spec.mapped else src.parts:  # a mapped tensor is taken as stored
            try:
                fmt = _quant_format(store, n, qc, dtypes)
            except CheckpointError as e:
                problems.append(f"bad quantized weight: {e}")
                fmt = "bad"
            if fmt:
                formats[n] = fmt
        absent = [n for n, _ in src.parts if n not in store and n not in formats]
        if absent:
            if spec.optional and len(absent) == len(src.parts):
                skipped.append(spec.name)
                continue
            shown = ", ".join(absent[:3]) + (f" (+{len(absent) - 3} more)" if len(absent) > 3 else "")
            problems.append(f"missing: {shown} (for {spec.name}, shape {list(spec.shape)})")
            continue
        for n, shape in src.parts:
            fmt = formats.get(n)
            if fmt is None:
                info = store.info(n)
                if not shape_matches(info.shape, shape):
                    problems.append(f"misshaped: {n} is {list(info.shape)}, expected {list(shape)}")
                kinds = _INTEGER_DTYPES if spec.integer else _FLOAT_DTYPES
                if info.dtype not in kinds and not spec.mapped:  # a mapped tensor is taken as stored
                    problems.append(f"wrong dtype: {n} is {info.dtype}, expected one of {', '.join(kinds)}")
                used.add(n)
            elif fmt != "bad":
                base = _base(n)
                try:  # builds views only: checks companions, dtypes and the logical shape
                    load_quantized(
                        base, lambda k: store.get(k, count=False), fmt, qc, names=store, shape=shape
                    )
                except CheckpointError as e:
                    problems.append(f"bad quantized weight: {e}")
                used.update(f"{base}.{s}" for s in ("weight",) + COMPANION_SUFFIXES if f"{base}.{s}" in store)
                quantized[n] = fmt
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
    return LoadPlan(sources, {s.name: s for s in specs}, skipped, quantized, qc)


def load_tensors(
    plan: LoadPlan,
    store: WeightStore,
    dtype: torch.dtype,
    device,
    schedule: PrecisionSchedule | None = None,
    rank: int = 0,
    world: int = 1,
) -> dict:
    """Reads each planned checkpoint tensor once and converts it as the spec and the precision
    schedule say. Quantized weights of packable roles stay packed (codes and scales copied out of
    the mmap, never dequantized as a whole); the rest become dense tensors. With world > 1, a spec
    with a `shard` gives rank `rank`'s piece only, and only that piece is read."""
    schedule = schedule or PrecisionSchedule()
    schedule.check_roles(plan.specs.values())
    if world > 1:
        store.advise_random()
    out = {}
    for name, src in plan.sources.items():
        spec = plan.specs[name]
        if spec.mapped:
            out[name] = store.get(src.parts[0][0], count=False)  # a view of the file map: not read here
            continue
        want = schedule.dtype_for(spec.layer, spec.role)
        packable = (
            spec.role in PACKABLE_ROLES and not spec.dense and not spec.keep_fp32 and len(spec.shape) >= 2
        )
        if spec.keep_fp32:
            target = torch.float32
        elif isinstance(want, torch.dtype) or want in ("inherit", "fp8"):
            target = dtype if want in ("inherit", "fp8") else want
        else:
            target = _precision_dtype(want)
        # Parts that are combined (stacked experts) stay views of the file mapping until the
        # combine copies them once; a single part is copied here. Either way one copy per tensor.
        combined = src.combine is not None
        parts = []
        pieces, after = shard_parts(src, spec, rank, world)
        for n, shape, cut in pieces:
            fmt = plan.quantized.get(n)
            t = _read(store, n, shape, fmt, plan, cut)
            if fmt is None:
                parts.append(t if combined else t.to(device=device, dtype=target, copy=True))
            elif packable and want in ("inherit", "fp8"):
                parts.append(t if combined else _own(t, device))
            else:  # small tensor or an explicit float precision: dense at load
                parts.append(t.dequantize(target).to(device))
        t = parts[0] if not combined else src.combine(parts)
        if after is not None:
            t = after(t)
        if combined:
            t = t.to(device=device, dtype=target) if isinstance(t, torch.Tensor) else t.to(device)
        if want == "fp8" and packable and isinstance(t, torch.Tensor):
            t = _to_fp8(t, name)
        out[name] = t
    return out


def _read(store: WeightStore, n: str, shape, fmt: str | None, plan: LoadPlan, cut):
    """Checkpoint tensor `n` as views of the file map (dense, or packed with its scales); `cut` (this
    rank's shard) narrows it first, and only what it keeps counts as read."""
    get = store.get if cut is None else (lambda k: store.get(k, count=False))
    t = (
        get(n)
        if fmt is None
        else load_quantized(_base(n), get, fmt, plan.quant_config, names=store, shape=shape)
    )
    if cut is not None:
        t = cut(t)
        store.count_read(n, _nbytes(t))
    return t


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else t.nbytes


# ---------------------------------------------------------------- tensor parallelism: this rank's piece


def shard_ranges(shard: Shard, size: int, rank: int, world: int, name: str) -> list[tuple[int, int]]:
    """Rank `rank`'s [start, stop) along the shard axis (of `size`), one range per block."""
    ranges, at = [], 0
    for b in shard.parts or (size,):
        if shard.uneven:
            n = -(-b // world)
            lo, hi = min(b, rank * n), min(b, (rank + 1) * n)
        elif b % world:
            raise ConfigError(
                f"{name}: {b} rows along axis {shard.axis} do not split into {world} equal parts "
                f"(tensor_parallel_size={world}); choose a size that divides it"
            )
        else:
            lo, hi = rank * (b // world), (rank + 1) * (b // world)
        ranges.append((at + lo, at + hi))
        at += b
    return ranges


def narrow(t, axis: int, ranges: list[tuple[int, int]], name: str):
    """The `ranges` of `t` along `axis`, concatenated: views of a dense tensor (one copy when there are
    several), or of a packed weight with its scales (several row ranges: read as one through ConcatRows)."""
    if isinstance(t, torch.Tensor):
        pieces = [t.narrow(axis, a, b - a) for a, b in ranges]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, axis)
    axis = axis % t.ndim
    if len(ranges) > 1 and axis != t.ndim - 2:
        raise ConfigError(f"{name}: a packed weight splits into several pieces along its rows only")
    pieces = [_narrow_packed(t, axis, a, b, name) for a, b in ranges]
    return pieces[0] if len(pieces) == 1 else ConcatRows(pieces)


def _narrow_packed(q: QuantizedTensor, axis: int, a: int, b: int, name: str) -> QuantizedTensor:
    """Rows / columns a:b (or experts, along a leading axis) of a packed weight, with the scales that
    cover them. A piece must keep whole scale blocks (fp8 blocks may be cut only where a piece starts on
    a block edge or stays inside one block; fp4 groups never)."""
    nd = q.ndim
    shape = list(q.shape)
    shape[axis] = b - a
    lead = q.shape[:-2]
    kw = {"shape": torch.Size(shape), "codes": q.codes, "scale": q.scale}
    if axis < nd - 2:  # experts: every per-matrix tensor narrows with the codes
        per = lambda t: t if t is None or t.numel() in (0, 1) else t.reshape(lead).narrow(axis, a, b - a)  # noqa: E731
        kw.update(
            codes=q.codes.narrow(axis, a, b - a),
            scale=q.scale.narrow(axis, a, b - a),
            global_scale=per(q.global_scale),
            input_scale=per(q.input_scale),
        )
        return q._replace(**kw)

    def bad(what: str):
        raise ConfigError(
            f"{name}: its {q.format} {what} a piece [{a}:{b}] of a tensor parallel split would cut "
            "(choose a tensor_parallel_size whose pieces keep whole scale blocks)"
        )

    rows = axis == nd - 2
    if q.format == "fp8_block":
        blk = q.block[0 if rows else 1]
        if a % blk and a // blk != (b - 1) // blk:
            bad(f"scale block of {blk}")
        s0, s1 = a // blk, -(-b // blk)
        kw["scale"] = q.scale.narrow(axis, s0, s1 - s0)
    elif q.format in ("mxfp4", "nvfp4"):
        if not rows:
            g = 32 if q.format == "mxfp4" else 16
            if a % g or (b - a) % g:
                bad(f"scale group of {g} inputs")
            kw["scale"] = q.scale.narrow(axis, a // g, (b - a) // g)
            kw["codes"] = q.codes.narrow(axis, a // 2, (b - a) // 2)
            return q._replace(**kw)
        kw["scale"] = q.scale.narrow(axis, a, b - a)
    kw["codes"] = q.codes.narrow(axis, a, b - a)
    return q._replace(**kw)


def shard_parts(src: Source, spec: TensorSpec, rank: int, world: int):
    """(the checkpoint parts this rank reads, each (name, shape, cut or None), and a cut of the combined
    tensor or None). Per-expert stacks keep the experts or the rows of each expert this rank owns (gate
    and up halves each cut as the shard's blocks say); other combinations are cut once combined."""
    sh = spec.shard
    whole = [(n, shape, None) for n, shape in src.parts]
    if sh is None or world == 1:
        return whole, None

    def cut(axis, ranges=None, shard=sh):
        def f(t):
            r = ranges if ranges is not None else shard_ranges(shard, t.shape[axis], rank, world, spec.name)
            return narrow(t, axis, r, spec.name)

        return f

    if src.combine is None:
        return [(n, shape, cut(sh.axis)) for n, shape in src.parts], None
    if src.combine is _stack_any or src.combine is _stack_pairs:
        per = 2 if src.combine is _stack_pairs else 1  # checkpoint parts per expert
        if sh.axis == 0:  # expert parallelism: whole experts
            E = len(src.parts) // per
            ((a, b),) = shard_ranges(Shard(0), E, rank, world, spec.name)
            return [(n, shape, None) for n, shape in src.parts[a * per : b * per]], None
        if per == 2 and sh.axis == 1:  # the fused gate|up rows: each half keeps its share of the ranges
            half = spec.shape[1] // 2
            ranges = shard_ranges(sh, spec.shape[1], rank, world, spec.name)
            halves = [
                [(max(a, lo) - lo, min(b, lo + half) - lo) for a, b in ranges if a < lo + half and b > lo]
                for lo in (0, half)
            ]
            return [(n, shape, cut(0, halves[i % 2])) for i, (n, shape) in enumerate(src.parts)], None
        part = Shard(sh.axis - 1, sh.parts, sh.uneven)  # an axis of each expert's own tensor
        return [(n, shape, cut(part.axis, shard=part)) for n, shape in src.parts], None
    return whole, cut(sh.axis)


def shard_bytes(plan: LoadPlan, store: WeightStore, rank: int, world: int) -> int:
    """The bytes rank `rank` of `world` reads from the checkpoint (its pieces of the sharded tensors and
    the replicated ones whole; mapped tables are not read at load). Builds views only: it is also the
    check, before any process starts, that every piece divides and keeps its scale blocks."""
    total = 0
    for name, src in plan.sources.items():
        spec = plan.specs[name]
        if spec.mapped:
            continue
        pieces, after = shard_parts(src, spec, rank, world)
        if after is not None:  # cut once combined: the whole parts are read
            shard_ranges(spec.shard, spec.shape[spec.shard.axis], rank, world, name)
            pieces = [(n, shape, None) for n, shape, _ in pieces]
        for n, shape, cut in pieces:
            fmt = plan.quantized.get(n)
            get = lambda k: store.get(k, count=False)  # noqa: E731
            if fmt is None:
                info = store.info(n)  # a meta tensor of its shape: the cut copies nothing
                t = torch.empty(info.shape, dtype=get(n).dtype, device="meta") if cut is not None else None
                total += info.nbytes if cut is None else _nbytes(cut(t))
                continue
            q = load_quantized(_base(n), get, fmt, plan.quant_config, names=store, shape=shape)
            total += _nbytes(q if cut is None else cut(q))
    return total


def _precision_dtype(want: str) -> torch.dtype:
    return NAMES[want]


def _own(q: QuantizedTensor, device) -> QuantizedTensor:
    """The packed codes and scales copied out of the file mapping (the checkpoint may go away)."""
    cp = lambda t: None if t is None else t.to(device=device, copy=True)  # noqa: E731
    return q._replace(
        codes=cp(q.codes), scale=cp(q.scale), global_scale=cp(q.global_scale), input_scale=cp(q.input_scale)
    )


_FP8_CONFIG = {"quant_method": "fp8", "weight_block_size": [128, 128]}


def _to_fp8(t: torch.Tensor, name: str) -> QuantizedTensor:
    """Runtime FP8 (E4M3, 128x128 block scales) of a dense weight; stacked experts one at a time."""
    if t.dim() == 2:
        return from_suffix_dict(
            quantize_fp8_block(t.float(), (128, 128)), _FP8_CONFIG, name=_base(name), format="fp8_block"
        )
    return QuantizedTensor.stack([_to_fp8(x, f"{name}[{i}]") for i, x in enumerate(t.unbind(0))], name=name)


def to_checkpoint(
    specs: list[TensorSpec], naming: Naming, tensors: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
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
