"""Decode tokens/s of moesaic vs transformers `generate` on the same random Mistral-Small-4-shaped
model (~0.4B parameters), batch 1 and batch 8, in one run on this CPU.

    .venv/bin/python benchmarks/decode_vs_transformers.py [--dtype bfloat16] [--new 32] [--threads N]

Decode time is isolated as time(prompt + N new tokens) - time(prompt + 1 new token), for both
engines, so prefill cost cancels. Also prints the weight bytes one decode step must read and the
roofline it implies at the measured memory bandwidth.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import moesaic  # noqa: E402

SHAPE = dict(
    vocab_size=32768,
    hidden_size=1024,
    intermediate_size=2816,
    moe_intermediate_size=512,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=8,
    q_lora_rank=384,
    kv_lora_rank=128,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
    n_routed_experts=32,
    num_experts_per_tok=4,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    max_position_embeddings=32768,
    eos_token_id=2,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 8192,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "llama_4_scaling_beta": 0.1,
    },
)


def bandwidth_gbs() -> float:
    a = torch.empty(64 * 2**20 // 4, dtype=torch.float32).fill_(1)
    b = torch.empty_like(a)
    b.copy_(a)
    best = 1e9
    for _ in range(5):
        t = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t)
    return 2 * a.numel() * 4 / best / 1e9  # read + write


def active_bytes(cfg, dtype_bytes: int) -> int:
    """Weight bytes one decode token reads: everything but the inactive routed experts and the embedding table."""
    d, L = cfg["hidden_size"], cfg["num_hidden_layers"]
    H, q, kv = cfg["num_attention_heads"], cfg["q_lora_rank"], cfg["kv_lora_rank"]
    dq = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    attn = (
        d * q
        + q * H * dq
        + d * (kv + cfg["qk_rope_head_dim"])
        + kv * H * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"])
        + H * cfg["v_head_dim"] * d
    )
    I = cfg["moe_intermediate_size"]
    moe = cfg["n_routed_experts"] * d + (cfg["num_experts_per_tok"] + cfg["n_shared_experts"]) * 3 * d * I
    dense = 3 * d * cfg["intermediate_size"]
    k = cfg["first_k_dense_replace"]
    return (L * attn + k * dense + (L - k) * moe + cfg["vocab_size"] * d) * dtype_bytes


def time_hf(model, prompts, new):
    ids = torch.tensor(prompts)
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0, min_new_tokens=new, max_new_tokens=new)
    with torch.inference_mode():
        model.generate(ids, **dict(kw, min_new_tokens=1, max_new_tokens=2))  # warm-up
        t = time.perf_counter()
        model.generate(ids, **dict(kw, min_new_tokens=1, max_new_tokens=1))
        t1 = time.perf_counter() - t
        t = time.perf_counter()
        out = model.generate(ids, **kw)
        tn = time.perf_counter() - t
    assert out.shape[1] == ids.shape[1] + new
    return (new - 1) * len(prompts) / (tn - t1), out[:, ids.shape[1] :].tolist()


def time_moesaic(llm, prompts, new):
    sp = lambda n: moesaic.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)  # noqa: E731
    llm.generate(prompts, sp(2))  # warm-up
    t = time.perf_counter()
    llm.generate(prompts, sp(1))
    t1 = time.perf_counter() - t
    t = time.perf_counter()
    outs = llm.generate(prompts, sp(new))
    tn = time.perf_counter() - t
    return (new - 1) * len(prompts) / (tn - t1), [o.token_ids for o in outs]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    dtype = getattr(torch, args.dtype)
    cfg = transformers.Mistral4Config(**SHAPE)
    torch.manual_seed(0)
    hf = transformers.Mistral4ForCausalLM(cfg).to(dtype).eval()
    nparams = sum(p.numel() for p in hf.parameters())
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        llm = moesaic.LLM(d, dtype=args.dtype)
    g = torch.Generator().manual_seed(1)
    prompts8 = torch.randint(3, SHAPE["vocab_size"], (8, args.prompt_len), generator=g).tolist()
    bw = bandwidth_gbs()
    need = active_bytes(SHAPE, dtype.itemsize)
    print(
        f"model: Mistral-Small-4 shape, {nparams / 1e6:.0f}M parameters, {args.dtype}, "
        f"{torch.get_num_threads()} threads; prompt {args.prompt_len}, {args.new} new tokens"
    )
    print(
        f"memory bandwidth (copy): {bw:.1f} GB/s; one decode step reads >= {need / 1e6:.0f} MB of weights "
        f"-> roofline {bw * 1e9 / need:.1f} steps/s"
    )
    print(f"{'batch':>5} {'moesaic tok/s':>14} {'transformers tok/s':>19} {'ratio':>6}  same tokens")
    for batch in (1, 8):
        prompts = prompts8[:batch]
        ours, our_tokens = time_moesaic(llm, prompts, args.new)
        theirs, their_tokens = time_hf(hf, prompts, args.new)
        same = sum(a == b for a, b in zip(our_tokens, their_tokens))
        print(f"{batch:>5} {ours:>14.1f} {theirs:>19.1f} {ours / theirs:>6.2f}  {same}/{batch}")


if __name__ == "__main__":
    main()
