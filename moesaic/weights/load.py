"""From a checkpoint folder to a ready model: config -> family -> contract check -> tensors."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from ..config import family_for
from ..errors import ConfigError
from .contract import LoadPlan, load_tensors, plan_load
from .precision import PrecisionSchedule
from .store import WeightStore

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not supported (one of {', '.join(DTYPES)})")
    return DTYPES[dtype]


@dataclass
class Checkpoint:
    store: WeightStore
    family: ModuleType
    cfg: object
    raw: dict  # the text config dict as read

    @staticmethod
    def open(path) -> Checkpoint:
        store = WeightStore(path)
        family, raw = family_for(store.config, store.layout)
        return Checkpoint(store, family, family.parse_config(raw, store.layout), raw)

    def plan(self) -> LoadPlan:
        naming = self.family.namings(self.cfg, self.store.layout, self.store.names())
        return plan_load(self.family.tensor_specs(self.cfg), self.store, naming)

    def build(self, dtype="float32", device="cpu", precision: PrecisionSchedule | str | None = None):
        dt = parse_dtype(dtype)
        if not isinstance(precision, PrecisionSchedule):
            precision = PrecisionSchedule.parse(precision)
        tensors = load_tensors(self.plan(), self.store, dt, device, precision)
        model = self.family.Model(self.cfg, tensors, dt, device)
        bind = getattr(model, "bind_checkpoint", None)
        if (
            bind is not None
        ):  # a model that reads more than tensors from the folder (V4.1 Engram: the tokenizer)
            bind(self.store)
        return model
