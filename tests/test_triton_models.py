"""Whole models through the Triton kernels: the layers' dispatch (moesaic/kernels/triton `kernels`), and
the families' demos run with every mixer, router and packed GEMM on its Triton kernel, against the
torch references.

On CPU the kernels run under Triton's interpreter, forced by MOESAIC_TRITON=interpret. The switch must
be set before triton is first imported, so the `case_*` functions run in one child pytest process that
starts with it (like tests/test_triton_kernels.py); each `test_model[case_...]` here reports its case.
In the child the switch is flipped to `off` around the reference runs (it is read at every call).
"""

import os
import sys
import types

import pytest
import torch
from helpers import demo_model, random_ids, run_cases_in_child

from moesaic.cache.batch import ForwardBatch
from moesaic.kernels import triton as kt
from moesaic.layers import csa, dsa, mhc, mla
from moesaic.weights import quant as Q

CHILD = os.environ.get("MOESAIC_TRITON_MODELS") == "1"  # this process runs the cases under the interpreter

# demo -> the kernel modules its forward must reach: one KDA + MLA family (Kimi Linear), one Mamba-2
# (Nemotron-H), and GLM-5.3 for the DSA indexer and sparse attention, mHC and NVFP4 experts. The two with
# paged layers run over the engine's pages (PAGED). Mistral 4 (MLA only, ~35 s here on a shared machine)
# and DeepSeek-V4 (CSA/HCA compressors and indexer, ~35 s) would add nothing the others and the
# function-by-function case below do not reach.
DEMOS = {
    "demo-kimi-linear": {"kda", "mla", "router", "quant"},
    "demo-nemotron-h": {"mamba2", "router", "quant"},
    "demo-glm5-next-nvfp4": {"kda", "mla", "indexer", "mhc", "router", "quant"},
}
# demo -> (the paged launch its MLA / DSA layers make, how many of its 3 forwards make it with both
# sequences: Kimi's 13-token prefill takes the expanded MLA, DSA attends every forward in the latent space)
PAGED = {
    "demo-kimi-linear": ("paged_latent_attention", 5, 2),
    "demo-glm5-next-nvfp4": ("paged_sparse_mla_attend", 3, 3),
}
REL = 2e-5  # fp32: the kernels sum in other orders than torch; seen ~2e-6 of max |logit| on these demos


def _decode_run(model, vocab: int, states=None, device="cpu"):
    """Two sequences: prefill 13 and 4 tokens, then 2 decode steps of both in one batch, their tokens on
    `device` (the model's). -> logits [rows, V]. (13: more complete pools than GLM's demo index_topk keeps,
    so its indexer scores; 4 keeps them all.)"""
    a, b = random_ids(13, vocab, seed=3), random_ids(4, vocab, seed=4)
    sa, sb = states or (model.new_state(), model.new_state())
    outs = [model.forward(ForwardBatch.build([(sa, a), (sb, b)], logits="all", device=device))]
    for step in range(2):
        outs.append(model.forward(ForwardBatch.build([(sa, [a[step]]), (sb, [b[step]])], device=device)))
    return torch.cat(outs)


def _through_the_kernels(demo, monkeypatch, paged: bool):
    """(reference logits, logits through the kernels, kernel modules reached, paged launches' tables)."""
    from moesaic.cache.paged import BlockTable, PagePool
    from moesaic.kernels.triton import mla as tmla

    monkeypatch.setenv("MOESAIC_TRITON", "off")
    ck, model = demo_model(demo, "float32")
    states, tables = None, []
    with torch.no_grad():
        ref = _decode_run(model, ck.cfg.vocab_size)
        if paged:  # the engine's pages, blocks out of order
            pool = PagePool(model.new_state(), num_blocks=4)
            states = [pool.page(model.new_state(), BlockTable([b])) for b in (3, 1)]
            name, table_arg, _ = PAGED[demo]
            launch = getattr(tmla, name)
            monkeypatch.setattr(tmla, name, lambda *a, **k: tables.append(a[table_arg]) or launch(*a, **k))
        monkeypatch.setenv("MOESAIC_TRITON", "interpret")
        monkeypatch.setattr(kt, "_modules", {})  # records the kernel modules this forward reaches
        got = _decode_run(model, ck.cfg.vocab_size, states)
    assert got.shape == ref.shape
    err, scale = float((got - ref).abs().max()), float(ref.abs().max())
    assert err <= REL * scale, f"{demo}: max |logit error| {err:.3g} > {REL:g} x {scale:.3g}"
    assert DEMOS[demo] <= set(kt._modules), f"{demo} reached only {sorted(kt._modules)}"
    return states, tables


@pytest.mark.parametrize("demo", sorted(set(DEMOS) - set(PAGED)))
def case_demo_logits_through_the_kernels_equal_the_references(demo, monkeypatch):
    _through_the_kernels(demo, monkeypatch, paged=False)


@pytest.mark.parametrize("demo", sorted(PAGED))
def case_paged_demo_attends_in_one_launch_over_the_engines_pages(demo, monkeypatch):
    """With the engine's paged rows, each MLA / DSA layer's latent attention runs as one paged launch over
    both sequences (block tables [[3], [1]]), and the logits equal the references'."""
    states, tables = _through_the_kernels(demo, monkeypatch, paged=True)
    layers = sum(type(r).__name__ == "PagedRows" for r in states[0].layers)
    both = [t for t in tables if t.tolist() == [[3], [1]]]
    assert layers and len(both) == PAGED[demo][2] * layers, tables


def _both(monkeypatch, fn, *args):
    """fn(*args) with the switch off and on: (reference, through the kernels, kernel modules reached)."""
    monkeypatch.setenv("MOESAIC_TRITON", "off")
    ref = fn(*args)
    monkeypatch.setenv("MOESAIC_TRITON", "interpret")
    monkeypatch.setattr(kt, "_modules", {})
    return ref, fn(*args), set(kt._modules)


def _close(got, ref, rel=REL):
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert float((got - ref).abs().max()) <= rel * (float(ref.abs().max()) + 1e-6)


def case_layer_functions_the_demos_above_do_not_reach(monkeypatch):
    """Each dispatching reference not on those demos' paths, through its kernel and not (the demos run
    their MLA over the engine's pages: the unpaged form too)."""
    gen = torch.Generator().manual_seed(5)
    d = csa.CompressorDims(4, 12, True)
    kv, gate = torch.randn(2, 20, d.proj_width, generator=gen)
    ape = torch.randn(4, d.proj_width, generator=gen)
    ref, got, reached = _both(monkeypatch, csa.pool_windows, kv, gate, ape, d, True)
    _close(got, ref)
    assert reached == {"compressor"}
    q, w = torch.randn(5, 16, 20, generator=gen), torch.randn(5, 16, generator=gen) * 0.25
    keys, pos = torch.randn(70, 20, generator=gen), torch.tensor([1, 7, 30, 200, 283])
    (ref, ref_keep), (got, keep), reached = _both(
        monkeypatch, csa.indexer_select, q, w, keys, pos, 4, 6, 8, 3
    )
    assert torch.equal(keep, ref_keep) and torch.equal(got.sort(1).values, ref.sort(1).values)
    assert reached == {"indexer"}
    k, z = torch.randn(2, 23, 20, generator=gen)
    ref, got, reached = _both(monkeypatch, dsa.pool_keys, k, z, torch.randn(4, 20, generator=gen))
    _close(got, ref)
    assert reached == {"compressor"}
    scores = torch.randn(5, 6, generator=gen)
    ref, got, _ = _both(monkeypatch, dsa.select, scores, torch.tensor([3, 8, 12, 20, 22]), 4, 3, True)
    assert torch.equal(got.sort(1).values, ref.sort(1).values)
    latent, w_kv_b = torch.randn(9, 32, generator=gen), torch.randn(4 * (16 + 12), 32, generator=gen) * 0.2
    sel = torch.tensor([[0, 3, -1], [8, 1, 2]])
    ref, got, reached = _both(
        monkeypatch,
        dsa.sparse_mla_attend,
        torch.randn(2, 4, 16, generator=gen),
        latent,
        w_kv_b,
        12,
        0.25,
        sel,
    )
    _close(got, ref)
    assert reached == {"mla"}
    q_lat, q_rope = torch.randn(4, 3, 32, generator=gen), torch.randn(3, 4, 16, generator=gen)
    latent, k_rope = torch.randn(70, 32, generator=gen), torch.randn(70, 16, generator=gen)
    ref, got, reached = _both(monkeypatch, mla.latent_attention, q_lat, q_rope, latent, k_rope, 0.2)
    _close(got, ref)  # one sequence's unpaged rows (3 new tokens of 70, more than a page)
    assert reached == {"mla"}
    ref, got, reached = _both(monkeypatch, mhc.sinkhorn, torch.randn(3, 4, 4, generator=gen), 5, 1e-6)
    _close(got, ref)
    assert reached == {"mhc"}
    qt = Q.from_suffix_dict(Q.quantize_nvfp4(torch.randn(40, 64, generator=gen)))
    ref, got, reached = _both(monkeypatch, qt.dequantize, torch.float32)
    assert torch.equal(got, ref) and reached == {"quant"}
    both = Q.ConcatRows([qt, torch.randn(8, 64, generator=gen)])  # a packed half and a dense one
    ref, got, reached = _both(monkeypatch, both.matmul, torch.randn(3, 64, generator=gen))
    _close(got, ref)
    assert reached == {"quant"}


def case_switch_reads_the_environment_at_every_call(monkeypatch):
    monkeypatch.setenv("MOESAIC_TRITON", "interpret")
    assert kt.kernels("kda", torch.zeros(1)) is not None and kt.interpreting()
    monkeypatch.setenv("MOESAIC_TRITON", "off")
    assert kt.kernels("kda", torch.zeros(1)) is None


# ------------------------------------------------------------------------------------------ this process


class _Trap(dict):
    def get(self, name, default=None):
        raise AssertionError(f"the torch path asked for the Triton module {name!r}")


@pytest.mark.parametrize("switch", [None, "auto", "off"])
def test_cpu_path_never_reaches_triton(switch, monkeypatch):
    """Without the interpreter switch, a prefill + decode of a demo on CPU tensors never asks for a
    Triton module (every layer runs its torch reference, as before the dispatch)."""
    if switch is None:
        monkeypatch.delenv("MOESAIC_TRITON", raising=False)
    else:
        monkeypatch.setenv("MOESAIC_TRITON", switch)
    monkeypatch.setattr(kt, "_modules", _Trap())
    ck, model = demo_model("demo-glm5-next-nvfp4", "float32")
    st = model.new_state()
    with torch.no_grad():
        model.forward(ForwardBatch.build([(st, random_ids(5, ck.cfg.vocab_size, seed=1))]))
        model.forward(ForwardBatch.build([(st, [7])]))
    assert st.num_tokens == 6


def _fake(device_type: str):
    """Stands in for a tensor on `device_type`: the dispatch reads only .is_cuda and .device.type."""
    return types.SimpleNamespace(is_cuda=device_type == "cuda", device=torch.device(device_type))


def test_dispatch_decision(monkeypatch):
    """auto: CUDA tensors (triton installed, no interpreter); off: nowhere; interpret: CPU tensors."""
    pytest.importorskip("triton", reason="triton is not installed: nothing to dispatch to")
    marker = object()
    monkeypatch.setattr(kt, "_modules", {"kda": marker})  # no import of triton in this process
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cuda, cpu = _fake("cuda"), _fake("cpu")
    for switch, want_cuda, want_cpu in (("auto", marker, None), ("", marker, None), ("off", None, None)):
        monkeypatch.setenv("MOESAIC_TRITON", switch)
        assert (kt.kernels("kda", cuda), kt.kernels("kda", cpu)) == (want_cuda, want_cpu), switch
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # an interpreting process: CPU tensors only
    monkeypatch.setenv("MOESAIC_TRITON", "interpret")
    assert (kt.kernels("kda", cuda), kt.kernels("kda", cpu)) == (None, marker)
    monkeypatch.setenv("MOESAIC_TRITON", "auto")
    assert kt.kernels("kda", cuda) is None  # the interpreter cannot take CUDA tensors


def test_bad_switches_warn_and_leave_the_torch_path(monkeypatch):
    monkeypatch.setattr(kt, "_warned", set())
    monkeypatch.setattr(kt, "_modules", _Trap())
    monkeypatch.setenv("MOESAIC_TRITON", "interpet")
    with pytest.warns(UserWarning, match="'interpet' is not one of auto, off, interpret"):
        assert kt.mode() == "auto" and kt.kernels("kda", torch.zeros(1)) is None
    # interpret asked for after triton was imported without the interpreter: it cannot run on CPU now
    monkeypatch.setenv("MOESAIC_TRITON", "interpret")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setitem(sys.modules, "triton", sys.modules.get("triton", types.ModuleType("triton")))
    monkeypatch.setattr(kt, "triton_importable", lambda: True)
    with pytest.warns(UserWarning, match="imported before the interpreter"):
        assert kt.kernels("kda", torch.zeros(1)) is None
    assert "TRITON_INTERPRET" not in os.environ


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: the GPU parity runs on one")
@pytest.mark.parametrize("demo", sorted(DEMOS))
def test_demo_on_cuda_equals_cpu(demo):
    """The CUDA path (Triton kernels by default) gives the CPU references' logits on every demo."""
    ck, model = demo_model(demo, "float32")
    gpu = ck.build("float32", "cuda")
    with torch.no_grad():
        ref = _decode_run(model, ck.cfg.vocab_size)
        got = _decode_run(gpu, ck.cfg.vocab_size, device="cuda").cpu()
    assert float((got - ref).abs().max()) <= 1e-3 * float(ref.abs().max())


CASES = sorted(name for name in list(globals()) if name.startswith("case_"))


@pytest.fixture(scope="module")
def interpreted_run(tmp_path_factory):
    """Runs every case once in a child pytest with MOESAIC_TRITON=interpret; {test id: outcome}, output."""
    pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot run")
    pytest.importorskip("numpy", reason="Triton's interpreter needs numpy")
    folder = tmp_path_factory.mktemp("triton_models")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the switch must request it
    env.update(MOESAIC_TRITON_MODELS="1", MOESAIC_TRITON="interpret", OMP_NUM_THREADS="1")
    return run_cases_in_child(__file__, folder, env)


@pytest.mark.skipif(CHILD, reason="the child process runs the cases themselves")
@pytest.mark.parametrize("case", CASES)
def test_model(case, interpreted_run):
    outcomes, output = interpreted_run
    runs = {n: o for n, o in outcomes.items() if n == case or n.startswith(case + "[")}
    assert runs, f"{case} did not run in the interpreter process:\n{output}"
    bad = {n: o for n, o in runs.items() if o != "passed"}
    assert not bad, f"{bad}\n{output}"
