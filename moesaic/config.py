"""Reading config.json fields: one typed, checked reader, and config dataclasses that declare their fields.

A family's config is a frozen dataclass whose fields say how they are read:

    @dataclass(frozen=True, kw_only=True)
    class MyConfig:
        hidden_size: int = declared(4096, check=positive)
        n_routed_experts: int = declared(128, aliases=("num_experts",), check=positive)
        rope: RopeConfig                       # no declaration: computed by the parser and passed in

    cfg = read_config(MyConfig, raw, "config.json", rope=rope)

`read_config` reads every declared field from `raw` (its key or the first alias present) with `field`,
which checks the type (a float must be finite), the `check` and names the field and the value in the
ConfigError it raises. Fields without a declaration are given by the caller.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing

from .errors import ConfigError

_MISSING = object()


def field(
    raw: dict, key: str, kind: type, default=_MISSING, *, where: str = "config", check=None, why: str = ""
):
    """Reads raw[key] as `kind` (int/float/bool/str). Missing without default, wrong type, a non-finite
    float or a failed `check(value)` raise ConfigError naming the field and the value."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a JSON object, got {type(raw).__name__}")
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
            if (
                isinstance(v, bool)
                or not isinstance(v, (int, float))
                or (isinstance(v, float) and not v.is_integer())
            ):
                raise TypeError
            v = int(v)
            if not -(2**63) <= v < 2**63:
                raise ConfigError(f"{where}: field {key!r} = {raw[key]!r} does not fit in 64 bits")
        elif kind is float:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError
            v = float(v)
            if not math.isfinite(v):
                raise ConfigError(f"{where}: field {key!r} must be a finite number, got {raw[key]!r}")
        elif kind is str:
            if not isinstance(v, str):
                raise TypeError
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{where}: field {key!r} must be {kind.__name__}, got {raw[key]!r}") from None
    if check is not None and not check(v):
        raise ConfigError(f"{where}: field {key!r} has invalid value {v!r}" + (f" ({why})" if why else ""))
    return v


MAX_LAYERS = 10_000  # decoder layers: no model comes near (the releases have 40 to 93)


def layer_count(raw: dict, key: str, default=_MISSING, *, where: str = "config") -> int:
    """A decoder layer count in 1..MAX_LAYERS, for a parser that builds per-layer lists of that length
    (a tuple of 10**15 kinds would never finish)."""
    return field(
        raw,
        key,
        int,
        default,
        where=where,
        check=lambda v: 0 < v <= MAX_LAYERS,
        why=f"must be in 1..{MAX_LAYERS}",
    )


def int_list(raw: dict, key: str, where: str = "config", *, single: bool = False, empty: bool = False):
    """raw[key] as a tuple of 64-bit ints (None when absent): a list of integers, with `single` also one
    integer (a list of one); `empty` allows []. ConfigError naming the field otherwise."""
    v = raw.get(key) if isinstance(raw, dict) else None
    if v is None:
        return None
    items = [v] if single and not isinstance(v, (list, dict, str)) else v
    try:
        if not isinstance(items, list) or not (items or empty):
            raise ConfigError(key)
        return tuple(field({key: x}, key, int) for x in items)
    except ConfigError:
        what = ("a list of integers" if empty else "a non-empty list of integers") + (
            " (or one integer)" if single else ""
        )
        raise ConfigError(f"{where}: field {key!r} must be {what} of 64 bits, got {v!r:.200}") from None


def positive(v) -> bool:
    return v > 0


def non_negative(v) -> bool:
    return v >= 0


def eos_ids(value, where: str = "config.json") -> tuple[int, ...]:
    """config.json's `eos_token_id` (one id, a list of ids, or null) as a tuple of non-negative ints."""
    if value is None:
        return ()
    items = value if isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63 for v in items):
        raise ConfigError(
            f"{where}: field 'eos_token_id' must be a token id or a list of them, got {value!r}"
        )
    return tuple(items)


def section(raw: dict, key: str, where: str) -> dict:
    """A nested object of a config (e.g. `rope_parameters`): {} when absent, a ConfigError when it is not
    an object."""
    v = raw.get(key)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ConfigError(f"{where}: field {key!r} must be an object, got {type(v).__name__}: {v!r}")
    return v


def declared(
    default=_MISSING, *, key: str | None = None, aliases: tuple[str, ...] = (), check=None, why: str = ""
):
    """A config dataclass field read from config.json: its default (none = required), the key when it
    differs from the field's name, older or other releases' aliases, and a check of the value."""
    meta = {"moesaic": {"key": key, "aliases": aliases, "check": check, "why": why, "default": default}}
    if default is _MISSING:
        return dataclasses.field(metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _kind(annotation) -> tuple[type, bool]:
    """(int/float/bool/str, whether None is allowed) of a field's annotation."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return annotation, False


def read_config(cls, raw: dict, where: str, defaults: dict | None = None, **given):
    """An instance of config dataclass `cls`: declared fields read from `raw` (a family may override a
    declaration's default in `defaults`), the others from `given`."""
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if f.name in given:
            values[f.name] = given[f.name]
            continue
        meta = f.metadata.get("moesaic")
        if meta is None:
            continue  # a field with a plain default the parser does not set
        kind, nullable = _kind(hints[f.name])
        keys = [meta["key"] or f.name, *meta["aliases"]]
        key = next((k for k in keys if raw.get(k) is not None), keys[0])
        if nullable and key in raw and raw[key] is None:
            values[f.name] = None
            continue
        default = (defaults or {}).get(f.name, meta["default"])
        default = None if nullable and default is _MISSING else default
        values[f.name] = field(raw, key, kind, default, where=where, check=meta["check"], why=meta["why"])
    return cls(**values)


def require(ok: bool, where: str, key: str, value, why: str) -> None:
    """A check across fields: ConfigError naming the field, its value and why, unless `ok`."""
    if not ok:
        raise ConfigError(f"{where}: field {key!r} has invalid value {value!r} ({why})")


def is_demo(raw_config: dict) -> bool:
    """Whether config.json marks a built-in demo with random weights (its text is noise)."""
    marker = raw_config.get("moesaic_demo") if isinstance(raw_config, dict) else None
    return isinstance(marker, dict) and bool(marker.get("random_weights"))
