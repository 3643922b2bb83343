"""The built-in demo list: every demo is written in its family's release layout, loads, generates,
and says its weights are random."""

import pytest

import moesaic
from moesaic.demo import DEMOS, is_demo
from moesaic.inspect import inspect_checkpoint
from moesaic.llm import resolve_model_path


@pytest.mark.parametrize("name", list(DEMOS))
def test_demo_generates_and_is_marked_random(name):
    llm = moesaic.LLM(name, dtype="float32")
    assert is_demo(llm.raw_config)
    out = llm.generate(["hi"], moesaic.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and isinstance(out.text, str)
    info = inspect_checkpoint(resolve_model_path(name))
    assert info["random_weights_demo"] and info["contract"] == "ok"
    if name.endswith("nvfp4"):
        assert info["quantized_formats"].get("nvfp4", 0) > 0


@pytest.mark.parametrize("precision", ["*=fp8", "attention=fp8,mamba=fp8,linear_attention=fp8,expert=fp8"])
@pytest.mark.parametrize("name", list(DEMOS))
def test_demo_generates_with_fp8_weights(name, precision):
    # every packable weight quantized at load: a weight used other than through `linear` (a conv,
    # a viewed kv_b_proj) must stay dense, and every projection must take a packed weight
    llm = moesaic.LLM(name, dtype="float32", precision=precision)
    out = llm.generate(["hi"], moesaic.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 3 and isinstance(out.text, str)
