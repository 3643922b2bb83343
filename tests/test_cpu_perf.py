"""Issue 18: quantize-at-load to the packed formats (mxfp4 / nvfp4 / fp8 from a bf16 checkpoint), its
bytes as `inspect --precision` reports them, the peak memory of a packing load, and the decode-step
shortcuts (MoE weighted sum, one-row page appends) that must keep the plain code's bits."""

from __future__ import annotations

import pytest
import torch
from helpers import peak_cpu_bytes
from test_expert_streaming import moe_layers
from test_quant_models import MISTRAL, logits, release_tensors, write
from torch.profiler import ProfilerActivity, profile

import moesaic
from moesaic.errors import ConfigError
from moesaic.inspect import inspect_checkpoint
from moesaic.layers.linear import linear
from moesaic.layers.moe import run_experts, swiglu
from moesaic.models import Checkpoint, mistral4
from moesaic.weights.contract import TensorSpec, load_tensors
from moesaic.weights.precision import PrecisionSchedule
from moesaic.weights.quant import ConcatRows, QuantizedTensor

# q_lora_rank 24: q_b's input width fits neither fp4 group (32, 16), so it must stay dense
ODD = dict(MISTRAL, q_lora_rank=24)


def bf16_checkpoint(folder, raw=ODD):
    dense = {k: v.to(torch.bfloat16) for k, v in release_tensors(mistral4, raw, "hf").items()}
    return write(folder, raw, "hf", dense)


def nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else t.nbytes


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "fp8"])
def test_a_bf16_checkpoint_packs_at_load(tmp_path, fmt):
    path = bf16_checkpoint(tmp_path)
    ckpt = Checkpoint.open(path)
    model = ckpt.build("bfloat16", precision=f"*={fmt}")
    want = "fp8_block" if fmt == "fp8" else fmt
    attn, moe = model.layers[1].attn, model.layers[1].mlp
    assert isinstance(attn.q_a, QuantizedTensor) and attn.q_a.format == want
    assert isinstance(moe.experts_out, QuantizedTensor) and moe.experts_out.format == want
    ins = moe.experts_in.parts if isinstance(moe.experts_in, ConcatRows) else [moe.experts_in]
    assert all(isinstance(p, QuantizedTensor) and p.format == want for p in ins)
    assert isinstance(model.layers[1].mlp.router, torch.Tensor)  # routers, norms, embeddings: dense
    assert isinstance(model.embed, torch.Tensor)
    # q_b (K = 24) fits no fp4 group: left dense in the model dtype; fp8's 128x128 blocks take any K
    assert isinstance(attn.q_b, QuantizedTensor) == (fmt == "fp8")
    # close to the dense model, not equal to it
    ids = list(range(3, 20))
    dense = logits(Checkpoint.open(path).build("bfloat16"), ids)
    rel = ((logits(model, ids) - dense).norm() / dense.norm()).item()
    print(f"{fmt}: logits relative error {rel:.3f}")
    assert 0 < rel < (0.3 if fmt == "fp8" else 0.6)  # a random tiny model, every projection packed
    # generates
    llm = moesaic.LLM(str(path), dtype="bfloat16", precision=f"*={fmt}")
    out = llm.generate([[3, 4, 5]], moesaic.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 4
    # inspect's bytes under the schedule are the loaded tensors' bytes
    info = inspect_checkpoint(path, precision=f"*={fmt}", dtype="bfloat16")
    schedule = PrecisionSchedule.parse(f"*={fmt}")
    loaded = load_tensors(ckpt.plan(), ckpt.store, torch.bfloat16, "cpu", schedule)
    assert sum(info["precision_bytes"].values()) == sum(nbytes(t) for t in loaded.values())
    dense_bytes = sum(
        nbytes(t) for t in load_tensors(ckpt.plan(), ckpt.store, torch.bfloat16, "cpu").values()
    )
    assert sum(info["precision_bytes"].values()) < dense_bytes
    assert info["precision"]["attention"] == f"inherit/{fmt}" if fmt != "fp8" else "fp8/inherit"


def test_a_rule_that_can_pack_nothing_is_refused():
    specs = [TensorSpec("layers.0.attn.q_b.weight", (8, 24), "attention", 0)]
    with pytest.raises(ConfigError, match=r"q_b.*24.*32"):
        PrecisionSchedule.parse("attention=mxfp4").check(specs)
    PrecisionSchedule.parse("attention=fp8").check(specs)  # fp8 blocks take any K
    fits = specs + [TensorSpec("layers.0.attn.q_a.weight", (24, 64), "attention", 0)]
    s = PrecisionSchedule.parse("attention=nvfp4")
    s.check(fits)  # one of them fits: the other stays dense
    assert [s.resolve(x) for x in fits] == ["inherit", "nvfp4"]


def test_packing_load_peak_memory(tmp_path):
    raw = dict(ODD, num_hidden_layers=6, n_routed_experts=16, moe_intermediate_size=64)
    ckpt = Checkpoint.open(bf16_checkpoint(tmp_path, raw))
    dense = load_tensors(ckpt.plan(), ckpt.store, torch.bfloat16, "cpu")
    dense_bytes = sum(nbytes(t) for t in dense.values())
    largest = max(dense.values(), key=nbytes)
    largest_matrix = max(t[0].numel() if t.dim() == 3 else t.numel() for t in dense.values())
    del dense
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loaded = load_tensors(
            ckpt.plan(), ckpt.store, torch.bfloat16, "cpu", PrecisionSchedule.parse("*=mxfp4")
        )
    peak = peak_cpu_bytes(prof)
    final = sum(nbytes(t) for t in loaded.values())
    # what stays + one tensor dense + the encoder's fp32 temporaries of one matrix
    budget = final + nbytes(largest) + 8 * 4 * largest_matrix
    print(f"mxfp4 packing load: peak {peak} B, loaded {final} B, whole model dense (bf16) {dense_bytes} B")
    assert final < 0.5 * dense_bytes
    assert peak <= budget
    assert peak < dense_bytes  # never the whole model dense


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rdtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_moe_weighted_sum_keeps_the_loop_bits(wdtype, rdtype, tokens):
    g = torch.Generator().manual_seed(tokens)
    E, k, d, inter = 8, 4, 64, 32
    x = torch.randn(tokens, d, generator=g).to(wdtype)
    w_in = (torch.randn(E, 2 * inter, d, generator=g) * d**-0.5).to(wdtype)
    w_out = (torch.randn(E, d, inter, generator=g) * inter**-0.5).to(wdtype)
    weights = torch.rand(tokens, k, generator=g).to(rdtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)])
    got = run_experts(x, weights, ids, w_in, w_out)
    # the plain reference: each token's terms added in ascending expert id, one expert at a time
    ids_s, perm = ids.sort(dim=1)
    ws = weights.gather(1, perm)
    ref = torch.zeros(tokens, d, dtype=torch.promote_types(x.dtype, rdtype))
    for j in range(k):
        for t in range(tokens):
            e = int(ids_s[t, j])
            rows = (ids_s == e).any(1).nonzero().flatten()  # the expert's rows, as the grouped call sees them
            y = linear(swiglu(linear(x[rows], w_in[e])), w_out[e])
            r = int((rows == t).nonzero()[0, 0])
            ref[t] += (y[r : r + 1] * ws[t : t + 1, j : j + 1])[0]  # [1]-shaped: promotes as the block does
    assert torch.equal(got, ref.to(x.dtype))


def torch_sinkhorn(logits, iters, eps):
    """layers/mhc.py's Sinkhorn written as the plain torch loop (the kernel must give its bits)."""
    c = torch.softmax(logits.float(), dim=-1) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return c


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("iters, eps", [(20, 1e-6), (1, 1e-6), (7, 1e-3)])
def test_mhc_sinkhorn_kernel_keeps_the_torch_bits(n, iters, eps):
    from moesaic.kernels import cpu
    from moesaic.layers.mhc import sinkhorn

    calls = []
    real = cpu.sinkhorn_
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(1 + 3 * seed, n, n, generator=g) * (1 + seed % 5)
        c = torch.softmax(logits, dim=-1) + eps
        calls.append(real(c.clone(), iters, eps))
        assert torch.equal(sinkhorn(logits, iters, eps), torch_sinkhorn(logits, iters, eps))
    # the kernel serves up to 4 streams (where it was built), the torch loop the wider ones
    assert all(calls) == (n <= 4 and cpu.load() is not None) and (any(calls) or n > 4 or cpu.load() is None)


@pytest.mark.parametrize("name", ["demo-glm5-code", "demo-nemotron-h", "demo-kimi-linear", "demo-kimi-k3"])
def test_a_router_that_takes_fp32_logits_is_converted_once(name):
    """GLM-5.3, Nemotron-H, Kimi Linear and K3 take their router logits in fp32. A router held in bf16 (the
    model's dtype: transformers' bf16 model rounds it so too) is converted to fp32 at its first call and
    kept, not at every call (GLM-5.3-Flash's 288 x 4096 router: ~365 -> ~146 us a layer and step on one
    core); the same values, so the same tokens as an engine whose routers are converted every call."""
    from moesaic.layers import moe

    ps = ["def main(", "import os\n"]
    sp = moesaic.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm = moesaic.LLM(name, dtype="bfloat16")
    got = [o.token_ids for o in llm.generate(ps, sp)]
    found = moe_layers(llm.model)  # the decoder's (a draft head's MoE runs only when drafting)
    assert found and all(w.router_f32 is not None and w.router_f32.dtype == torch.float32 for w in found)
    assert all(torch.equal(w.router_f32, w.router.float()) for w in found)
    kept = [w.router_f32 for w in found]
    llm.generate(ps, sp)
    assert all(w.router_f32 is k for w, k in zip(found, kept))  # not made again
    # converted at every call (the code before): the same tokens
    real = moe.route

    def every_call(x, w, r, token_ids=None):
        w.router_f32 = None
        return real(x, w, r, token_ids)

    fresh = moesaic.LLM(name, dtype="bfloat16")
    try:
        moe.route = every_call
        want = [o.token_ids for o in fresh.generate(ps, sp)]
    finally:
        moe.route = real
    assert got == want


def test_stacked_products_keep_each_products_bits():
    """layers/linear RowStack: weights of one input stacked by rows give, at decode sizes (the kernels), the
    bits of their separate products at every row count (each output row of the kernels is its own sum),
    dense bf16 and fp8 blocks alike; where the kernels do not take x (more rows), `products` runs them one by
    one."""
    from moesaic.kernels import cpu
    from moesaic.layers.linear import products, replacement, stack_rows
    from moesaic.weights.quant import QuantizedTensor, from_suffix_dict, quantize_fp8_block

    def quantize(w, fmt, block):
        return from_suffix_dict(quantize_fp8_block(w, block), format=fmt)

    g = torch.Generator().manual_seed(3)
    dense = [torch.randn(n, 256, generator=g).to(torch.bfloat16) for n in (37, 1, 128, 6)]
    fp8 = [quantize(torch.randn(n, 256, generator=g), "fp8_block", block=(128, 128)) for n in (256, 128)]
    odd = quantize(torch.randn(32, 256, generator=g), "fp8_block", block=(128, 128))  # a partial block
    stacks = stack_rows([dense[0], None, fp8[0], odd, *dense[1:], fp8[1]])
    assert [s.sizes for s in stacks] == [(37, 1, 128, 6), (256, 128)]
    swap = replacement(stacks)
    assert id(odd) not in swap and len(swap) == 6
    for w in dense:
        p = swap[id(w)]
        assert (
            torch.equal(p, w)
            and p.untyped_storage().data_ptr() == stacks[0].weight.untyped_storage().data_ptr()
        )
    for w in fp8:
        p = swap[id(w)]
        assert isinstance(p, QuantizedTensor) and torch.equal(
            p.codes.view(torch.uint8), w.codes.view(torch.uint8)
        )
        assert torch.equal(p.scale, w.scale)
        whole = stacks[1].weight  # views: no memory added
        assert p.codes.untyped_storage().data_ptr() == whole.codes.untyped_storage().data_ptr()
        assert p.scale.untyped_storage().data_ptr() == whole.scale.untyped_storage().data_ptr()
    with torch.inference_mode():
        for m in (1, 2, 3, 5, 8, 16, 40):
            x = torch.randn(m, 256, generator=g).to(torch.bfloat16)
            lin = products(x, stacks)
            for w in [*dense, *fp8, odd]:
                p = swap.get(id(w), w)
                assert torch.equal(lin(p), linear(x, w)), (m, tuple(w.shape))
            assert (stacks[0].products(x) is not None) == (m <= cpu.dense_rows() and cpu.available())
    assert stack_rows([dense[0]]) == ()  # nothing to stack
    assert stack_rows([dense[0], dense[1].float()]) == ()  # fp32 keeps its own calls
    assert stack_rows([dense[0], torch.randn(3, 100).to(torch.bfloat16)]) == ()  # another width


@pytest.mark.parametrize("name", ["demo-deepseek-v4", "demo-deepseek-v41"])
def test_stacked_attention_inputs_give_the_same_tokens(name, monkeypatch):
    """DeepSeek-V4 / V4.1 take q_a, kv and the compressors' projections of the layer input from stacked
    products at decode sizes: the same tokens as the separate products (bf16, where the kernels run)."""
    from moesaic.layers import linear as lin_mod
    from moesaic.models import deepseek_v4, deepseek_v41

    ps = ["def main(", "import os\n"]
    sp = moesaic.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm = moesaic.LLM(name, dtype="bfloat16")
    assert any(L.attn.x_stacks for L in llm.model.layers)
    served = []
    real = lin_mod.RowStack.products
    monkeypatch.setattr(
        lin_mod.RowStack, "products", lambda self, x: served.append(x.shape[0]) or real(self, x)
    )
    got = [o.token_ids for o in llm.generate(ps, sp)]
    assert served and min(served) <= 2  # the decode rows took the stacks
    apart = lambda x, stacks: lin_mod.products(x, ())  # noqa: E731
    monkeypatch.setattr(deepseek_v4, "products", apart)
    monkeypatch.setattr(deepseek_v41, "products", apart)
    want = [o.token_ids for o in llm.generate(ps, sp)]
    assert got == want


def test_half_precision_products_run_in_fp32_without_a_native_bf16_gemm(monkeypatch):
    """layers/linear.matmul: a bf16 product past SMALL_PRODUCT runs in fp32, rounded once, on a CPU without a
    native bf16 GEMM (oneDNN's took 6.1 of a 1024-token prefill's 10.1 s here), and in bf16 where AMX serves it;
    small products run in fp32 either way."""
    from moesaic.kernels import cpu
    from moesaic.layers import linear

    g = torch.Generator().manual_seed(3)
    a = torch.randn(8, 300, 512, generator=g).bfloat16()
    b = torch.randn(8, 512, 300, generator=g).bfloat16()
    assert a.numel() + b.numel() > linear.SMALL_PRODUCT
    monkeypatch.setattr(cpu, "native_bf16", lambda: False)
    assert linear.small_product(a, b)
    assert torch.equal(linear.matmul(a, b), torch.matmul(a.float(), b.float()).to(torch.bfloat16))
    monkeypatch.setattr(cpu, "native_bf16", lambda: True)
    assert not linear.small_product(a, b) and linear.small_product(a[:, :4, :64], b[:, :64, :4])
    assert torch.equal(linear.matmul(a, b), torch.matmul(a, b))
