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

from ..config import MAX_LAYERS
from ..errors import CheckpointError, ConfigError
from ..kernels import memory
from .dtypes import FLOAT_CODES, INTEGER_CODES, NAMES
from .precision import MAX_SHOWN, PACKED, PrecisionSchedule, packable
from .quant import (
    COMPANION_SUFFIXES,
    ConcatRows,
    QuantizedTensor,
    check_config,
    from_suffix_dict,
    load_quantized,
    quantize_fp8_block,
    quantize_mxfp4,
    quantize_nvfp4,
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


# Which weights may stay packed when the checkpoint stores them quantized (those used only through
# `linear`) is precision.py's `packable`: anything else, or a spec marked dense, is dequantized at load.


def direct(name: str, shape) -> Source:
    return Source([(name, tuple(shape))])


def stacked(names: list[str], shape) -> Source:
    """One checkpoint tensor per expert, stacked along a new leading dim."""
    return Source([(n, tuple(shape)) for n in names], _stack_any, lambda t: list(t.unbind(0)))


def stacked_pairs(first: list[str], second: list[str], shape) -> Source:
    """Per-expert (a, b) tensors concatenated along rows, then stacked: gate|up fusions."""
    parts = [p for a, b in zip(first, second) for p in ((a, tuple(shape)), (b, tuple(shape)))]
    return Source(parts, _stack_pairs, lambda t: [half for e in t.unbind(0) for half in e.chunk(2)])


def _stack_any(ts: list, dtype: torch.dtype | None = None, device=None):
    """The experts' tensors as one stack, copied once out of the file mapping into huge-page memory (in
    `dtype`, on `device`; packed ones keep their format)."""
    if all(isinstance(t, torch.Tensor) for t in ts):
        return memory.stack(ts, dtype, device)
    stacked = QuantizedTensor.stack(ts)
    return stacked if device is None else stacked.to(device)


def _stack_pairs(ts: list, dtype: torch.dtype | None = None, device=None):
    """Each expert's (a, b) concatenated along rows, stacked (as `_stack_any`)."""
    if all(isinstance(t, torch.Tensor) for t in ts):
        return memory.stack([ts[i : i + 2] for i in range(0, len(ts), 2)], dtype, device)
    # quantized parts keep their own scales: stack each half, read them as one fused weight
    return ConcatRows([_stack_any(ts[0::2], dtype, device), _stack_any(ts[1::2], dtype, device)])


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
    """config.json's `quantization_config` (also in a nested text_config), or Mistral's `quantization`,
    its containers checked (a ConfigError naming the field, not a TypeError deep in a format reader)."""
    c = store.config
    text = c.get("text_config")
    found = [
        (where, v)
        for where, v in (
            ("quantization_config", c.get("quantization_config")),
            (
                "text_config.quantization_config",
                text.get("quantization_config") if isinstance(text, dict) else None,
            ),
            ("quantization", c.get("quantization")),
        )
        if v is not None
    ]
    if not found:
        return None
    where, qc = found[0]
    check_config(qc, f"config: field {where!r}")
    return qc or None


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
    try:
        return resolve_format(qc, dtypes, base)
    except (
        TypeError,
        ValueError,
        AttributeError,
        KeyError,
    ) as e:  # a value of a type the reader did not expect
        raise ConfigError(f"{base}: quantization_config cannot be read ({type(e).__name__}: {e})") from e


def check_scale(num_layers: int, tensor_count: int) -> None:
    """Refuses a config whose size cannot belong to the checkpoint before its contract is built: each
    decoder layer needs at least one tensor, so more layers than the checkpoint has tensors is a config
    of another model (and building a contract of 10**6 layers would take minutes and gigabytes). With no
    tensor listed at all (`inspect` on a bare config), a layer count no model comes near is refused."""
    if tensor_count and num_layers > tensor_count:
        raise CheckpointError(
            f"config.json describes {num_layers} layers but the checkpoint holds only {tensor_count} "
            "tensors (every layer needs several): the config does not belong to these weights"
        )
    if not tensor_count and num_layers > MAX_LAYERS:
        raise ConfigError(
            f"config.json describes {num_layers} layers, more than the {MAX_LAYERS} any model comes near"
        )


class _Problems:
    """The problems of one plan by kind, each kind's list capped at MAX_SHOWN (the count stays exact)."""

    def __init__(self):
        self.shown: dict[str, list[str]] = {}
        self.hidden: dict[str, int] = {}
        self.count = 0

    def add(self, kind: str, text: str) -> None:
        self.count += 1
        shown = self.shown.setdefault(kind, [])
        if len(shown) < MAX_SHOWN:
            shown.append(text)
        else:
            self.hidden[kind] = self.hidden.get(kind, 0) + 1

    def lines(self) -> list[str]:
        out = []
        for kind, shown in self.shown.items():
            out += shown
            if self.hidden.get(kind):
                out.append(f"... and {self.hidden[kind]} more {kind}")
        return out


def plan_load(specs: list[TensorSpec], store: WeightStore, naming: Naming) -> LoadPlan:
    store.require_weights()
    problems = _Problems()
    sources: dict[str, Source] = {}
    used: set[str] = set()
    skipped: list[str] = []
    quantized: dict[str, str] = {}
    qc = quantization_config(store)
    dtypes = {n: (i.dtype, i.shape) for n, i in store.infos.items()}
    needed: set[str] = (
        set()
    )  # checkpoint tensors the contract needs; more than the store holds = wrong config
    for spec in specs:
        src = naming.source(spec)
        if not spec.optional:
            needed.update(n for n, _ in src.parts)
            if len(needed) > 2 * len(store.infos) + 16:
                raise CheckpointError(
                    f"checkpoint {store.folder} holds {len(store.infos)} tensors, but the config asks for "
                    f"more than {len(needed)} (at {spec.name}): config.json does not belong to these weights"
                )
        formats = {}
        if spec.mapped and len(src.parts) != 1:
            problems.add(
                "problems",
                f"{spec.name}: a mapped tensor must come from one checkpoint tensor, not {len(src.parts)}",
            )
            continue
        for n, _ in [] if spec.mapped else src.parts:  # a mapped tensor is taken as stored
            try:
                fmt = _quant_format(store, n, qc, dtypes)
            except CheckpointError as e:
                problems.add("bad quantized weights", f"bad quantized weight: {e}")
                fmt = "bad"
            if fmt:
                formats[n] = fmt
        absent = [n for n, _ in src.parts if n not in store and n not in formats]
        if absent:
            if spec.optional and len(absent) == len(src.parts):
                skipped.append(spec.name)
                continue
            shown = ", ".join(absent[:3]) + (f" (+{len(absent) - 3} more)" if len(absent) > 3 else "")
            problems.add("missing", f"missing: {shown} (for {spec.name}, shape {list(spec.shape)})")
            continue
        for n, shape in src.parts:
            fmt = formats.get(n)
            if fmt is None:
                info = store.info(n)
                if not shape_matches(info.shape, shape):
                    problems.add("misshaped", f"misshaped: {n} is {list(info.shape)}, expected {list(shape)}")
                kinds = _INTEGER_DTYPES if spec.integer else _FLOAT_DTYPES
                if info.dtype not in kinds and not spec.mapped:  # a mapped tensor is taken as stored
                    problems.add(
                        "wrong dtypes",
                        f"wrong dtype: {n} is {info.dtype}, expected one of {', '.join(kinds)}",
                    )
                used.add(n)
            elif fmt != "bad":
                base = _base(n)
                try:  # builds views only: checks companions, dtypes and the logical shape
                    load_quantized(
                        base, lambda k: store.get(k, count=False), fmt, qc, names=store, shape=shape
                    )
                except CheckpointError as e:
                    problems.add("bad quantized weights", f"bad quantized weight: {e}")
                except (TypeError, ValueError, AttributeError, KeyError) as e:
                    raise ConfigError(
                        f"{base}: quantization_config cannot be read ({type(e).__name__}: {e})"
                    ) from e
                used.update(f"{base}.{s}" for s in ("weight",) + COMPANION_SUFFIXES if f"{base}.{s}" in store)
                quantized[n] = fmt
        sources[spec.name] = src
    for n in store.names():
        if n not in used and not naming.ignores(n):
            problems.add("unexpected tensors", f"unexpected: {n} {list(store.info(n).shape)}")
    if problems.count:
        raise CheckpointError(
            f"checkpoint {store.folder} does not match the {naming.name} naming of this model "
            f"({problems.count} problem(s)):\n  " + "\n  ".join(problems.lines())
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
    experts=None,
) -> dict:
    """Reads each planned checkpoint tensor once and converts it as the spec and the precision
    schedule say. Quantized weights of packable roles stay packed (codes and scales copied out of
    the mmap, never dequantized as a whole); the rest become dense tensors. With world > 1, a spec
    with a `shard` gives rank `rank`'s piece only, and only that piece is read. With `experts` (an
    ExpertCache, weights/experts.py) the streamable stacks and the 1-byte mapped tables stay in the
    shards: their places hold objects that read them on demand (one rank only: LLM refuses both)."""
    schedule = schedule or PrecisionSchedule()
    schedule.check(plan.specs.values())
    if world > 1:
        store.advise_random()
    out = {}
    for name, src in plan.sources.items():
        spec = plan.specs[name]
        if spec.mapped:
            info = store.info(src.parts[0][0])
            if experts is not None and info.dtype in ("F8_E4M3", "F8_E8M0", "U8", "I8"):
                out[name] = experts.add_rows(info)  # rows read through the expert cache's reader
            else:
                out[name] = store.get(src.parts[0][0], count=False)  # a view of the file map: not read here
            continue
        want = schedule.resolve(spec)  # "inherit" where the rule cannot apply (precision.py)
        linear_only = packable(spec)
        if spec.keep_fp32:
            target = torch.float32
        else:
            target = dtype if want == "inherit" or want in PACKED else NAMES[want]
        if experts is not None and spec.streamable:  # left in the shards, read on demand
            out[name] = experts.add_stack(spec, src, plan, store, target, want, linear_only, device)
            continue
        # Parts that are combined (stacked experts) stay views of the file mapping until the
        # combine copies them once; a single part is copied here. The copy kept lies in huge pages
        # where the system lends them (kernels/memory.py: a decode step streams every weight).
        combined = src.combine is not None
        parts = []
        pieces, after = shard_parts(src, spec, rank, world)
        for n, shape, cut in pieces:
            fmt = plan.quantized.get(n)
            t = _read(store, n, shape, fmt, plan, cut)
            if fmt is None:
                parts.append(t if combined else memory.copy_of(t, target, device))
            elif linear_only and (want == "inherit" or want in PACKED):
                parts.append(t if combined else _own(t, device))
            else:  # small tensor or an explicit float precision: dense at load
                parts.append(t.dequantize(target).to(device))
        stacks = src.combine in (_stack_any, _stack_pairs)  # copied once, into huge pages where they apply
        t = parts[0] if not combined else src.combine(parts, target, device) if stacks else src.combine(parts)
        if after is not None:
            t = after(t)
        if combined and not stacks:  # the new tensor into huge pages too (one more copy, where they apply)
            t = _resident(t.to(device=device, dtype=target) if isinstance(t, torch.Tensor) else t.to(device))
        if not spec.integer:
            check_finite(t, name, src)
        if want in PACKED and linear_only and isinstance(t, torch.Tensor):
            # its codes lie in huge pages already (the encoders' memory, QuantizedTensor.stack's)
            t = pack(t, name, want)
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


_CHUNK = 1 << 24  # elements located at a time: the bool mask of a chunk is 16 MB, not the tensor's size


def _first_bad(t: torch.Tensor, bad) -> list[int] | None:
    """The index of the first element of `t` for which `bad(chunk)` holds, or None (chunked)."""
    flat = t.reshape(-1)
    for start in range(0, flat.numel(), _CHUNK):
        mask = bad(flat[start : start + _CHUNK])
        if mask.any():
            i = start + int(mask.nonzero()[0, 0])
            return [int(x) for x in torch.unravel_index(torch.tensor(i), t.shape)] if t.dim() else []
    return None


# The tests are reductions (one fast pass; an elementwise mask is several times slower than the load's own
# copy) and only a tensor that fails one is searched for the element to name. A sum is finite unless an
# element is NaN or Inf (or the sum overflows, which only makes the search run).
def _floats_ok(x: torch.Tensor) -> bool:
    return bool(torch.isfinite(x.sum()))


def _e4m3_ok(x: torch.Tensor) -> bool:  # E4M3 "fn" NaN is 0x7F / 0xFF: int8 127 / uint8 255
    b = x.view(torch.uint8)
    return x.numel() == 0 or (int(b.amax()) != 0xFF and int(b.view(torch.int8).amax()) != 0x7F)


def _e8m0_ok(x: torch.Tensor) -> bool:  # 0xFF is NaN in E8M0
    return x.numel() == 0 or int(x.view(torch.uint8).amax()) != 0xFF


def _e4m3_nan(c: torch.Tensor) -> torch.Tensor:
    return (c.view(torch.uint8) & 0x7F) == 0x7F


def check_finite(t, name: str, src: Source | None = None) -> None:
    """A CheckpointError naming the tensor (and the element) when a loaded weight holds NaN or Inf
    (also a finite value the model dtype cannot hold, e.g. 1e5 in fp16), or a quantized weight has a
    scale that makes it so: a NaN or Inf scale, an E8M0 0xFF byte (NaN by the OCP MX spec), an NVFP4
    global scale of 0 or NaN, or an FP8 code that is NaN."""
    single = src is not None and len(src.parts) == 1 and src.parts[0][0] != name
    where = f"{name} ({src.parts[0][0]})" if single else name
    if isinstance(t, ConcatRows):
        for part in t.parts:
            check_finite(part, name, src)
        return
    if isinstance(t, torch.Tensor):
        if t.is_floating_point() and not _floats_ok(t):
            at = _first_bad(t, lambda c: ~torch.isfinite(c))
            if at is not None:
                raise CheckpointError(
                    f"weight {where} holds {t[tuple(at)].item()} at {at} (in "
                    f"{str(t.dtype).replace('torch.', '')}): the checkpoint is corrupt, or its values "
                    "overflow this dtype (load it in another)"
                )
        return
    q = t
    names = getattr(q, "tensor_names", {})
    checks = []  # (part, tensor, fast test, elementwise test, what a bad element is)
    if q.codes.dtype == torch.float8_e4m3fn:  # fp4 codes have no NaN
        checks.append(("codes", q.codes, _e4m3_ok, _e4m3_nan, "a NaN FP8 code"))
    if q.scale_kind == "e8m0":
        checks.append(
            ("scale", q.scale, _e8m0_ok, lambda c: c.view(torch.uint8) == 0xFF, "an E8M0 0xFF (NaN)")
        )
    elif q.scale_kind == "e4m3":
        checks.append(("scale", q.scale, _e4m3_ok, _e4m3_nan, "a NaN E4M3 scale"))
    else:
        checks.append(("scale", q.scale, _floats_ok, lambda c: ~torch.isfinite(c), "a NaN or Inf scale"))
    if q.global_scale is not None:
        zero_or_nan = lambda c: ~torch.isfinite(c) | (c == 0)  # noqa: E731
        checks.append(
            ("global_scale", q.global_scale, lambda c: not zero_or_nan(c).any(), zero_or_nan, "0, NaN or Inf")
        )
    for part, x, ok, bad, what in checks:
        if not ok(x) and (at := _first_bad(x, bad)) is not None:
            which = f"[{', '.join(map(str, at))}]" if at else ""
            raise CheckpointError(
                f"quantized weight {where}: {names.get(part, f'{q.name} ({part})')}{which} is {what}: "
                "the checkpoint is corrupt"
            )


def _own(q: QuantizedTensor, device) -> QuantizedTensor:
    """The packed codes and scales copied out of the file mapping (the checkpoint may go away); big codes
    into huge pages (kernels/memory.py)."""
    cp = lambda t: None if t is None else memory.copy_of(t, device=device)  # noqa: E731
    return q._replace(
        codes=cp(q.codes), scale=cp(q.scale), global_scale=cp(q.global_scale), input_scale=cp(q.input_scale)
    )


def _resident(t):
    """A weight stacked or packed at load (new memory) moved into huge pages where they apply
    (kernels/memory.py): a dense tensor, or a packed one's codes."""
    if isinstance(t, torch.Tensor):
        return memory.resident(t)
    if isinstance(t, QuantizedTensor):
        return t._replace(codes=memory.resident(t.codes))
    if isinstance(t, ConcatRows):
        return ConcatRows([_resident(p) for p in t.parts])
    return t


_FP8_CONFIG = {"quant_method": "fp8", "weight_block_size": [128, 128]}
_CT_CONFIG = {"quant_method": "compressed-tensors"}


def pack(t: torch.Tensor, name: str, fmt: str) -> QuantizedTensor:
    """A dense weight [N, K] (or a stack [E, N, K]) packed at load: fp8 (E4M3, 128x128 block scales), mxfp4 or
    nvfp4 (compressed-tensors' encodings: weights/quant.py). The encoders put the codes in huge pages where they
    apply. A stack whose scale blocks lie within each matrix (mxfp4's rows of 32; fp8 where 128 | N) is encoded
    as one [E N, K] matrix, the same bytes as matrix by matrix without a call and a restack per expert. NVFP4's
    global scale is each matrix's own: its stacks are encoded matrix by matrix into the stack's memory (no
    restack)."""
    if t.dim() == 3 and (fmt == "mxfp4" or fmt == "fp8" and t.shape[1] % 128 == 0):
        E, N, K = t.shape
        flat = _encode(t.reshape(E * N, K), fmt)
        return _packed({k: v.view(E, v.shape[0] // E, *v.shape[1:]) for k, v in flat.items()}, name, fmt)
    if t.dim() == 3 and fmt == "nvfp4" and t.shape[2] % 16 == 0:
        E, N, K = t.shape
        codes = memory.empty((E, N, K // 2), torch.uint8, t.device)
        scales = torch.empty(E, N, K // 16, dtype=torch.float8_e4m3fn, device=t.device)
        gs = [quantize_nvfp4(m, out=(codes[e], scales[e]))["weight_global_scale"] for e, m in enumerate(t)]
        tensors = {"weight_packed": codes, "weight_scale": scales, "weight_global_scale": torch.stack(gs)}
        return _packed(tensors, name, fmt)
    if t.dim() > 2:
        return QuantizedTensor.stack(
            [pack(x, f"{name}[{i}]", fmt) for i, x in enumerate(t.unbind(0))], name=name
        )
    return _packed(_encode(t, fmt), name, fmt)


def _encode(t: torch.Tensor, fmt: str) -> dict:
    """The encoder's tensors for matrix t, taken as it is (a few rows at a time in fp32, or a compiled pass)."""
    if fmt == "fp8":
        return quantize_fp8_block(t, (128, 128))
    return (quantize_mxfp4 if fmt == "mxfp4" else quantize_nvfp4)(t)


def _packed(tensors: dict, name: str, fmt: str) -> QuantizedTensor:
    if fmt == "fp8":
        return from_suffix_dict(tensors, _FP8_CONFIG, name=_base(name), format="fp8_block")
    return from_suffix_dict(tensors, _CT_CONFIG, name=_base(name), format=fmt)


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
