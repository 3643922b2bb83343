"""Every registered family implements the whole family protocol (models.Family), and its state planner
counts what a sequence really holds, rollback window included, on the family's demo."""

from __future__ import annotations

import importlib

import pytest
import torch
from helpers import check_state_bytes_exact

from moesaic.demo import demo_entry
from moesaic.models import FAMILIES, Family, Model, family_for

# one demo per family (the demos of tests/test_demos.py)
DEMO_OF = {
    "moesaic.models.mistral4": "demo-mistral4",
    "moesaic.models.nemotron_h": "demo-nemotron-h",
    "moesaic.models.glm5next": "demo-glm5-next-nvfp4",
    "moesaic.models.deepseek_v4": "demo-deepseek-v4",
    "moesaic.models.deepseek_v41": "demo-deepseek-v41",
    "moesaic.models.kimi_linear": "demo-kimi-linear",
    "moesaic.models.kimi_k3": "demo-kimi-k3",
}
# families whose layers keep per-sequence state that a rollback window multiplies (KDA, Mamba-2, windows,
# compressor tails, Engram lookback); MLA-only Mistral keeps rows that roll back for free
WINDOWED = {m for m in DEMO_OF if m != "moesaic.models.mistral4"}


def test_every_registered_family_has_a_demo_here():
    assert set(FAMILIES.values()) == set(DEMO_OF)


@pytest.mark.parametrize("module_name", sorted(DEMO_OF))
def test_family_implements_the_protocol(module_name):
    family = importlib.import_module(module_name)
    assert isinstance(family, Family), [n for n in Family.__protocol_attrs__ if not hasattr(family, n)]
    assert all(FAMILIES[t] == module_name for t in family.MODEL_TYPES)
    raw = demo_entry(DEMO_OF[module_name]).config
    found, text = family_for(raw, "hf")
    assert found is family
    cfg = family.parse_config(text)
    schedule = family.layer_schedule(cfg)
    assert schedule and all(isinstance(s, str) and s for s in schedule)  # Nemotron-H: one block kind each
    assert family.max_context(cfg) > 0
    assert isinstance(family.facts(cfg), dict)
    assert set(family.draft_heads(cfg)) <= {"mtp", "dspark"}
    names = [s.name for s in family.tensor_specs(cfg)]
    assert len(names) == len(set(names))
    assert family.handoff(text) in (None, *FAMILIES)
    assert callable(family.build) and hasattr(Model, "forward")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("module_name", sorted(DEMO_OF))
def test_state_planner_is_exact_with_the_rollback_window(module_name, dtype):
    """24 tokens (past every window and tail of the demos plus the window, a multiple of every compression
    ratio) fed one per forward and in one prefill: the state holds per_token * 24 + fixed bytes, for windows
    0 and 4, and the window costs fixed bytes exactly where a layer keeps per-sequence state."""
    demo = DEMO_OF[module_name]
    per0, fixed0 = check_state_bytes_exact(demo, dtype, window=0, T=24)
    per4, fixed4 = check_state_bytes_exact(demo, dtype, window=4, T=24)
    assert per0 == per4 > 0
    assert (fixed4 > fixed0) == (module_name in WINDOWED)
    assert torch.tensor([fixed0, fixed4]).ge(0).all()


@pytest.mark.parametrize("module_name", sorted(DEMO_OF))
def test_taps_give_every_rows_hidden_and_change_nothing(module_name):
    """A forward asked for taps (the first and last decoder layer, FINAL) leaves [N, hidden] for every row
    of the batch and the same logits as a forward without; a sequence's taps do not depend on its batch."""
    from helpers import demo_model, random_ids

    from moesaic.cache.batch import FINAL, ForwardBatch

    ck, model = demo_model(DEMO_OF[module_name], "float32")
    layers = len(ck.family.layer_schedule(ck.cfg))
    taps = (0, layers - 1, FINAL)
    a, b = random_ids(7, ck.cfg.vocab_size, seed=1), random_ids(5, ck.cfg.vocab_size, seed=2)

    def forward(items, taps):
        batch = ForwardBatch.build([(model.new_state(), ids) for ids in items], logits="all")
        batch.taps = taps
        return model.forward(batch), batch.tapped

    plain, none = forward([a, b], ())
    logits, tapped = forward([a, b], taps)
    assert none == {} and torch.equal(plain, logits)
    assert set(tapped) == set(taps)
    for t in tapped.values():
        assert t.shape == (12, ck.cfg.hidden_size) and torch.isfinite(t).all()
    _, alone = forward([b], taps)
    # fp32 to rounding, relative to the hidden state's size (the GEMMs sum a batch in other orders)
    for k in taps:
        assert (tapped[k][7:] - alone[k]).abs().max() < 1e-5 * max(1.0, alone[k].abs().max().item())
