"""The precision schedule: a per-(layer, role) weight dtype applied at load (the seed's
`precision_schedule`). Written as text, e.g. on the command line:

    "router=bf16,lm_head=bf16,expert=fp8,attention@0-2=fp32,*=inherit"

Each rule is `role[@layers]=dtype`. role is a TensorSpec role (expert, shared_expert, attention,
mlp, router, lm_head, embedding, norm, ...) or `*`; layers a comma-free list like `0-2` or `5`
(separated by `+`, e.g. `0-2+7`). dtype is one of:
  inherit  the checkpoint's format: quantized weights stay packed, dense ones take the model dtype
  fp32 | bf16 | fp16   dense in that dtype (quantized weights are dequantized to it at load)
  fp8      quantized at load to FP8 E4M3 with 128x128 block scales (kept packed)
  mxfp4    quantized at load to MXFP4: E2M1 codes, one E8M0 scale per 32 inputs (kept packed)
  nvfp4    quantized at load to NVFP4: E2M1 codes, one E4M3 scale per 16 inputs and an fp32 scale
           per matrix (kept packed)
Resolution: a rule naming the layer beats one naming only the role, which beats `*`.

The packed formats (fp8, mxfp4, nvfp4) pack a dense checkpoint weight tensor by tensor as it is
loaded (stacked experts matrix by matrix), never the whole model dense at once; a weight the
checkpoint already stores quantized stays in its own format. They apply only to the matrices used
through `linear` (projections, experts, lm_head: `packable`), never to norms, routers or embeddings.
A matrix whose input width K is not a multiple of the format's group (32 for mxfp4, 16 for nvfp4)
stays dense in the model dtype (`inspect --precision` shows it: e.g. `attention: bf16/mxfp4`); a
rule that could pack none of the tensors it names is refused, naming them.

What a rule can change: a weight used only through `linear` (which casts the activations to the
weight's dtype and the result back), and a router's matrix (routing casts the same way). Every other
tensor meets the activations directly (norm gains, embeddings, matrices used as views in einsums),
so it keeps the model dtype, or fp32 where the reference keeps it: a rule gives such a tensor no other
dtype, and a rule that could change none of the tensors it names is refused, like one whose role or
layers name nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import ConfigError
from .dtypes import NAMES

PACKED = {"fp8": 1, "mxfp4": 32, "nvfp4": 16}  # formats packed at load -> the group K must be a multiple of
DTYPES = {
    "inherit": None,
    **NAMES,
    **{f: f for f in PACKED},
}  # a rule's dtype: a float name, or a packed format

# Roles whose matrices are used only through `linear` (so they may stay packed when the checkpoint
# stores them quantized, or take any dtype): unless a spec is marked dense (used as a view).
PACKABLE_ROLES = {"expert", "shared_expert", "mlp", "attention", "lm_head", "mamba", "kda", "engram"}

_ROLE = re.compile(r"\*|[A-Za-z_][A-Za-z0-9_]*")
_LAYERS = re.compile(r"([0-9]+)(?:-([0-9]+))?", re.ASCII)
MAX_SHOWN = 20  # rules, roles, ... named in one error


def packable(spec) -> bool:
    """Whether tensor `spec` is used only through `linear`: it may stay packed or be packed at load."""
    return (
        spec.role in PACKABLE_ROLES
        and not (spec.dense or spec.keep_fp32 or spec.integer or spec.mapped)
        and len(spec.shape) >= 2
    )


def takes(spec, dtype: str) -> bool:
    """Whether a rule's `dtype` applies to tensor `spec` (see the module docstring)."""
    if dtype == "inherit":
        return True
    if dtype in PACKED:
        return packable(spec) and spec.shape[-1] % PACKED[dtype] == 0
    router = spec.role == "router" and len(spec.shape) == 2 and not (spec.keep_fp32 or spec.integer)
    return packable(spec) or router


def packed_bytes(shape: tuple, fmt: str) -> int:
    """Bytes of a [.., N, K] weight packed at load in `fmt` (as QuantizedTensor.nbytes counts them):
    fp8 1 byte a value + one fp32 scale per 128x128 block; mxfp4 half a byte + one byte per 32 values;
    nvfp4 half a byte + one byte per 16 values + one fp32 scale per matrix."""
    *lead, n, k = shape
    mats = 1
    for d in lead:
        mats *= d
    if fmt == "fp8":
        return mats * (n * k + 4 * -(-n // 128) * -(-k // 128))
    if fmt == "mxfp4":
        return mats * (n * k // 2 + n * k // 32)
    return mats * (n * k // 2 + n * k // 16 + 4)


def _why_fixed(spec, dtype: str) -> str:
    """Why rule dtype `dtype` cannot apply to `spec` (for the error of a rule that changes nothing)."""
    if spec.keep_fp32:
        return "they stay fp32, as the reference keeps them"
    if spec.integer or spec.mapped:
        return "they are tables read as stored"
    if dtype in PACKED and spec.role == "router":
        return f"{dtype} packs only projection weights, not a router"
    if dtype in PACKED and packable(spec):
        return (
            f"{spec.name} has input width {spec.shape[-1]}, not a multiple of {dtype}'s group of "
            f"{PACKED[dtype]}, so it stays dense"
        )
    return (
        "they are used other than through a matrix product (norms, lookups, views), so they keep "
        "the model dtype"
    )


@dataclass(frozen=True)
class Rule:
    role: str
    layers: tuple[tuple[int, int], ...] | None  # inclusive ranges; None = every layer (and none)
    dtype: str
    text: str  # as written, for errors

    def matches(self, layer: int | None, role: str) -> bool:
        if self.role not in (role, "*"):
            return False
        if self.layers is None:
            return True
        return layer is not None and any(a <= layer <= b for a, b in self.layers)


def _shown(items: list) -> str:
    more = f" (+{len(items) - MAX_SHOWN} more)" if len(items) > MAX_SHOWN else ""
    return ", ".join(items[:MAX_SHOWN]) + more


def _ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2+5'."""
    out, start = [], None
    for i, v in enumerate(layers):
        start = v if start is None else start
        if i + 1 == len(layers) or layers[i + 1] != v + 1:
            out.append(str(v) if v == start else f"{start}-{v}")
            start = None
    return "+".join(out)


@dataclass(frozen=True)
class PrecisionSchedule:
    rules: tuple[Rule, ...] = ()

    @staticmethod
    def parse(text: str | None) -> PrecisionSchedule:
        if text is None:
            return PrecisionSchedule()
        if not isinstance(text, str):
            raise ConfigError(
                f"a precision schedule is text like 'router=bf16,expert=fp8', got {type(text).__name__}"
            )
        rules, seen = [], {}
        for item in text.split(","):
            item = item.strip()
            if not item:
                continue
            if "=" not in item:
                raise ConfigError(f"precision rule {item!r}: expected role[@layers]=dtype")
            lhs, dtype = (x.strip() for x in item.split("=", 1))
            if dtype not in DTYPES:
                raise ConfigError(
                    f"precision rule {item!r}: dtype {dtype!r} is not one of {', '.join(DTYPES)}"
                )
            role, at, layer_text = (x.strip() for x in lhs.partition("@"))
            if not role:
                raise ConfigError(f"precision rule {item!r}: the role is empty (e.g. expert, attention or *)")
            if not _ROLE.fullmatch(role):
                raise ConfigError(f"precision rule {item!r}: role {role!r} is not a role name or *")
            layers = None
            if at:
                layers = []
                for part in layer_text.split("+"):
                    m = _LAYERS.fullmatch(part.strip())
                    if m is None:
                        raise ConfigError(
                            f"precision rule {item!r}: layers {layer_text!r} are not like 0-2+7"
                        )
                    a, b = int(m[1]), int(m[2] or m[1])
                    if b < a:
                        raise ConfigError(
                            f"precision rule {item!r}: layer range {part.strip()!r} is empty "
                            f"(write the lower layer first: {b}-{a})"
                        )
                    layers.append((a, b))
                layers = tuple(sorted(set(layers)))
            key = (role, layers)
            if key in seen:
                raise ConfigError(
                    f"precision rules {seen[key]!r} and {item!r} name the same tensors: give one"
                )
            seen[key] = item
            rules.append(Rule(role, layers, dtype, item))
        return PrecisionSchedule(tuple(rules))

    def dtype_for(self, layer: int | None, role: str) -> str:
        """The dtype the most specific matching rule gives (layer, role); "inherit" if none does."""
        best, rank = "inherit", 0
        for r in self.rules:
            if not r.matches(layer, role):
                continue
            k = (2 if r.role == role else 1) + (2 if r.layers is not None else 0)
            if k > rank:
                best, rank = r.dtype, k
        return best

    def resolve(self, spec) -> str:
        """The dtype tensor `spec` is loaded in: its rule's, unless that rule cannot apply to it
        (then "inherit": the model dtype, or fp32 for a kept-fp32 tensor)."""
        want = self.dtype_for(spec.layer, spec.role)
        return want if takes(spec, want) else "inherit"

    def check(self, specs) -> None:
        """Refuses a rule that changes nothing: a role this model has no tensor of (a typo), layers that
        hold none of its tensors, or tensors whose dtype no rule can set."""
        specs = list(specs)
        roles = {s.role for s in specs}
        unknown = sorted({r.role for r in self.rules if r.role != "*" and r.role not in roles})
        if unknown:
            raise ConfigError(
                f"precision rule role(s) {_shown(unknown)} match no tensor of this model "
                f"(its roles: {', '.join(sorted(roles))})"
            )
        for r in self.rules:
            matched = [s for s in specs if r.matches(s.layer, s.role)]
            if not matched:
                have = sorted({s.layer for s in specs if s.layer is not None and r.role in (s.role, "*")})
                where = f"layers {_ranges(have)}" if have else "no numbered layer"
                what = (
                    "this model's tensors are in"
                    if r.role == "*"
                    else f"this model's {r.role} tensors are in"
                )
                raise ConfigError(f"precision rule {r.text!r} matches no tensor ({what} {where})")
            if not any(takes(s, r.dtype) for s in matched):
                why = sorted({_why_fixed(s, r.dtype) for s in matched})
                raise ConfigError(
                    f"precision rule {r.text!r} can change none of the {len(matched)} tensor(s) it names: "
                    + "; ".join(why)
                )

    def loaded_bytes(self, specs, dtype_bytes: int = 2, stored=None) -> dict[str, int]:
        """role -> bytes its tensors hold once loaded with this schedule in a model of `dtype_bytes`
        per element: a packed format's codes and scales (`packed_bytes`), a float rule's dtype, fp32 for
        kept-fp32 tensors, else the model dtype. `stored(spec)`: the bytes the checkpoint keeps a tensor
        in where the load keeps it as stored (quantized weights that stay packed, integer tables), or
        None; without it those count as dense."""
        out: dict[str, int] = {}
        for s in specs:
            want = self.resolve(s)
            n = 1
            for d in s.shape:
                n *= d
            kept = stored(s) if stored is not None and (want == "inherit" or want in PACKED) else None
            if kept is not None:
                b = kept
            elif want in PACKED:
                b = packed_bytes(tuple(s.shape), want)
            elif s.keep_fp32:
                b = 4 * n
            else:
                b = n * (NAMES[want].itemsize if want != "inherit" else dtype_bytes)
            out[s.role] = out.get(s.role, 0) + b
        return out

    def describe(self, specs) -> dict[str, str]:
        """role -> resolved dtype (or per-layer detail when layers differ), for `inspect`."""
        out: dict[str, set] = {}
        for s in specs:
            out.setdefault(s.role, set()).add(self.resolve(s))
        return {role: "/".join(sorted(v)) for role, v in sorted(out.items())}
