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
