"""The families: the registry (model_type -> family module), the protocol every family module
implements, and `Checkpoint`, which turns a folder into a ready model.

Importing this package imports no family: a family module is imported the first time a checkpoint
of its model_type is opened.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Protocol, runtime_checkable

import torch

from ..cache.batch import ForwardBatch
from ..cache.state import SequenceState
from ..errors import ConfigError, MoesaicError
from ..weights.bind import Tensors
from ..weights.contract import LoadPlan, Naming, TensorSpec, check_scale, load_tensors, plan_load
from ..weights.dtypes import parse_dtype
from ..weights.experts import DEFAULT_POLICY, ExpertCache
from ..weights.precision import PrecisionSchedule
from ..weights.store import WeightStore

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


class Model(Protocol):
    """What a family's `build` returns: a decoder over ForwardBatches with per-sequence state."""

    cfg: object
    dtype: torch.dtype
    device: object

    def new_state(self, rollback_window: int = 0) -> SequenceState:
        """A fresh per-sequence state; `rollback_window` = how many of its last tokens the sequence can
        forget exactly (speculative decoding)."""

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """fp32 logits of `batch.logit_rows`; appends every sequence's new tokens to its state."""


@runtime_checkable
class Family(Protocol):
    """What every family module provides (module-level functions; tests/test_families.py checks each)."""

    MODEL_TYPES: tuple[str, ...]

    def handoff(self, raw: dict) -> str | None:
        """Another model_type that should read this config (a bare Kimi K3 text config says kimi_linear),
        or None."""

    def parse_config(self, raw: dict, layout: str = "hf"):
        """config.json (or Mistral's params.json when layout == "mistral") -> the frozen config dataclass;
        a ConfigError naming the field for anything that cannot work."""

    def tensor_specs(self, cfg) -> list[TensorSpec]:
        """The tensor contract: every tensor the model needs, with shapes from the config."""

    def namings(self, cfg, layout: str, store_names) -> Naming:
        """Where this checkpoint keeps each contract tensor."""

    def build(self, cfg, tensors: Tensors, dtype: torch.dtype, device, folder: Path | None) -> Model:
        """The model, its weights bound from `tensors` (folder: the checkpoint, for what is not a tensor)."""

    def layer_schedule(self, cfg) -> list[str]:
        """One "mixer+mlp" string per decoder layer (e.g. "kda+moe")."""

    def state_bytes(self, cfg, dtype_bytes: int, rollback_window: int = 0) -> tuple[int, int]:
        """(bytes per token, fixed bytes per sequence) a sequence's state holds at most, counting what a
        rollback window of that many tokens keeps."""

    def max_context(self, cfg) -> int:
        """The longest sequence the model takes."""

    def facts(self, cfg) -> dict:
        """Family facts `inspect` reports (expert bytes, table sizes, ...)."""

    def draft_heads(self, cfg) -> tuple[str, ...]:
        """The speculative methods the config's own draft heads serve ("mtp", "dspark"); () if none."""


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
    if isinstance(mt, str) and mt in FAMILIES:
        return _module(mt, raw), raw
    text = raw.get("text_config")
    if isinstance(text, dict) and isinstance(text.get("model_type"), str) and text["model_type"] in FAMILIES:
        return _module(text["model_type"], text), text
    known = ", ".join(sorted(FAMILIES))
    raise ConfigError(f"config.json: model_type {mt!r} is not supported (supported: {known})")


def read_config(store: WeightStore) -> tuple[ModuleType, dict, object]:
    """(family module, its (text) config dict, the parsed config) of an opened store. A family parser
    that trips over a value of an unexpected type (a list where it reads an object, a string where it
    does arithmetic) gives a ConfigError like every other bad value, never a raw Python error."""
    family, raw = family_for(store.config, store.layout)
    name = "params.json" if store.layout == "mistral" else "config.json"
    try:
        cfg = family.parse_config(raw, store.layout)
    except MoesaicError:
        raise
    except (TypeError, ValueError, AttributeError, KeyError, IndexError, OverflowError) as e:
        short = family.__name__.rsplit(".", 1)[-1]
        raise ConfigError(
            f"{store.folder / name}: a field has a value of the wrong kind for a {short} config "
            f"({type(e).__name__}: {e})"
        ) from e
    return family, raw, cfg


def num_layers(family: ModuleType, cfg) -> int:
    """The decoder layer count, read without building the schedule (a list of that length)."""
    n = getattr(cfg, "num_hidden_layers", None)
    return n if isinstance(n, int) else len(family.layer_schedule(cfg))


def _module(model_type: str, raw: dict) -> ModuleType:
    module = importlib.import_module(FAMILIES[model_type])
    other = module.handoff(raw)
    return importlib.import_module(FAMILIES[other]) if other else module


@dataclass
class Checkpoint:
    """A checkpoint folder opened: its store, family, parsed config and the raw (text) config dict."""

    store: WeightStore
    family: ModuleType
    cfg: object
    raw: dict
    expert_cache: ExpertCache | None = None  # set by build(expert_cache=...)

    @staticmethod
    def open(path) -> Checkpoint:
        store = WeightStore(path)
        family, raw, cfg = read_config(store)
        return Checkpoint(store, family, cfg, raw)

    def plan(self) -> LoadPlan:
        self.store.require_weights()
        check_scale(num_layers(self.family, self.cfg), len(self.store.infos))
        naming = self.family.namings(self.cfg, self.store.layout, self.store.names())
        return plan_load(self.family.tensor_specs(self.cfg), self.store, naming)

    def build(
        self,
        dtype="float32",
        device="cpu",
        precision: PrecisionSchedule | str | None = None,
        expert_cache=None,
        expert_cache_policy: str = DEFAULT_POLICY,
        expert_prefetch: bool = True,
    ) -> Model:
        """expert_cache: a byte budget (int, "8GiB", "10%": room for that share of the experts) for routed experts
        streamed from the shards (weights/experts.py); None loads them all."""
        dt = parse_dtype(dtype)
        if not isinstance(precision, PrecisionSchedule):
            precision = PrecisionSchedule.parse(precision)
        plan = self.plan()
        cache = None
        if expert_cache is not None:
            cache = ExpertCache(expert_cache, expert_cache_policy, expert_prefetch)
        tensors = Tensors(
            load_tensors(plan, self.store, dt, device, precision, experts=cache), plan.skipped_optional
        )
        model = self.family.build(self.cfg, tensors, dt, device, self.store.folder)
        tensors.check_all_taken()
        if cache is not None:
            cache.finalize()
            cache.link(model)
            self.expert_cache = cache
        return model
