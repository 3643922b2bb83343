"""Tiny checkpoints for the tests, written by transformers itself (the oracle) or by moesaic's writers,
and the few steps every family test takes with them."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from moesaic.cache.batch import ForwardBatch
from moesaic.weights.store import save_safetensors


def randomize_(model, seed: int = 0, std: float = 0.2) -> None:
    """Gives every parameter random values, including those transformers initialises to constants
    (norm gains = 1, router = 0), so that no path hides behind a constant."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.dim() == 1 and ("norm" in name or name.endswith("layernorm.weight")):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                fan_in = p.shape[-1] if p.dim() > 1 else 1
                p.copy_(torch.randn(p.shape, generator=g) * (std if p.dim() == 1 else fan_in**-0.5))


def calm_kda_(model, seed: int) -> None:
    """After `randomize_`: a Kimi-style model (or one KDA module) that is not chaotic. KDA decays
    mild (A_log ~ log U(0.5, 1.5), dt_bias ~ -4: a memory of ~10 tokens, so head outputs are rarely
    near zero before their RMSNorm), block outputs x0.25, embeddings of std 5, and a random router
    selection bias (a buffer, which `randomize_` skips)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.5, 1.5, generator=g).log())
            elif name.endswith("dt_bias"):
                p.copy_(-4 + 0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith(("o_proj.weight", "down_proj", "down_proj.weight")):
                p.mul_(0.25)
            elif name.endswith("embed_tokens.weight"):
                p.mul_(5.0 / p.std())
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def random_ids(n: int, vocab: int, seed: int = 0, low: int = 3) -> list[int]:
    """n token ids drawn from [low, vocab) with a fixed seed (ids below 3 are pad/bos/eos)."""
    return torch.randint(low, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def peak_cpu_bytes(prof) -> int:
    """The highest running total of CPU allocations in a torch.profiler trace (profile_memory=True): each op's
    own allocations (+) and frees (-) in time order (cpu_memory_usage would count nested ops twice)."""
    events = sorted(
        (e.time_range.start, e.self_cpu_memory_usage) for e in prof.events() if e.self_cpu_memory_usage
    )
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    return peak


def drafting_prompts(vocab: int, long: int = 100) -> list[list[int]]:
    """Prompts of different lengths for drafting tests; a repeated stretch gives the n-gram drafter matches,
    and the `long` one is still prefilling (budget 24) while the others verify."""
    seg = random_ids(10, vocab, seed=5)
    return [
        random_ids(9, vocab, seed=1) + seg + seg[:4],
        random_ids(33, vocab, seed=2),
        seg + random_ids(5, vocab, seed=3) + seg,
        random_ids(long, vocab, seed=4),
    ]


def run(model, chunks, logits="all", state=None, **state_kw):
    """Feeds `chunks` (lists of ids) to one sequence, one forward each, continuing `state` or a
    fresh `model.new_state(**state_kw)`. Returns (the logits of every forward concatenated, the state)."""
    st = state if state is not None else model.new_state(**state_kw)
    outs = [model.forward(ForwardBatch.build([(st, c)], logits=logits)) for c in chunks]
    return torch.cat(outs), st


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def check_greedy_matches_transformers(hf, path, ids: list[int], n: int) -> None:
    """moesaic's greedy tokens from the checkpoint at `path` equal transformers' `generate` on the
    model it was saved from, for n new tokens."""
    import moesaic

    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(ids) :].tolist()
    llm = moesaic.LLM(str(path), dtype="float32")
    out = llm.generate([ids], moesaic.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == ref and out.finish_reason == "length"


def check_batch_equals_singles(path, prompts: list[list[int]], max_tokens: int, max_batch_tokens: int):
    """The prompts generated together (split across steps by a small token budget) give the same
    greedy tokens as each generated alone. Returns the LLM for further checks."""
    import moesaic

    llm = moesaic.LLM(str(path), dtype="float32", max_batch_tokens=max_batch_tokens)
    sp = moesaic.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    together = llm.generate(prompts, sp)
    alone = [llm.generate([p], sp)[0] for p in prompts]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert all(len(o.token_ids) == max_tokens for o in together)
    return llm


def mixed_batch_err(model, a: list[int], b: list[int]) -> float:
    """One ForwardBatch holding the last token of `a` (decoding) and all of `b` (prefilling): the
    max abs error of each sequence's logits against running it alone."""
    ref_a, _ = run(model, [a], logits="last")
    ref_b, _ = run(model, [b], logits="last")
    sa, sb = model.new_state(), model.new_state()
    model.forward(ForwardBatch.build([(sa, a[:-1])]))
    got = model.forward(ForwardBatch.build([(sa, a[-1:]), (sb, b)]))
    return max(max_err(got[0], ref_a[0]), max_err(got[1], ref_b[0]))


def weights_of(obj):
    """Every weight (tensor, packed tensor) reachable from a model's bound layer structures
    (dataclasses, dicts, lists, tuples), for tests that look at what was loaded."""
    import dataclasses

    from moesaic.weights.quant import ConcatRows, QuantizedTensor

    if isinstance(obj, (torch.Tensor, QuantizedTensor, ConcatRows)):
        yield obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from weights_of(getattr(obj, f.name))
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from weights_of(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from weights_of(v)


@functools.cache
def demo_model(demo: str, dtype: str):
    """(Checkpoint, model) of a built-in demo, built once per test session."""
    from moesaic.demo import ensure_demo
    from moesaic.models import Checkpoint

    ck = Checkpoint.open(ensure_demo(demo))
    return ck, ck.build(dtype)


def check_state_bytes_exact(demo: str, dtype: str, window: int, T: int) -> tuple[int, int]:
    """The built-in demo `demo` in `dtype`: a sequence with rollback window `window` fed T tokens one
    per forward, and one fed them in a single prefill, hold exactly the bytes its family's planner says
    (per_token * T + fixed). Returns the planner's (per_token, fixed) for the caller's own checks."""
    ck, model = demo_model(demo, dtype)
    ids = random_ids(T, ck.cfg.vocab_size, seed=40)
    per_token, fixed = ck.family.state_bytes(ck.cfg, model.dtype.itemsize, rollback_window=window)
    for chunks in ([[t] for t in ids], [ids]):
        st = run(model, chunks, logits="last", rollback_window=window)[1]
        assert st.num_tokens == T and st.nbytes == per_token * T + fixed
    return per_token, fixed


def rounding_floor(model, chunks, draws: int = 2) -> torch.Tensor:
    """Per logit row [rows]: how far the logits of `chunks` (fed as `run` feeds them) move when every
    embedding entry changes by about one fp32 rounding step (times 1 + 2^-23 N(0, 1); the max over
    `draws` seeds). That is the model's sensitivity, row by row, to a single rounding of its input on
    this machine's kernels: two evaluations of one function that round differently (a chunked and a
    token-by-token pass) differ by a few of these."""
    ref, _ = run(model, chunks)
    emb, worst = model.embed, torch.zeros(ref.shape[0])
    try:
        for seed in range(draws):
            noise = torch.randn(emb.shape, generator=torch.Generator().manual_seed(seed))
            model.embed = emb * (1 + 2.0**-23 * noise)
            worst = torch.maximum(worst, (run(model, chunks)[0] - ref).abs().amax(-1))
    finally:
        model.embed = emb
    return worst


def run_cases_in_child(test_file: str, folder, env: dict) -> tuple[dict, str]:
    """Runs the `case_*` functions of `test_file` once in a child pytest with `env` (e.g. a Triton switch
    that must be set before triton is imported); ({test id: outcome}, the tail of its output)."""
    import subprocess
    import sys
    import xml.etree.ElementTree as ET
    from pathlib import Path

    xml = Path(folder) / "cases.xml"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        test_file,
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "python_functions=case_*",
    ]
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run(
        cmd + [f"--junitxml={xml}"], cwd=root, env=env, capture_output=True, text=True, timeout=600
    )
    outcomes = {}
    if xml.exists():
        for tc in ET.parse(xml).getroot().iter("testcase"):
            bad = [c.tag for c in tc if c.tag in ("failure", "error", "skipped")]
            outcomes[tc.get("name")] = bad[0] if bad else "passed"
    return outcomes, run.stdout[-6000:] + run.stderr[-2000:]


# ---------------------------------------------------------------- drafter checkpoints (spec tests)


def write_drafter(
    folder: Path, llm, taps, layers=2, heads=4, kv=2, head_dim=16, block=5, tensors=None, **overrides
) -> Path:
    """A random DFlash drafter (z-lab layout) for `llm`'s target; `tensors` (name -> tensor) are written
    too, `overrides` replace config fields (the DSpark drafters of tests/test_spec_dspark_external.py)."""
    d, vocab = llm.cfg.hidden_size, llm.cfg.vocab_size
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": d,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "intermediate_size": 48,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "vocab_size": vocab,
        "layer_types": ["full_attention"] * layers,
        "block_size": block,
        "num_target_layers": len(llm.model.layers),
        "dflash_config": {"mask_token_id": 1, "target_layer_ids": list(taps), "block_size": block},
    }
    config.update(overrides)
    g = torch.Generator().manual_seed(7)

    def w(*shape):
        return torch.randn(*shape, generator=g) * shape[-1] ** -0.5

    def n(size):
        return 1 + 0.1 * torch.randn(size, generator=g)

    t = {"fc.weight": w(d, len(taps) * d), "hidden_norm.weight": n(d), "norm.weight": n(d)}
    for i in range(layers):
        p = f"layers.{i}."
        t.update(
            {
                p + "self_attn.q_proj.weight": w(heads * head_dim, d),
                p + "self_attn.k_proj.weight": w(kv * head_dim, d),
                p + "self_attn.v_proj.weight": w(kv * head_dim, d),
                p + "self_attn.o_proj.weight": w(d, heads * head_dim),
                p + "self_attn.q_norm.weight": n(head_dim),
                p + "self_attn.k_norm.weight": n(head_dim),
                p + "mlp.gate_proj.weight": w(48, d),
                p + "mlp.up_proj.weight": w(48, d),
                p + "mlp.down_proj.weight": w(d, 48),
                p + "input_layernorm.weight": n(d),
                p + "post_attention_layernorm.weight": n(d),
            }
        )
    t.update(tensors or {})
    folder.mkdir(parents=True, exist_ok=True)
    save_safetensors(t, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def drafter_reference(folder: Path, model, committed: list[int], anchor: int) -> torch.Tensor:
    """The DFlash backbone (docs/train_demo.md §4) written out on a full recompute (no cache): the
    final-normed hidden [B, d] of every row of the block [anchor, MASK...] after the committed tokens,
    from a plain prefill's taps (DFlash drafts from rows 1 .. B - 1, a DSpark drafter from all B)."""
    from safetensors.torch import load_file

    c = json.loads((folder / "config.json").read_text())
    w = load_file(str(folder / "model.safetensors"))
    dc = c.get("dflash_config", {})
    B = dc.get("block_size", c["block_size"])
    mask = dc.get("mask_token_id", c.get("mask_token_id"))
    taps = dc.get("target_layer_ids", c.get("target_layer_ids"))
    H, KV, hd, eps = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["rms_norm_eps"]
    batch = ForwardBatch.build([(model.new_state(), committed)])
    batch.taps = tuple(taps)
    model.forward(batch)
    a = len(committed)

    def rms(x, g):
        return g * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))

    def rope(x, pos):  # x [n, h, hd]
        ang = pos.double()[:, None] * c["rope_theta"] ** (-torch.arange(0, hd, 2).double() / hd)
        cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
        rot = torch.cat([-x[..., hd // 2 :], x[..., : hd // 2]], -1)
        return (x.double() * cos + rot.double() * sin).float()

    ctx = rms(torch.cat([batch.tapped[L] for L in taps], -1) @ w["fc.weight"].T, w["hidden_norm.weight"])
    x = model.embed[torch.tensor([anchor] + [mask] * (B - 1))].float()
    pc, pb = torch.arange(a), torch.arange(a, a + B)
    for i in range(c["num_hidden_layers"]):
        p = f"layers.{i}."
        xh = rms(x, w[p + "input_layernorm.weight"])
        q = rope(
            rms((xh @ w[p + "self_attn.q_proj.weight"].T).view(B, H, hd), w[p + "self_attn.q_norm.weight"]),
            pb,
        )

        def kv(src, pos, n, p=p):
            k = rms(
                (src @ w[p + "self_attn.k_proj.weight"].T).view(n, KV, hd), w[p + "self_attn.k_norm.weight"]
            )
            return rope(k, pos), (src @ w[p + "self_attn.v_proj.weight"].T).view(n, KV, hd)

        kc, vc = kv(ctx, pc, a)
        kb, vb = kv(xh, pb, B)
        K, V = torch.cat([kc, kb]), torch.cat([vc, vb])
        o = torch.empty(B, H, hd)
        for h in range(H):
            g = h // (H // KV)
            o[:, h] = torch.softmax(q[:, h] @ K[:, g].T * hd**-0.5, -1) @ V[:, g]
        x = x + o.flatten(1) @ w[p + "self_attn.o_proj.weight"].T
        xt = rms(x, w[p + "post_attention_layernorm.weight"])
        mlp = F.silu(xt @ w[p + "mlp.gate_proj.weight"].T) * (xt @ w[p + "mlp.up_proj.weight"].T)
        x = x + mlp @ w[p + "mlp.down_proj.weight"].T
    return rms(x, w["norm.weight"])
