"""Speculative decoding: draft proposers (n-gram, MTP, DSpark, DFlash) behind one small interface (base.py),
the registry that builds them, and the verification math the engine runs (verify.py: exact acceptance).

    LLM(model, speculative_config={"method": "dflash", "num_speculative_tokens": 7, "model": drafter_folder})

"dspark" without a folder runs DeepSeek-V4.1's own stages; with one, an external DSpark drafter (any target).

The engine verifies every drafting sequence's [last, d1..dk] in one target forward (mixed with other
sequences' prefill and decode), accepts exactly (greedy: the target's argmax; sampled: rejection sampling
against the draft distribution), and rolls the rejected rows back in every state kind.

The registry maps a method to the factory that builds its proposer, imported when the method is used:

    factory(model, cfg, spec: SpecConfig, folder: Path | None) -> DraftProposer

`model` is the built target (its bound weights: `embed`, `lm_head`, the family's draft heads such as
`Model.mtp`), `cfg` its family config, `spec` the parsed speculative config and `folder` the drafter
checkpoint folder (`spec.model`) or None. A factory raises ConfigError / CheckpointError for what cannot
work (e.g. `mtp` on a checkpoint whose MTP weights are absent).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from .base import Draft, DraftProposer

__all__ = ["Draft", "DraftProposer", "SpecConfig", "PROPOSERS", "parse_speculative_config", "build_proposer"]

# The most drafts one round may verify. States keep k + 1 rows of rollback (model.new_state(rollback_window));
# beyond this the snapshots cost more than drafting can win (published drafters verify at most 15: DFlash b16).
MAX_SPECULATIVE_TOKENS = 15

# method -> "module:function" of its factory (see the module docstring)
PROPOSERS: dict[str, str] = {
    "ngram": "moesaic.spec.ngram:make_proposer",
    "dflash": "moesaic.spec.dflash:make_proposer",
    "mtp": "moesaic.spec.mtp:make_proposer",
    "dspark": "moesaic.spec.dspark:make_proposer",
}
EXTERNAL = ("dflash", "dspark")  # methods served by a separate drafter folder ("model"), for any target

_KEYS = {
    "method",
    "num_speculative_tokens",
    "model",
    "adaptive",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "proposer",
}


@dataclass(frozen=True)
class SpecConfig:
    """The parsed `speculative_config`. `adaptive`: the engine picks each sequence's draft length (up to k)
    from its measured acceptance and the step's cost, and stops drafting where it does not pay.
    `prompt_lookup_min/max`: the n-gram lengths the ngram proposer matches (vLLM's names). `proposer`: a
    DraftProposer object of your own (a drafter moesaic does not ship, or a test's)."""

    method: str
    num_speculative_tokens: int
    model: Path | None = None
    adaptive: bool = True
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    proposer: DraftProposer | None = None

    @property
    def k(self) -> int:
        return self.num_speculative_tokens


def _int(d: dict, key: str, default: int, lo: int, hi: int | None = None) -> int:
    v = d.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
        where = f"an integer in [{lo}, {hi}]" if hi is not None else f"an integer >= {lo}"
        raise ConfigError(f"speculative_config: field {key!r} must be {where}, got {v!r}")
    return v


def parse_speculative_config(value) -> SpecConfig | None:
    """None (drafting off), a SpecConfig, a dict, or the same dict as a JSON string (the CLI's
    --speculative-config) -> a checked SpecConfig; a ConfigError names the field that is wrong."""
    if value is None or isinstance(value, SpecConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"speculative_config is not valid JSON ({e.msg} at char {e.pos}): {value!r}"
            ) from None
    if not isinstance(value, dict):
        raise ConfigError(f"speculative_config must be a JSON object (a dict), got {type(value).__name__}")
    unknown = sorted(set(value) - _KEYS)
    if unknown:
        raise ConfigError(
            f"speculative_config: unknown field(s) {unknown}; known: {', '.join(sorted(_KEYS))}"
        )
    proposer = value.get("proposer")
    if proposer is not None and not isinstance(proposer, DraftProposer):
        raise ConfigError(
            f"speculative_config: field 'proposer' must be a DraftProposer (spec/base.py), got "
            f"{type(proposer).__name__}"
        )
    method = value.get("method", proposer.method if proposer is not None else None)
    if proposer is None and method not in PROPOSERS:
        raise ConfigError(
            f"speculative_config: field 'method' must be one of {', '.join(PROPOSERS)}, got {method!r}"
        )
    if "num_speculative_tokens" not in value:
        raise ConfigError("speculative_config: required field 'num_speculative_tokens' is missing")
    k = _int(value, "num_speculative_tokens", 0, 1, MAX_SPECULATIVE_TOKENS)
    folder = value.get("model")
    if folder is not None:
        if not isinstance(folder, (str, Path)) or not str(folder).strip():
            raise ConfigError(
                f"speculative_config: field 'model' must be a drafter folder (a path), got {folder!r}"
            )
        folder = Path(folder)
        if not folder.is_dir():
            raise ConfigError(f"speculative_config: field 'model': {folder} is not a folder")
    adaptive = value.get("adaptive", True)
    if not isinstance(adaptive, bool):
        raise ConfigError(f"speculative_config: field 'adaptive' must be true or false, got {adaptive!r}")
    lo = _int(value, "prompt_lookup_min", 2, 1)
    hi = _int(value, "prompt_lookup_max", max(4, lo), lo)
    return SpecConfig(method, k, folder, adaptive, lo, hi, proposer)


def _has_proposer(method: str) -> bool:
    return importlib.util.find_spec(PROPOSERS[method].partition(":")[0]) is not None


def available_methods(family, cfg) -> list[str]:
    """What this checkpoint can draft with: its own heads, n-gram, and the external drafters (with a folder)."""
    own = [m for m in family.draft_heads(cfg) if _has_proposer(m)]
    external = [f"{m} (with a drafter folder 'model')" for m in EXTERNAL if m not in own and _has_proposer(m)]
    return own + ["ngram"] + external


def build_proposer(family, model, cfg, spec: SpecConfig) -> DraftProposer:
    """The proposer `spec` asks for, checked against the checkpoint (ConfigError saying which methods it can
    use) and against k (at most what the proposer drafts in one round)."""
    proposer = spec.proposer
    if proposer is None:
        own = family.draft_heads(cfg)
        ok = (
            spec.method == "ngram"
            or spec.method in own
            or (spec.method in EXTERNAL and spec.model is not None)
        )
        if not ok:
            need = " needs a drafter folder ('model') or" if spec.method in EXTERNAL else ""
            raise ConfigError(
                f"speculative_config: method {spec.method!r}{need} is not available for this checkpoint; "
                f"it can use: {', '.join(available_methods(family, cfg))}"
            )
        module, _, name = PROPOSERS[spec.method].partition(":")
        try:
            factory = getattr(importlib.import_module(module), name)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            raise ConfigError(
                f"speculative_config: method {spec.method!r} has no proposer in this moesaic build yet; "
                f"use one of: {', '.join(available_methods(family, cfg))}"
            ) from None
        proposer = factory(model, cfg, spec, spec.model)
    if spec.k > proposer.max_k:
        raise ConfigError(
            f"speculative_config: field 'num_speculative_tokens' is {spec.k}, but the {proposer.method} "
            f"drafter proposes at most {proposer.max_k} tokens a round"
        )
    return proposer
