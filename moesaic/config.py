"""The family registry (model_type -> family module) and helpers for reading config fields.

A family module provides:
  parse_config(raw, layout)        -> frozen config dataclass (raises ConfigError naming the field)
  tensor_specs(cfg)                -> list[TensorSpec], the tensor contract
  namings(cfg, layout, store_names) -> the Naming that maps the contract onto this checkpoint's names
  Model(cfg, tensors, dtype, device) with new_state(rollback_window=0) -> SequenceState and
                                   forward(ForwardBatch) -> fp32 logits of batch.logit_rows
  layer_schedule(cfg)              -> one "mixer+mlp" string per decoder layer
  state_bytes(cfg, dtype_bytes)    -> (bytes per token, fixed bytes per sequence), for the planner
  max_context(cfg)                 -> the longest sequence the model takes
  facts(cfg)                       -> (optional) family facts `inspect` reports (expert bytes, ...)
  handoff(raw)                     -> (optional) another model_type that should read this config
"""

from __future__ import annotations

import importlib
from types import ModuleType

from .errors import ConfigError

FAMILIES = {
    "mistral4": "moesaic.models.mistral4",
    "glm5_next": "moesaic.models.glm5next",
    "glm5_next_text": "moesaic.models.glm5next",
    "nemotron_h": "moesaic.models.nemotron_h",
    "kimi_linear": "moesaic.models.kimi_linear",
    "kimi_k3": "moesaic.models.kimi_k3",
    "deepseek_v4": "moesaic.models.deepseek_v4",
    "deepseek_v41": "moesaic.models.deepseek_v41",
}


def family_for(raw: dict, layout: str) -> tuple[ModuleType, dict]:
    """The family module and the (text) config dict of a checkpoint's config."""
    if layout == "mistral":
        # Mistral's native params.json has no model_type; MLA fields mark the Mistral-4 layout.
        if "kv_lora_rank" in raw or "q_lora_rank" in raw:
            return importlib.import_module(FAMILIES["mistral4"]), raw
        raise ConfigError(
            "params.json: only the MLA (Mistral Small 4) native layout is supported; no kv_lora_rank found"
        )
    mt = raw.get("model_type")
    if mt is None:
        raise ConfigError("config.json: field 'model_type' is missing")
    if mt in FAMILIES:
        return _module(mt, raw), raw
    text = raw.get("text_config")
    if isinstance(text, dict) and text.get("model_type") in FAMILIES:
        return _module(text["model_type"], text), text
    known = ", ".join(sorted(FAMILIES))
    raise ConfigError(f"config.json: model_type {mt!r} is not supported (supported: {known})")


def _module(model_type: str, raw: dict) -> ModuleType:
    """The family module of a model_type. A family may pass a config it recognises as a relative's
    to that family: `handoff(raw)` returns the other model_type or None (a bare Kimi K3 text
    config says model_type "kimi_linear")."""
    module = importlib.import_module(FAMILIES[model_type])
    other = module.handoff(raw) if hasattr(module, "handoff") else None
    return importlib.import_module(FAMILIES[other]) if other else module


_MISSING = object()


def field(
    raw: dict, key: str, kind: type, default=_MISSING, *, where: str = "config", check=None, why: str = ""
):
    """Reads raw[key] as `kind` (int/float/bool/str). Missing without default, wrong type or a
    failed `check(value)` raise ConfigError naming the field and the value."""
    if key not in raw or raw[key] is None:
        if default is _MISSING:
            raise ConfigError(f"{where}: required field {key!r} is missing")
        return default
    v = raw[key]
    try:
        if kind is bool:
            if not isinstance(v, bool):
                raise TypeError
        elif kind is int:
            if isinstance(v, bool) or (isinstance(v, float) and not v.is_integer()):
                raise TypeError
            v = int(v)
        elif kind is float:
            if isinstance(v, bool):
                raise TypeError
            v = float(v)
        elif kind is str:
            if not isinstance(v, str):
                raise TypeError
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: field {key!r} must be {kind.__name__}, got {raw[key]!r}") from None
    if check is not None and not check(v):
        raise ConfigError(f"{where}: field {key!r} has invalid value {v!r}" + (f" ({why})" if why else ""))
    return v


def positive(v) -> bool:
    return v > 0


def eos_ids(value) -> tuple[int, ...]:
    """config.json's `eos_token_id` (one id, a list of ids, or null) as a tuple of ints."""
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else (int(value),)
