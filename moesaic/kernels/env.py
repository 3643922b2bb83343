"""Environment switches that hot paths read at every call (kernel dispatch: ~190 reads a decode step).

CPython keeps os.environ in the mapping's `_data` dict, keys and values encoded: a lookup there costs
~0.05 us, where os.environ.get encodes the key and decodes the value (~0.9 us; an unset name raises and
catches two exceptions inside). A change made while the process runs (os.environ[...] = ..., a test's
monkeypatch.setenv) is seen at the next read, as with os.environ.get. Elsewhere os.environ.get serves."""

from __future__ import annotations

import os

_DATA = getattr(os.environ, "_data", None)
_DATA = _DATA if isinstance(_DATA, dict) and hasattr(os.environ, "encodekey") else None
_KEYS: dict = {}  # name -> its key in _DATA
_PARSED: dict = {}  # a flag's raw value -> on / off
OFF = ("0", "false", "off", "no")


def _raw(name: str):
    if _DATA is None:
        return os.environ.get(name)
    key = _KEYS.get(name)
    if key is None:
        key = _KEYS[name] = os.environ.encodekey(name)
    return _DATA.get(key)


def get(name: str) -> str | None:
    """os.environ.get(name)."""
    v = _raw(name)
    return v if v is None or _DATA is None else os.environ.decodevalue(v)


def flag(name: str, default: bool = True) -> bool:
    """An on/off switch: `default` when unset, else on unless set to 0 / false / off / no (any case, spaces
    around ignored)."""
    raw = _raw(name)
    return default if raw is None else _parsed(raw)


def _parsed(raw) -> bool:
    on = _PARSED.get(raw)
    if on is None:
        text = raw if _DATA is None else os.environ.decodevalue(raw)
        on = _PARSED[raw] = text.strip().lower() not in OFF
    return on


def switch(name: str, default: bool = True):
    """flag(name, default) as a function of no arguments that reads the environment at each call in one Python
    frame (a dict lookup; flag's reads took three or four frames, and the kernel dispatch of a DeepSeek-V4
    decode step makes ~180 of them)."""
    if _DATA is None:
        return lambda: flag(name, default)
    key, lookup = os.environ.encodekey(name), _DATA.get

    def read() -> bool:
        raw = lookup(key)
        if raw is None:
            return default
        on = _PARSED.get(raw)
        return _parsed(raw) if on is None else on

    return read


def is_set(name: str):
    """Whether `name` is set to a non-empty value, as a function of no arguments reading at each call (switch's
    one frame)."""
    if _DATA is None:
        return lambda: bool(os.environ.get(name))
    key, lookup = os.environ.encodekey(name), _DATA.get
    return lambda: bool(lookup(key))
