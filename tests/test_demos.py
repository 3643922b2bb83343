"""The built-in demo list: every demo is written in its family's release layout and quantized formats,
loads, generates, and says its weights are random."""

import re
from collections import Counter

import pytest

import moesaic
from moesaic.config import is_demo
from moesaic.demo import demo_entry, random_demos
from moesaic.inspect import inspect_checkpoint
from moesaic.llm import resolve_model_path
from moesaic.weights.store import WeightStore

# writer format -> the format the loader reads it as (DeepSeek's fp4 experts are E2M1 codes with E8M0 group-32
# scales, i.e. MXFP4; every block-scaled fp8 is fp8_block)
READ_AS = {
    "mxfp4": "mxfp4",
    "nvfp4": "nvfp4",
    "nvfp4-modelopt": "nvfp4",
    "fp8": "fp8_block",
    "fp8-deepseek": "fp8_block",
    "fp8-ue8m0": "fp8_block",
    "fp4-deepseek": "mxfp4",
    "fp8-mistral": "fp8_tensor",
}


def expected_formats(name: str, path) -> dict[str, int]:
    """format -> how many of the checkpoint's weights its DEMOS entry's (regex, format) pairs name; each pair
    must name some."""
    names = WeightStore(path).names()
    bases = {n.rsplit(".", 1)[0] for n in names if n.endswith((".weight", ".weight_packed"))}
    out = Counter()
    for regex, fmt in demo_entry(name).quant:
        n = sum(re.fullmatch(regex, b + ".weight") is not None for b in bases)
        assert n > 0, f"{name}: {regex} names no weight of the checkpoint"
        out[READ_AS[fmt]] += n
    return dict(out)


@pytest.mark.parametrize("name", random_demos())
def test_demo_generates_and_is_marked_random(name):
    llm = moesaic.LLM(name, dtype="float32")
    assert is_demo(llm.raw_config)
    out = llm.generate(["hi"], moesaic.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and isinstance(out.text, str)
    info = inspect_checkpoint(resolve_model_path(name))
    assert info["random_weights_demo"] and info["contract"] == "ok"
    if name.endswith("nvfp4"):
        assert info["quantized_formats"].get("nvfp4", 0) > 0
    # every weight the entry quantizes is read in its format, and no other weight is quantized
    assert info["quantized_formats"] == expected_formats(name, resolve_model_path(name))


@pytest.mark.parametrize("roles", ["*", "attention,mamba,kda,expert"])
@pytest.mark.parametrize("name", [*random_demos(), "demo"])
def test_demo_generates_with_fp8_weights(name, roles):
    # every packable weight quantized at load: a weight used other than through `linear` (a conv,
    # a viewed kv_b_proj) must stay dense, and every projection must take a packed weight. By role:
    # those of the listed roles this model has (a rule naming a role it lacks is refused)
    have = inspect_checkpoint(resolve_model_path(name))["params_by_role"]
    precision = ",".join(f"{r}=fp8" for r in roles.split(",") if r == "*" or r in have)
    llm = moesaic.LLM(name, dtype="float32", precision=precision)
    out = llm.generate(["hi"], moesaic.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 3 and isinstance(out.text, str)
