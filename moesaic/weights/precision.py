"""The precision schedule: a per-(layer, role) weight dtype applied at load (the seed's
`precision_schedule`). Written as text, e.g. on the command line:

    "router=bf16,lm_head=bf16,expert=fp8,attention@0-2=fp32,*=inherit"

Each rule is `role[@layers]=dtype`. role is a TensorSpec role (expert, shared_expert, attention,
mlp, router, lm_head, embedding, norm, ...) or `*`; layers a comma-free list like `0-2` or `5`
(separated by `+`, e.g. `0-2+7`). dtype is one of:
  inherit  the checkpoint's format: quantized weights stay packed, dense ones take the model dtype
  fp32 | bf16 | fp16   dense in that dtype (quantized weights are dequantized to it at load)
  fp8      quantized at load to FP8 E4M3 with 128x128 block scales (kept packed)
Resolution: a rule naming the layer beats one naming only the role, which beats `*`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from .dtypes import NAMES

DTYPES = {"inherit": None, **NAMES, "fp8": "fp8"}  # a rule's dtype: a float name, or a format kept packed


@dataclass(frozen=True)
class Rule:
    role: str
    layers: frozenset[int] | None
    dtype: str


@dataclass(frozen=True)
class PrecisionSchedule:
    rules: tuple[Rule, ...] = ()

    @staticmethod
    def parse(text: str | None) -> PrecisionSchedule:
        if not text:
            return PrecisionSchedule()
        rules = []
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
            role, _, layer_text = lhs.partition("@")
            layers = None
            if layer_text:
                layers = set()
                try:
                    for part in layer_text.split("+"):
                        a, _, b = part.partition("-")
                        layers.update(range(int(a), int(b or a) + 1))
                except ValueError:
                    raise ConfigError(
                        f"precision rule {item!r}: layers {layer_text!r} are not like 0-2+7"
                    ) from None
                layers = frozenset(layers)
            rules.append(Rule(role.strip(), layers, dtype))
        return PrecisionSchedule(tuple(rules))

    def dtype_for(self, layer: int | None, role: str) -> str:
        best, rank = "inherit", 0
        for r in self.rules:
            if r.role not in (role, "*"):
                continue
            if r.layers is not None and (layer is None or layer not in r.layers):
                continue
            k = (2 if r.role == role else 1) + (2 if r.layers is not None else 0)
            if k > rank:
                best, rank = r.dtype, k
        return best

    def check_roles(self, specs) -> None:
        """A rule naming a role this model has no tensor of is a typo: refuse it."""
        roles = {s.role for s in specs}
        unknown = sorted({r.role for r in self.rules if r.role != "*" and r.role not in roles})
        if unknown:
            raise ConfigError(
                f"precision rule role(s) {', '.join(unknown)} match no tensor of this model "
                f"(its roles: {', '.join(sorted(roles))})"
            )

    def describe(self, specs) -> dict[str, str]:
        """role -> resolved dtype (or per-layer detail when layers differ), for `inspect`."""
        out: dict[str, set] = {}
        for s in specs:
            out.setdefault(s.role, set()).add(self.dtype_for(s.layer, s.role))
        return {role: "/".join(sorted(v)) for role, v in sorted(out.items())}
