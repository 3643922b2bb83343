"""The built-in demo models: tiny checkpoints of each family with RANDOM weights from a fixed seed
and a byte-level tokenizer, written on first use into a cache folder in the family's release
naming and, for the quantized ones, its release's quantized formats. They exercise the whole engine
without downloading anything; their text is noise, and they say so.

`demo` (the default model) is `demo-glm5-code`, the one TRAINED demo: a GLM-5.3-shaped model (KDA + DSA +
MoE in mHC streams, with its MTP layer) and a DFlash drafter for it, trained on the Python standard
library's sources by scripts/train_demo.py and shipped in moesaic/demo/trained/ (docs/train_demo.md). Its
greedy text is Python; drafting with its own heads shows speculative decoding's speed-up.

They serve chat (`moesaic serve`): the byte tokenizer keeps the markers of the family's chat format and
output parser as single tokens (`chat_tokens`), and the families whose releases ship a Jinja template get
moesaic's template of that format as `chat_template.jinja`.

Each family's demos live in `moesaic/demo/<family>.py` (its configs, quantized layouts and writers),
imported only when one of its demos is used; nothing in the library below the entry points (llm.py,
cli.py) imports this package.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from ..errors import ConfigError

DEMO_NAME = "demo"
# 2: the V4.1 demo in the release layout (fp4 experts, fp8 Engram rows); 3: chat: each family's markers are
# single tokens (the vocabulary grows by them), its end-of-turn markers end generation, and the families
# that ship a Jinja template get it as chat_template.jinja
DEMO_VERSION = 4  # 4: Nemotron-H demo with an MTP block, V4.1 demo with its DSpark stages; 3: chat markers


class Demo(NamedTuple):
    """A demo: its config.json; what of its release naming is quantized and how, as (regex of release
    tensor names, writer format) pairs (several where the release mixes formats); and `write(folder,
    config)`, the family's own checkpoint writer, where the release has a layout the pairs cannot say."""

    config: dict
    quant: tuple[tuple[str, str], ...] = ()
    write: Callable | None = None


# demo name -> the module of moesaic/demo/ that defines it
DEMOS: dict[str, str] = {
    "demo": "trained",
    "demo-glm5-code": "trained",
    "demo-mistral4": "mistral4",
    "demo-mistral4-nvfp4": "mistral4",
    "demo-nemotron-h": "nemotron_h",
    "demo-nemotron-h-nvfp4": "nemotron_h",
    "demo-kimi-k3": "kimi_k3",
    "demo-kimi-k3-mxfp4": "kimi_k3",
    "demo-glm5-next-nvfp4": "glm5next",
    "demo-deepseek-v4": "deepseek_v4",
    "demo-kimi-linear": "kimi_linear",
    "demo-deepseek-v41": "deepseek_v41",
}
ALIASES = {"demo": "demo-glm5-code"}  # the default demo
# the trained demos: shipped folders of moesaic/demo/trained/, never written (name -> folder)
TRAINED = {"demo-glm5-code": "glm5-code"}
TRAINED_DRAFTERS = {"demo-glm5-code": "glm5-code-dflash"}  # its DFlash drafter


def trained_path(name: str) -> Path:
    return Path(__file__).resolve().parent / "trained" / TRAINED[name]


def trained_demo_path() -> Path:
    """The folder of the default (trained) demo."""
    return trained_path(ALIASES[DEMO_NAME])


def random_demos() -> list[str]:
    """The demos with random weights (written on first use), without the default's alias."""
    return [n for n in DEMOS if n not in TRAINED and n not in ALIASES]


def default_drafter(path: Path) -> Path | None:
    """The shipped DFlash drafter of a trained demo folder (None for any other checkpoint)."""
    for name, folder in TRAINED_DRAFTERS.items():
        if Path(path).resolve() == trained_path(name):
            return trained_path(name).parent / folder
    return None


def demo_entry(name: str) -> Demo:
    """The Demo called `name` (one of DEMOS with random weights)."""
    if ALIASES.get(name, name) in TRAINED:
        raise KeyError(f"{name} is a trained demo (a shipped folder), not written from a Demo entry")
    module = importlib.import_module(f"{__name__}.{DEMOS[name]}")
    return module.DEMOS[ALIASES.get(name, name)]


# The release naming where the one a family reads from a folder without tensors (`namings(cfg, "hf", [])`)
# is another: GLM-5.3's multimodal `model.language_model.*`, DeepSeek-V4's upstream `embed.weight`,
# `layers.N.attn.*` (not transformers' `model.layers.N.*`)
RELEASE_NAMINGS: dict[str, Callable] = {
    "glm5_next": lambda family, cfg: family.checkpoint_naming(),
    "deepseek_v4": lambda family, cfg: family.checkpoint_naming(upstream=True),
}


def cache_dir() -> Path:
    # an empty MOESAIC_CACHE is unset (Path("") would be the current directory)
    return Path(os.environ.get("MOESAIC_CACHE") or Path.home() / ".cache" / "moesaic")


def demo_path(name: str = DEMO_NAME) -> Path:
    return cache_dir() / f"{name}-v{DEMO_VERSION}"


def is_demo_name(name: str) -> bool:
    return str(name) in DEMOS


# the markers that end an assistant turn in each family's chat format (the release's eos_token_id list)
END_OF_TURN = {
    "glm5_next": ("<|user|>", "<|observation|>"),
    "deepseek_v4": ("<｜end▁of▁sentence｜>",),
    "deepseek_v41": ("<｜end▁of▁sentence｜>",),
    "kimi_k3": ("<|end_of_msg|>",),
    "kimi_linear": ("<|im_end|>",),
    "mistral4": ("</s>",),
    "nemotron_h": ("<|im_end|>",),
}


def chat_tokens(model_type: str) -> dict:
    """The config fields that make a byte-tokenizer demo of `model_type` speak its family's chat format:
    `vocab_size` (256 bytes + 3 + the markers), `eos_token_id` (</s> and the end-of-turn markers) and the
    top-level `moesaic_special_tokens` the tokenizer reads."""
    from ..server.chat import SPECIAL_TOKENS
    from ..tokenizer import ByteTokenizer

    tok = ByteTokenizer(SPECIAL_TOKENS[model_type])
    eos = sorted({2} | {tok.special[t] for t in END_OF_TURN[model_type]})
    return dict(vocab_size=tok.vocab_size, eos_token_id=eos, moesaic_special_tokens=list(tok.added))


def random_tensors(specs, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic random weights for a tensor contract: norms near 1, matrices ~ N(0, 1/fan_in)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for s in specs:
        if s.role == "norm":
            out[s.name] = 1.0 + 0.05 * torch.randn(s.shape, generator=g)
        else:
            out[s.name] = torch.randn(s.shape, generator=g) * s.shape[-1] ** -0.5
    return out


def hash_table(vocab: int, k: int, experts: int) -> torch.Tensor:
    """A valid hash routing table [vocab, k] (token -> k distinct experts), int64 as released."""
    return (torch.arange(vocab)[:, None] * 3 + torch.arange(k)[None, :]) % experts


def ensure_demo(name: str = DEMO_NAME) -> Path:
    """The demo checkpoint folder `name` (one of DEMOS), written (atomically) the first time, in the
    release naming of its family and, for the quantized ones, the release's quantized formats."""
    name = ALIASES.get(name, name)
    if name in TRAINED:
        return trained_path(name)
    path = demo_path(name)
    if (path / "config.json").exists() or (path / "params.json").exists():
        return path
    demo = demo_entry(name)
    config = dict(
        demo.config, moesaic_demo={"random_weights": True, "seed": 0, "version": DEMO_VERSION, "name": name}
    )
    from ..server.chat import demo_template

    tmp = None
    try:  # a cache that is a file, unwritable or full: say where and what to do, not an OSError
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".demo-"))
        if demo.write is not None:
            demo.write(tmp, config)
        else:
            write_random(tmp, config, demo.quant)
        template = demo_template(config["model_type"])
        if template is not None:  # as the family's release ships its template
            (tmp / "chat_template.jinja").write_text(template)
    except OSError as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        why = "it is a file" if path.parent.is_file() else e.strerror or str(e)
        raise ConfigError(
            f"the demo cache {path.parent} cannot be written ({why}); set MOESAIC_CACHE to a writable folder"
        ) from None
    try:
        tmp.rename(path)
    except OSError:  # another process wrote it first
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def write_random(folder: Path, config: dict, quant=(), dtype: torch.dtype | None = None) -> int:
    """Random weights (seed 0) for `config` in the family's release naming, the `quant` pairs applied in
    order, the unquantized fp32 tensors stored in `dtype` (None: fp32); returns the parameter count. The
    demos and the benchmarks' ~0.3B models are written by it."""
    from ..models import FAMILIES
    from ..weights.contract import to_checkpoint
    from ..weights.store import save_safetensors
    from ..weights.writers import quantize_checkpoint

    model_type = config["model_type"]
    family = importlib.import_module(FAMILIES[model_type])
    cfg = family.parse_config(config)
    specs = family.tensor_specs(cfg)
    native = bool(quant) and model_type == "mistral4"
    if native:
        naming = family.native_naming(cfg)
    elif model_type in RELEASE_NAMINGS:
        naming = RELEASE_NAMINGS[model_type](family, cfg)
    else:
        naming = family.namings(cfg, "hf", [])
    weights = random_tensors(specs, seed=0)
    for s in specs:
        if s.integer:  # DeepSeek-V4's hash routing
            weights[s.name] = hash_table(*s.shape, cfg.n_routed_experts)
    n = sum(t.numel() for t in weights.values())
    tensors = to_checkpoint(specs, naming, weights)
    if dtype is not None:  # before packing: the packed formats bring their own scale dtypes
        tensors = {k: v.to(dtype) if v.dtype == torch.float32 else v for k, v in tensors.items()}
    folder.mkdir(parents=True, exist_ok=True)
    for regex, fmt in quant:
        tensors, qc = quantize_checkpoint(tensors, regex, fmt)
        config.setdefault(
            "quantization_config", qc
        )  # the first pair's; the formats are read from the tensors
    if native:  # params.json carries what the native layout cannot say (demo marker, byte tokenizer)
        params = dict(
            family.params_json(config),
            quantization_config=config["quantization_config"],
            moesaic_tokenizer="bytes",
            moesaic_special_tokens=config["moesaic_special_tokens"],
            moesaic_demo=config["moesaic_demo"],
        )
        save_safetensors(tensors, folder / "consolidated.safetensors")
        (folder / "params.json").write_text(json.dumps(params, indent=1))
    else:
        save_safetensors(tensors, folder / "model.safetensors")
        (folder / "config.json").write_text(json.dumps(config, indent=1))
    return n
