"""Trains moesaic's demo model: a small GLM-5.3-Flash-shaped model (KDA + DSA + MoE inside mHC streams)
with its MTP layer, and a DFlash drafter for it, on the Python standard library's own source files.

    /work/main/.venv/bin/python scripts/train_demo.py --out DIR [--steps N] [--head-steps N] [--distill-steps N]
    /work/main/.venv/bin/python scripts/train_demo.py --out DIR --distill-from moesaic/demo/trained

Writes DIR/glm5-code (the target in the GLM-5.3 release layout: config.json, model.safetensors with the MTP
layer as layer `num_hidden_layers`, tokenizer.json, tokenizer_config.json, chat_template.jinja) and
DIR/glm5-code-dflash (the drafter in z-lab's DFlash layout). The exact math of both heads and the run's
numbers are in docs/train_demo.md.

1. A byte-level BPE tokenizer (`tokenizers`) with the GLM chat and tool-call markers as single tokens.
2. The trunk, trained as a causal LM in transformers' `glm5_next` modules (the oracle moesaic is tested
   against), with transformers' reference KDA kernel swapped for `kda_chunk` (the same recurrence in a
   faster chunked form, checked against it at start-up). index_topk >= the context, so DSA never drops a key
   while training. Routers are balanced without an auxiliary loss (DeepSeek-V3's bias update, arXiv
   2412.19437 §2.1.2). At the end every weight is rounded to what the checkpoint stores (bf16).
3. On the frozen trunk, together: the MTP layer (predicts token t+2 from embed(token t+1) and the trunk's
   hidden row t) and the DFlash drafter (arXiv 2602.06036: predicts tokens a+1..a+B-1 of a block
   [token a, MASK x (B-1)] from the tapped trunk features of rows < a). Both learn the trunk's own next-token
   distributions (soft targets), which is what acceptance measures.
4. Both heads again, on the trunk's own greedy text (`--distill-*`; `--distill-from DIR` runs only this
   phase, on the heads an earlier run wrote): moesaic generates the trunk's greedy continuations of training
   prompts, and the heads learn them where drafts are judged at T = 0, the MTP layer at depths 1..3 the way
   it recurses while drafting (its own output as the next hidden), DFlash on blocks anchored in them.
5. Held-out numbers: trunk loss, the heads' top-1 agreement with the trunk's greedy tokens, and the
   acceptance of real draft rounds against the trunk's greedy continuation.

One thread (torch.set_num_threads(1)); fixed seeds; the corpus is a sorted, fixed selection of the stdlib
files of the Python that runs the script (its version and byte count are recorded in config.json).
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import platform
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # the tokenizers trainer
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# ---------------------------------------------------------------- what is trained

SPECIAL_TOKENS = [  # ids 0.. in this order; GLM-4.5/5 chat, reasoning and tool-call markers
    "<|endoftext|>",
    "[MASK]",  # DFlash's mask token
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
]
EOT, MASK = 0, 1
EOS_IDS = [SPECIAL_TOKENS.index(t) for t in ("<|endoftext|>", "<|user|>", "<|observation|>")]
VOCAB = 4096

TEXT_CONFIG = {
    "model_type": "glm5_next_text",
    "vocab_size": VOCAB,
    "hidden_size": 192,
    "num_hidden_layers": 6,
    # KDA, KDA, DSA (full indexer), DSA (sharing its selection), KDA, DSA (full)
    "layer_types": [
        "linear_attention",
        "linear_attention",
        "indexed_attention",
        "indexed_attention",
        "linear_attention",
        "indexed_attention",
    ],
    "indexer_types": ["full", "full", "full", "shared", "full", "full"],  # read on DSA layers only
    "mlp_layer_types": ["dense", "sparse", "sparse", "sparse", "sparse", "sparse"],
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 96,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 48,
    "qk_rope_head_dim": 0,
    "v_head_dim": 48,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "swiglu_limit": 10.0,
    "index_topk": 512,  # = the training context: DSA keeps every key while training
    "index_n_heads": 16,
    "index_head_dim": 32,
    "index_kpool": 4,
    "index_kpool_always_select_tail": True,
    "linear_num_heads": 4,
    "linear_head_dim": 48,
    "linear_conv_kernel_dim": 4,
    "linear_lower_bound": -5.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "eos_token_id": EOS_IDS,
    "pad_token_id": EOT,
}

BLOCK = 8  # the drafter's block: the anchor + 7 drafts
TAPS = [1, 3, 5]  # trunk layers whose outputs (the mean over the mHC streams) feed the drafter
DRAFT_CONFIG = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "hidden_size": TEXT_CONFIG["hidden_size"],
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 48,
    "intermediate_size": 512,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "max_position_embeddings": 4096,
    "vocab_size": VOCAB,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "layer_types": ["full_attention", "full_attention"],
    "sliding_window": None,
    "use_sliding_window": False,
    "block_size": BLOCK,
    "num_target_layers": TEXT_CONFIG["num_hidden_layers"],
    "dflash_config": {"mask_token_id": MASK, "target_layer_ids": TAPS, "block_size": BLOCK},
    "torch_dtype": "bfloat16",
}

# The stored dtype: bf16, except what transformers keeps in fp32 (`_keep_in_fp32_modules_strict`)
FP32_NAMES = ("e_score_correction_bias", "_conv1d.weight", "dt_bias", "A_log", "_base", "_scale")
FP32_MODULE_NAMES = ("e_score_correction_bias", "conv1d.weight", "dt_bias", "A_log", "_hc.base", "_hc.scale")

CHAT_TEMPLATE = """\
{#- GLM-4.5/4.7/5 markers: [gMASK]<sop> once, then <|system|> / <|user|> / <|assistant|> / <|observation|> turns;
    an assistant turn is <think>reasoning</think> then its text and <tool_call>name<arg_key>k</arg_key>
    <arg_value>v</arg_value></tool_call> calls; tool results go in <|observation|><tool_response>...</tool_response>. -#}
[gMASK]<sop>
{%- for m in messages -%}
{%- set content = m.content if m.content is string else '' -%}
{%- if m.role == 'system' -%}<|system|>{{ content }}
{%- elif m.role == 'user' -%}<|user|>{{ content }}
{%- elif m.role == 'assistant' -%}<|assistant|>
{%- set reasoning = m.reasoning_content if m.reasoning_content is string else '' -%}
{%- if '</think>' in content -%}
{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}
{%- set content = content.split('</think>')[-1] -%}
{%- endif -%}
<think>{{ reasoning.strip() }}</think>{{ content.strip() }}
{%- for tc in m.tool_calls or [] -%}
{%- set f = tc.function if tc.function is defined else tc -%}
<tool_call>{{ f.name }}
{%- for k, v in (f.arguments if f.arguments is mapping else {}).items() -%}
<arg_key>{{ k }}</arg_key><arg_value>{{ v if v is string else v | tojson }}</arg_value>
{%- endfor -%}
</tool_call>
{%- endfor -%}
{%- elif m.role == 'tool' or m.role == 'observation' -%}<|observation|><tool_response>{{ content }}</tool_response>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|assistant|><think>{{ '</think>' if enable_thinking is defined and not enable_thinking else '' }}
{%- endif -%}
"""

# ---------------------------------------------------------------- corpus

EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "encodings", "pydoc_data"}
HELDOUT_EVERY = 25  # every 25th file of the sorted list is held out


def corpus_files(root: Path) -> list[Path]:
    """The stdlib's *.py files sorted by their path under `root`, without installed packages, the test
    suites, the codec tables (encodings/) and pydoc's topic strings."""
    files = [p for p in root.rglob("*.py") if not set(p.relative_to(root).parts[:-1]) & EXCLUDED_DIRS]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def read_corpus(max_files: int | None = None):
    """[(relative path, text, held out?)] and a summary for the metadata; files that are not UTF-8 are
    skipped."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs, skipped = [], 0
    for i, p in enumerate(corpus_files(root)[:max_files]):
        try:
            text = p.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            skipped += 1
            continue
        docs.append((p.relative_to(root).as_posix(), text, i % HELDOUT_EVERY == HELDOUT_EVERY - 1))
    info = {
        "python": platform.python_version(),
        "stdlib": str(root),
        "selection": f"sorted *.py under the stdlib, without {sorted(EXCLUDED_DIRS)}; every "
        f"{HELDOUT_EVERY}th file held out",
        "files": len(docs),
        "bytes": sum(len(t.encode()) for _, t, _ in docs),
        "skipped_not_utf8": skipped,
        "heldout_files": [n for n, _, h in docs if h],
        "heldout_bytes": sum(len(t.encode()) for _, t, h in docs if h),
    }
    return docs, info


def chat_examples(text: str, per_file: int = 3) -> list[str]:
    """A few chat turns per file, in the chat template's format: the user asks for a function by its
    signature and docstring's first line, the assistant answers with the function's source."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        src = ast.get_source_segment(text, node)
        if not doc or not src or len(src) > 1500:
            continue
        first = doc.strip().splitlines()[0].strip()
        args = ", ".join(a.arg for a in node.args.args)
        out.append(
            f"[gMASK]<sop><|user|>Write a Python function `{node.name}({args})`: {first}"
            f"<|assistant|><think></think>{textwrap.dedent(src).strip()}<|endoftext|>"
        )
        if len(out) == per_file:
            break
    return out


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    return tok


def split_documents(docs) -> tuple[list[str], list[str], int]:
    """(training documents: each training file, then every file's chat turns; held-out files; the number of
    chat turns) from read_corpus's (name, text, held out) triples, each in GLM's document markers."""
    chats = {n: chat_examples(t) for n, t, _ in docs}
    train = [f"[gMASK]<sop>{t}<|endoftext|>" for n, t, h in docs if not h]
    train += [c for n, _, h in docs if not h for c in chats[n]]
    held = [f"[gMASK]<sop>{t}<|endoftext|>" for n, t, h in docs if h]
    return train, held, sum(len(chats[n]) for n, _, h in docs if not h)


def token_stream(tok, docs: list[str]) -> torch.Tensor:
    ids = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids.extend(enc.ids)
    return torch.tensor(ids, dtype=torch.int32)


def windows(stream: torch.Tensor, T: int) -> torch.Tensor:
    n = len(stream) // T
    return stream[: n * T].view(n, T).long()


# ---------------------------------------------------------------- KDA for training

_HF_CHUNK_KDA = None


def kda_chunk(
    query,
    key,
    value,
    g,
    beta,
    chunk_size=16,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    **kwargs,
):
    """transformers' `chunk_kimi_delta_attention` (same signature and result), in a form that trains
    fast on a CPU: chunks of 16, the intra-chunk products as matmuls and the WY system solved by a
    triangular solve instead of a Python loop of row updates.

    Per head, state S [dk, dv]: S_t = diag(exp g_t) S_{t-1}; S_t += k_t (beta_t (v_t - S_t^T k_t))^T;
    o_t = S_t^T q_t. Within a chunk with cumulative decays G_i = sum_{s<=i} g_s (per key channel):
        M_ij = sum_c beta_i k_ic k_jc exp(G_ic - G_jc)  (j < i);   (I + M) [u | w] = [beta v | beta k exp(G)]
        o = (q exp(G)) S + A (u - w S),  A_ij = sum_c q_ic k_jc exp(G_ic - G_jc)  (j <= i)
        S' = diag(exp G_last) S + (k exp(G_last - G))^T (u - w S)
    exp(G_i - G_j) is factored around the chunk's middle row, so with g >= -5 per token no factor leaves
    [e^-40, e^40] (the masked upper triangle stays finite)."""
    dtype = query.dtype
    q, k, v, b, g = (x.transpose(1, 2).float() for x in (query, key, value, beta, g))  # [B, H, T, .]
    if use_qk_l2norm_in_kernel:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    B, H, T, dk = k.shape
    dv = v.shape[-1]
    C = chunk_size
    pad = (-T) % C
    q = F.pad(q, (0, 0, 0, pad)) * dk**-0.5
    k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (k, v, g))
    b = F.pad(b, (0, pad))
    n = (T + pad) // C
    q, k, v, g = (x.reshape(B, H, n, C, x.shape[-1]) for x in (q, k, v, g))
    b = b.reshape(B, H, n, C, 1)
    G = g.cumsum(-2)
    Gm = G - G[..., C // 2 : C // 2 + 1, :]
    k_out = (k * (-Gm).exp()).transpose(-1, -2)
    kb = k * b
    M = ((kb * Gm.exp()) @ k_out).tril(-1)
    A = ((q * Gm.exp()) @ k_out).tril(0)
    eye = torch.eye(C, device=q.device)
    X = torch.linalg.solve_triangular(
        eye + M, torch.cat([v * b, kb * G.exp()], -1), upper=False, unitriangular=True
    )
    u, w = X[..., :dv], X[..., dv:]
    qe, kl, gl = q * G.exp(), k * (G[..., -1:, :] - G).exp(), G[..., -1, :].exp()
    S = q.new_zeros(B, H, dk, dv) if initial_state is None else initial_state.float()
    outs = []
    for i in range(n):
        vn = u[:, :, i] - w[:, :, i] @ S
        outs.append(qe[:, :, i] @ S + A[:, :, i] @ vn)
        S = S * gl[:, :, i, :, None] + kl[:, :, i].transpose(-1, -2) @ vn
    o = torch.stack(outs, 2).reshape(B, H, n * C, dv)[:, :, :T]
    return o.transpose(1, 2).contiguous().to(dtype), (S if output_final_state else None)


def use_fast_kda(on: bool = True) -> None:
    """Swaps transformers' reference chunked KDA for `kda_chunk` (or back)."""
    global _HF_CHUNK_KDA
    from transformers.models.glm5_next import modeling_glm5_next as hf

    if _HF_CHUNK_KDA is None:
        _HF_CHUNK_KDA = hf.chunk_kimi_delta_attention
    hf.chunk_kimi_delta_attention = kda_chunk if on else _HF_CHUNK_KDA


def check_kda_chunk() -> float:
    """kda_chunk against transformers' token recurrence, with decays near the -5 bound and a start state."""
    from transformers.models.glm5_next import modeling_glm5_next as hf

    g0 = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 77, 3, 16, generator=g0) for _ in range(3))
    g = -5 * torch.sigmoid(3 * torch.randn(2, 77, 3, 16, generator=g0))
    beta = torch.sigmoid(torch.randn(2, 77, 3, generator=g0))
    s0 = torch.randn(2, 3, 16, 16, generator=g0)
    kw = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ref, ref_s = hf.recurrent_kimi_delta_attention(q, k, v, g, beta, **kw)
    got, got_s = kda_chunk(q, k, v, g, beta, **kw)
    err = max((got - ref).abs().max().item(), (got_s - ref_s).abs().max().item())
    if err > 1e-4:
        raise RuntimeError(f"kda_chunk differs from transformers' KDA recurrence by {err:.2e}")
    return err


# ---------------------------------------------------------------- the trunk, the MTP layer, the drafter


def hf_text_config(text: dict, **changes):
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

    cfg = Glm5NextTextConfig(**{k: v for k, v in {**text, **changes}.items() if k != "model_type"})
    cfg._attn_implementation = "sdpa"
    return cfg


class Trunk(nn.Module):
    """transformers' Glm5NextTextModel + lm_head. forward returns the logits, the hidden that feeds the
    final norm (the mean over the mHC streams of the last layer) and the drafter's taps."""

    def __init__(self, text: dict):
        super().__init__()
        from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextModel

        self.model = Glm5NextTextModel(hf_text_config(text))
        # transformers zeroes the pad row and freezes it; the pad here (<|endoftext|>) is a real token
        self.model.embed_tokens.padding_idx = None
        nn.init.normal_(self.model.embed_tokens.weight, std=0.02)
        self.lm_head = nn.Linear(text["hidden_size"], text["vocab_size"], bias=False)
        nn.init.normal_(self.lm_head.weight, std=0.02)
        self._seen = {}
        self.model.hc_head.register_forward_hook(lambda m, i, o: self._seen.__setitem__("h", o))
        for L in TAPS:
            self.model.layers[L].register_forward_hook(lambda m, i, o, L=L: self._seen.__setitem__(L, o[0]))

    def forward(self, ids: torch.Tensor):
        self._seen.clear()
        post = self.model(input_ids=ids).last_hidden_state
        taps = [self._seen[L].mean(dim=2) for L in TAPS]  # [B, T, d] each: the stream mean of layer L
        return self.lm_head(post), self._seen["h"], taps

    @property
    def embed(self) -> nn.Embedding:
        return self.model.embed_tokens


class MTPLayer(nn.Module):
    """GLM-5.3's MTP layer (stored as layer num_hidden_layers), module names = the checkpoint's:
        x = eh_proj([enorm(e), hnorm(h)])                 e = embed(token r+1), h = the trunk's hidden row r
        x = x + self_attn(input_layernorm(x))             DSA with its own full indexer, NoPE, causal
        x = x + mlp(post_attention_layernorm(x))          MoE (sigmoid router + bias, shared expert)
        logits = lm_head(shared_head.norm(x))             the trunk's lm_head; predicts token r+2
    forward returns x (the hidden a deeper draft step feeds back as h)."""

    def __init__(self, text: dict):
        super().__init__()
        from transformers.models.glm5_next import modeling_glm5_next as hf

        cfg = hf_text_config(
            text,
            num_hidden_layers=1,
            layer_types=["indexed_attention"],
            indexer_types=["full"],
            mlp_layer_types=["sparse"],
        )
        d, eps = text["hidden_size"], text["rms_norm_eps"]
        self.enorm, self.hnorm = hf.Glm5NextTextRMSNorm(d, eps), hf.Glm5NextTextRMSNorm(d, eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.input_layernorm = hf.Glm5NextTextRMSNorm(d, eps)
        self.post_attention_layernorm = hf.Glm5NextTextRMSNorm(d, eps)
        self.self_attn = hf.Glm5NextTextAttention(cfg, 0)
        self.mlp = hf.Glm5NextTextMoE(cfg)
        self.shared_head = nn.Module()
        self.shared_head.norm = hf.Glm5NextTextRMSNorm(d, eps)
        with torch.no_grad():  # modules built outside a PreTrainedModel leave some weights uninitialised
            for name, p in self.named_parameters():
                if p.dim() >= 2 and "index_kpool" not in name:
                    p.normal_(0.0, 0.02)

    def init_from(self, trunk: Trunk, layer: int) -> None:
        """Attention and MoE weights from a trunk DSA layer with a full indexer; eh_proj = [I | I] / 2."""
        src = trunk.model.layers[layer]
        with torch.no_grad():
            self.self_attn.load_state_dict(src.self_attn.state_dict())
            self.mlp.load_state_dict(src.mlp.state_dict())
            self.input_layernorm.load_state_dict(src.input_layernorm.state_dict())
            self.post_attention_layernorm.load_state_dict(src.post_attention_layernorm.state_dict())
            d = self.eh_proj.weight.shape[0]
            self.eh_proj.weight.copy_(torch.cat([torch.eye(d), torch.eye(d)], 1) / 2)

    def forward(self, e: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(h)], -1))
        valid = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
        x = x + self.self_attn(self.input_layernorm(x), attention_mask=valid)[0]
        return x + self.mlp(self.post_attention_layernorm(x))


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x):
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Qwen3's RoPE (halves rotated, not interleaved). x [B, N, H, hd], pos [B, N]."""
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=x.device) / hd)
    ang = pos.float()[..., None] * inv  # [B, N, hd/2]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, :, None], torch.cat([ang, ang], -1).sin()[:, :, None]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class DraftAttention(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        d, H, KV, hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        self.H, self.KV, self.hd, self.theta = H, KV, hd, c["rope_theta"]
        self.q_proj, self.k_proj = nn.Linear(d, H * hd, bias=False), nn.Linear(d, KV * hd, bias=False)
        self.v_proj, self.o_proj = nn.Linear(d, KV * hd, bias=False), nn.Linear(H * hd, d, bias=False)
        self.q_norm, self.k_norm = RMSNorm(hd, c["rms_norm_eps"]), RMSNorm(hd, c["rms_norm_eps"])

    def forward(self, x, ctx, pos_x, pos_ctx, mask):
        """Queries from the block rows x; keys/values from [ctx rows; block rows]; mask [B, Nx, Nctx+Nx]."""
        B, N, _ = x.shape
        kv_in = torch.cat([ctx, x], 1)
        pos_kv = torch.cat([pos_ctx, pos_x], 1)
        q = rope(self.q_norm(self.q_proj(x).view(B, N, self.H, self.hd)), pos_x, self.theta)
        k = rope(self.k_norm(self.k_proj(kv_in).view(B, -1, self.KV, self.hd)), pos_kv, self.theta)
        v = self.v_proj(kv_in).view(B, -1, self.KV, self.hd)
        rep = self.H // self.KV
        k, v = (t.repeat_interleave(rep, dim=2).transpose(1, 2) for t in (k, v))
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask[:, None])
        return self.o_proj(o.transpose(1, 2).reshape(B, N, -1))


class DraftMLP(nn.Module):
    def __init__(self, d: int, inter: int):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(d, inter, bias=False), nn.Linear(d, inter, bias=False)
        self.down_proj = nn.Linear(inter, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.self_attn = DraftAttention(c)
        self.mlp = DraftMLP(c["hidden_size"], c["intermediate_size"])
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])

    def forward(self, x, ctx, pos_x, pos_ctx, mask):
        x = x + self.self_attn(self.input_layernorm(x), ctx, pos_x, pos_ctx, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """z-lab's DFlashDraftModel layout (module names = the checkpoint's): ctx = hidden_norm(fc(taps));
    every layer attends from the block rows to [ctx rows; block rows] (K/V of the ctx rows come straight
    from ctx, not from the layer's input norm); the output goes through norm, then the target's lm_head."""

    def __init__(self, c: dict):
        super().__init__()
        d = c["hidden_size"]
        self.fc = nn.Linear(len(c["dflash_config"]["target_layer_ids"]) * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, c["rms_norm_eps"])
        self.layers = nn.ModuleList(DraftLayer(c) for _ in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(d, c["rms_norm_eps"])
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, taps: torch.Tensor, block_emb, pos_ctx, pos_block, mask) -> torch.Tensor:
        ctx = self.hidden_norm(self.fc(taps))
        x = block_emb
        for layer in self.layers:
            x = layer(x, ctx, pos_block, pos_ctx, mask)
        return self.norm(x)


def draft_blocks(ids: torch.Tensor, anchors: torch.Tensor, embed: nn.Embedding, T_ctx: int):
    """Block inputs for anchors [B, M] (each block sees ctx rows j < its anchor and its own B rows):
    (block embeddings [B, M*BLOCK, d], block positions, ctx positions, mask [B, M*BLOCK, T_ctx + M*BLOCK])."""
    B, M = anchors.shape
    off = torch.arange(BLOCK, device=ids.device)
    tokens = torch.full((B, M, BLOCK), MASK, dtype=torch.long, device=ids.device)
    tokens[:, :, 0] = ids.gather(1, anchors)
    pos_block = (anchors[:, :, None] + off).reshape(B, M * BLOCK)
    pos_ctx = torch.arange(T_ctx, device=ids.device).expand(B, T_ctx)
    ctx_ok = torch.arange(T_ctx, device=ids.device)[None, None, :] < anchors[:, :, None]  # [B, M, T]
    ctx_ok = ctx_ok[:, :, None, :].expand(B, M, BLOCK, T_ctx).reshape(B, M * BLOCK, T_ctx)
    blk = torch.arange(M, device=ids.device).repeat_interleave(BLOCK)
    same = (blk[:, None] == blk[None, :]).expand(B, M * BLOCK, M * BLOCK)
    return embed(tokens.view(B, M * BLOCK)), pos_block, pos_ctx, torch.cat([ctx_ok, same], -1)


# ---------------------------------------------------------------- the DSA indexers


@torch.no_grad()
def attention_pool_mass(attn, x: torch.Tensor, P: int) -> torch.Tensor:
    """The causal attention of a DSA layer on its input x [B, S, d] (every key kept, as in training),
    averaged over heads and summed per pool of P keys: [B, S, S // P]."""
    B, S, _ = x.shape
    qr = attn.q_a_layernorm(attn.q_a_proj(x))
    q = attn.q_b_proj(qr).view(B, S, attn.num_heads, attn.qk_head_dim).transpose(1, 2)
    latent = attn.kv_a_layernorm(attn.kv_a_proj_with_mqa(x)[..., : attn.kv_lora_rank])
    k = attn.kv_b_proj(latent).view(B, S, attn.num_heads, -1)[..., : attn.qk_nope_head_dim].transpose(1, 2)
    causal = torch.ones(S, S, dtype=torch.bool, device=x.device).tril()
    p = (
        (q @ k.transpose(-1, -2) * attn.scaling)
        .float()
        .masked_fill(~causal, float("-inf"))
        .softmax(-1)
        .mean(1)
    )
    n = S // P
    return p[..., : n * P].reshape(B, S, n, P).sum(-1)


def indexer_scores(attn, x: torch.Tensor) -> torch.Tensor:
    """transformers' Glm5NextTextIndexer pool scores [B, S, S // P] for an unpadded x, differentiable
    (transformers computes them under no_grad): k-pool keys = per-channel softmax over each pool's P slots
    of (gate x + ape) weighting LayerNorm(wk x); score = sum_h w_h relu(q_h . key * c^-0.5)."""
    ix = attn.indexer
    B, S, _ = x.shape
    P, c = ix.index_kpool, ix.head_dim
    n = S // P
    qr = attn.q_a_layernorm(attn.q_a_proj(x))
    q = ix.wq_b(qr).view(B, S, ix.n_heads, c).float()
    k = ix.k_norm(ix.wk(x))[:, : n * P].reshape(B, n, P, c).float()
    z = F.linear(x, ix.index_kpool_compress_gate)[:, : n * P].reshape(B, n, P, c).float()
    keys = (torch.softmax(z + ix.index_kpool_compress_ape.float(), dim=2) * k).sum(2)  # [B, n, c]
    scores = F.relu(torch.einsum("bshc,bnc->bshn", q, keys) * ix.softmax_scale)
    w = ix.weights_proj(x).float() * ix.n_heads**-0.5
    return torch.einsum("bsh,bshn->bsn", w, scores)


class IndexerDistill:
    """The DSA indexers learn which pools their layers attend to (DeepSeek-V3.2's dense warm-up, arXiv
    2512.02556 §2.1, in GLM-5.3's k-pool form): for query t, the cross-entropy between the attention mass
    of the complete pools ending at or before t (averaged over the heads of the layer and of the shared
    layers that reuse its selection) and the softmax of the indexer's scores over those pools. Only the
    indexers learn from it (the selection they feed is not differentiable; below index_topk it keeps all)."""

    def __init__(self, trunk: Trunk, mtp: MTPLayer, text: dict):
        self.P = text["index_kpool"]
        layers, self.inputs, self.groups = trunk.model.layers, {}, []
        for L, kind in enumerate(text["layer_types"]):
            if kind != "indexed_attention":
                continue
            if text["indexer_types"][L] == "full":
                self.groups.append((layers[L].self_attn, [layers[L].self_attn]))
            else:
                self.groups[-1][1].append(layers[L].self_attn)
        self.groups.append((mtp.self_attn, [mtp.self_attn]))
        self.hooks = [
            attn.register_forward_pre_hook(self._keep, with_kwargs=True)
            for _, group in self.groups
            for attn in group
        ]

    def _keep(self, module, args, kwargs):
        self.inputs[module] = (kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).detach()

    def params(self) -> list[nn.Parameter]:
        return [p for attn, _ in self.groups for p in attn.indexer.parameters()]

    def loss(self) -> torch.Tensor:
        """Mean over the groups of the per-query cross-entropy, on the inputs of the last forward."""
        total = 0.0
        for attn, group in self.groups:
            x = self.inputs[attn]
            mass = sum(attention_pool_mass(a, self.inputs[a], self.P) for a in group) / len(group)
            scores = indexer_scores(attn, x)
            S, n = scores.shape[1:]
            ok = (
                torch.arange(n, device=x.device)[None, :] * self.P + self.P - 1
                <= torch.arange(S, device=x.device)[:, None]
            )
            target = mass.masked_fill(~ok, 0.0)
            target = target / target.sum(-1, keepdim=True).clamp_min(1e-12)
            logp = scores.masked_fill(~ok, float("-inf")).log_softmax(-1).masked_fill(~ok, 0.0)
            total = total + (-(target * logp).sum(-1))[:, ok.any(-1)].mean()
        return total / len(self.groups)


def check_indexer_scores(trunk: Trunk, ids: torch.Tensor, text: dict) -> float:
    """indexer_scores picks the pools transformers' indexer picks (as sets, ties aside): run with a small
    index_topk on one trunk DSA layer. Returns the fraction of rows whose selections agree."""
    attn = next(layer.self_attn for layer in trunk.model.layers if getattr(layer.self_attn, "indexer", None))
    seen = {}
    hook = attn.register_forward_pre_hook(
        lambda m, a, kw: seen.__setitem__("x", kw["hidden_states"]), with_kwargs=True
    )
    topk, attn.indexer.index_topk = attn.indexer.index_topk, 8 * text["index_kpool"]
    try:
        with torch.no_grad():
            trunk(ids)
            x = seen["x"]
            qr = attn.q_a_layernorm(attn.q_a_proj(x))
            hf = attn.indexer(x, qr, torch.ones(x.shape[:2], dtype=torch.bool), None)  # [B, S, topk + P - 1]
            ours = indexer_scores(attn, x)
    finally:
        attn.indexer.index_topk = topk
        hook.remove()
    P, S = text["index_kpool"], x.shape[1]
    ok = torch.arange(ours.shape[-1])[None, :] * P + P - 1 <= torch.arange(S)[:, None]
    agree, rows = 0, 0
    for b in range(x.shape[0]):
        for t in range(9 * P, S, 7):  # rows with more complete pools than the 8 selected
            mine = set((ours[b, t].masked_fill(~ok[t], float("-inf")).topk(8).indices * P).tolist())
            # transformers lists the tokens of the selected pools, then the open pool's (the tail)
            theirs = {i for i in hf[b, t].tolist() if i >= 0 and i % P == 0 and i + P - 1 <= t}
            agree, rows = agree + (mine == theirs), rows + 1
    return agree / rows


# ---------------------------------------------------------------- losses and router balance


def soft_ce(logits: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against the teacher's distribution (= KL + the teacher's entropy), per row."""
    return -(F.softmax(teacher.float(), -1) * F.log_softmax(logits.float(), -1)).sum(-1)


class RouterBalance:
    """Aux-loss-free balance: after each step, e_score_correction_bias += rate * sign(mean load - load)."""

    def __init__(self, modules, rate: float = 2e-3):
        from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextTopkRouter

        self.routers = [m for mod in modules for m in mod.modules() if isinstance(m, Glm5NextTextTopkRouter)]
        self.counts = [None] * len(self.routers)
        self.rate = rate
        self.hooks = [
            r.register_forward_hook(lambda m, inp, out, i=i: self._count(i, out[2]))
            for i, r in enumerate(self.routers)
        ]

    def _count(self, i, idx):
        c = torch.bincount(idx.flatten(), minlength=self.routers[i].num_experts).float()
        self.counts[i] = c if self.counts[i] is None else self.counts[i] + c

    def reset(self) -> None:
        self.counts = [None] * len(self.routers)

    def step(self) -> float:
        """Applies the update; returns the worst max/mean load of the routings since the last reset."""
        worst = 0.0
        with torch.no_grad():
            for r, c in zip(self.routers, self.counts):
                if c is None:
                    continue
                r.e_score_correction_bias += self.rate * torch.sign(c.mean() - c)
                worst = max(worst, (c.max() / c.mean()).item())
        self.counts = [None] * len(self.routers)
        return worst


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup))))


def adamw(params, lr: float):
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
    )


# ---------------------------------------------------------------- training


def batches(train: torch.Tensor, batch: int, steps: int, g: torch.Generator):
    """(step, windows) for each step: the windows in a seeded random order, one permutation after another
    (drawn from g when the previous one runs out, so g's other draws in a step come after it)."""
    order = torch.randperm(len(train), generator=g)
    for step in range(steps):
        if (step + 1) * batch > len(order):
            order = torch.cat([order, torch.randperm(len(train), generator=g)])
        yield step, train[order[step * batch : (step + 1) * batch]]


def train_trunk(trunk: Trunk, train: torch.Tensor, held: torch.Tensor, a, log) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    params = [p for p in trunk.parameters() if p.requires_grad]
    opt = adamw(params, a.lr)
    balance = RouterBalance([trunk])
    curve, run, t0 = [], [], time.time()
    for step, ids in batches(train, a.batch, a.steps, g):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, a.steps, a.lr, a.warmup)
        balance.reset()
        logits, _, _ = trunk(ids)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        imbalance = balance.step()
        run.append(loss.item())
        if (step + 1) % a.eval_every == 0 or step + 1 == a.steps:
            row = {
                "step": step + 1,
                "train": sum(run) / len(run),
                "heldout": trunk_loss(trunk, held),
                "max_expert_load": imbalance,
            }
            curve.append(row)
            run = []
            el = time.time() - t0
            log(
                f"trunk step {step + 1}/{a.steps} train {row['train']:.3f} held-out {row['heldout']:.3f} "
                f"load max/mean {imbalance:.2f}  {el / 60:.1f} min, ETA {el / (step + 1) * (a.steps - step - 1) / 60:.1f} min"
            )
    for hook in balance.hooks:
        hook.remove()
    return curve


@torch.no_grad()
def trunk_loss(trunk: Trunk, held: torch.Tensor, bs: int = 4) -> float:
    tot, n = 0.0, 0
    for i in range(0, len(held), bs):
        ids = held[i : i + bs]
        logits, _, _ = trunk(ids)
        tot += F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum").item()
        n += ids[:, 1:].numel()
    return tot / n


def head_losses(
    trunk: Trunk, mtp: MTPLayer, drafter: DFlashDrafter, ids: torch.Tensor, anchors: torch.Tensor
):
    """The two heads' soft losses on one batch, and their top-1 agreement with the trunk's greedy tokens.
    MTP row r: (embed(ids[r+1]), h[r]) -> the trunk's distribution at row r+1 (for token r+2).
    Block anchor a, position k: the trunk's distribution at row a+k-1 (for token a+k)."""
    with torch.no_grad():
        logits, h, taps = trunk(ids)
    lm_head, embed = trunk.lm_head, trunk.embed
    # MTP
    x = mtp(embed(ids[:, 1:]), h[:, :-1])[:, :-1]  # rows 0..T-3
    m_logits = lm_head(mtp.shared_head.norm(x))
    teacher = logits[:, 1:-1]
    m_loss = soft_ce(m_logits, teacher).mean()
    m_agree = (m_logits.argmax(-1) == teacher.argmax(-1)).float().mean()
    per_pos, d_agree = dflash_losses(trunk, drafter, ids, anchors, logits, taps)
    return m_loss, m_agree, per_pos, d_agree


def dflash_losses(trunk: Trunk, drafter: DFlashDrafter, ids, anchors, logits, taps):
    """The drafter's soft loss and top-1 agreement by block position [BLOCK-1] over the blocks anchored at
    `anchors` [B, M]: position k against the trunk's row a+k-1 (`logits`, `taps`: the trunk's on ids)."""
    B, T = ids.shape
    emb, pos_b, pos_c, mask = draft_blocks(ids, anchors, trunk.embed, T)
    out = drafter(torch.cat(taps, -1), emb, pos_c, pos_b, mask).view(B, -1, BLOCK, emb.shape[-1])[:, :, 1:]
    d_logits = trunk.lm_head(out)  # [B, M, BLOCK-1, V]
    rows = anchors[:, :, None] + torch.arange(BLOCK - 1)  # row a+k-1 for k = 1..BLOCK-1
    d_teacher = logits.gather(1, rows.flatten(1)[..., None].expand(-1, -1, logits.shape[-1])).view_as(
        d_logits
    )
    per_pos = soft_ce(d_logits, d_teacher).mean((0, 1))
    return per_pos, (d_logits.argmax(-1) == d_teacher.argmax(-1)).float().mean((0, 1))


def dflash_weights(gamma: float) -> torch.Tensor:
    """DFlash's decaying loss weights over the block positions, exp(-(k-1) / gamma), normalised."""
    w = torch.exp(-torch.arange(BLOCK - 1, dtype=torch.float32) / gamma)
    return w / w.sum()


def sample_anchors(B: int, T: int, M: int, g: torch.Generator) -> torch.Tensor:
    """M distinct anchors per sequence in [1, T - BLOCK] (the block's last target is row T-1)."""
    return torch.stack([torch.randperm(T - BLOCK, generator=g)[:M] + 1 for _ in range(B)])


def train_heads(trunk, mtp, drafter, distill: IndexerDistill, train, held, a, log) -> list[dict]:
    g = torch.Generator().manual_seed(2)
    for p in distill.params():
        p.requires_grad_(True)  # the trunk's indexers learn here; the rest of the trunk stays frozen
    params = {id(p): p for m in (mtp, drafter) for p in m.parameters()}
    params = list((params | {id(p): p for p in distill.params()}).values())  # the MTP's indexer is in both
    opt = adamw(params, a.head_lr)
    balance = RouterBalance([mtp])
    weights = dflash_weights(a.gamma)
    held_anchors = sample_anchors(len(held), held.shape[1], a.anchors, torch.Generator().manual_seed(3))
    curve, run, t0 = [], [], time.time()
    for step, ids in batches(train, a.batch, a.head_steps, g):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, a.head_steps, a.head_lr, a.warmup)
        anchors = sample_anchors(len(ids), ids.shape[1], a.anchors, g)
        balance.reset()
        m_loss, _, per_pos, _ = head_losses(trunk, mtp, drafter, ids, anchors)
        d_loss = (per_pos * weights).sum()
        i_loss = distill.loss()
        (m_loss + d_loss + i_loss).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        balance.step()
        run.append((m_loss.item(), d_loss.item(), i_loss.item()))
        if (step + 1) % a.eval_every == 0 or step + 1 == a.head_steps:
            ev = heads_heldout(trunk, mtp, drafter, distill, held, held_anchors, weights)
            row = {
                "step": step + 1,
                "mtp_train": sum(r[0] for r in run) / len(run),
                "dflash_train": sum(r[1] for r in run) / len(run),
                "indexer_train": sum(r[2] for r in run) / len(run),
                **ev,
            }
            curve.append(row)
            run = []
            el = time.time() - t0
            log(
                f"heads step {step + 1}/{a.head_steps} MTP {row['mtp_train']:.3f}/{ev['mtp_heldout']:.3f} "
                f"(agree {ev['mtp_agree']:.3f}) DFlash {row['dflash_train']:.3f}/{ev['dflash_heldout']:.3f} "
                f"(agree {' '.join(f'{x:.2f}' for x in ev['dflash_agree'])}) indexer "
                f"{row['indexer_train']:.3f}/{ev['indexer_heldout']:.3f}  {el / 60:.1f} min"
            )
    for hook in balance.hooks:
        hook.remove()
    for p in distill.params():
        p.requires_grad_(False)
    return curve


@torch.no_grad()
def heads_heldout(trunk, mtp, drafter, distill, held, anchors, weights, bs: int = 4) -> dict:
    m_l, m_a, d_l, d_a, i_l, n = 0.0, 0.0, 0.0, torch.zeros(BLOCK - 1), 0.0, 0
    for i in range(0, len(held), bs):
        ml, ma, pp, da = head_losses(trunk, mtp, drafter, held[i : i + bs], anchors[i : i + bs])
        m_l, m_a, d_l, d_a, n = (
            m_l + ml.item(),
            m_a + ma.item(),
            d_l + (pp * weights).sum().item(),
            d_a + da,
            n + 1,
        )
        i_l += distill.loss().item()
    return {
        "mtp_heldout": m_l / n,
        "mtp_agree": m_a / n,
        "dflash_heldout": d_l / n,
        "dflash_agree": [round(x, 4) for x in (d_a / n).tolist()],
        "indexer_heldout": i_l / n,
    }


@torch.no_grad()
def sparse_context_loss(trunk: Trunk, long: torch.Tensor, topk: int, indexers: dict | None = None) -> float:
    """Held-out loss on windows longer than index_topk, so that DSA keeps topk // P pools (+ the tail):
    with the trunk's indexers as they are, or with `indexers` (state dicts by layer) put in for the run."""
    layers = [layer.self_attn for layer in trunk.model.layers if getattr(layer.self_attn, "indexer", None)]
    saved = [
        (m.indexer.index_topk, {k: v.clone() for k, v in m.indexer.state_dict().items()}) for m in layers
    ]
    try:
        for L, m in enumerate(layers):
            m.indexer.index_topk = topk
            if indexers is not None:
                m.indexer.load_state_dict(indexers[L])
        return trunk_loss(trunk, long, bs=2)
    finally:
        for m, (k, state) in zip(layers, saved):
            m.indexer.index_topk = k
            m.indexer.load_state_dict(state)


@torch.no_grad()
def draft_rounds(trunk, mtp, drafter, held: torch.Tensor, g: torch.Generator, n: int = 64) -> dict:
    """Real draft rounds: prompt = a held-out prefix of a tokens; the trunk's greedy continuation
    g0 g1 .. g7 (g0 is the token the target commits before drafting, the round's anchor); MTP drafts
    d1.. recursively (row a-1 = (embed(g0), h[a-1]); then (embed(d_i), its own previous output x)); the
    drafter drafts d1..d7 from the block [g0, MASK x 7]. Acceptance at k = P(d_1..d_k == g_1..g_k)."""
    W = held[torch.randperm(len(held), generator=g)[:n]]
    n, T = W.shape
    a = torch.randint(32, min(T - 2 * BLOCK, 256), (n,), generator=g)  # prompts of 32..255 tokens
    rows = torch.arange(n)
    buf = W.clone()
    chain = []
    for k in range(BLOCK):
        logits, h0, taps0 = trunk(buf[:, : int(a.max()) + k + 1])
        if k == 0:
            h, taps = h0, taps0
        tok = logits[rows, a - 1 + k].argmax(-1)
        buf[rows, a + k] = tok
        chain.append(tok)
    chain = torch.stack(chain, 1)  # g0..g7
    # DFlash: one block per prompt, ctx rows < a
    R = int(a.max())
    emb, pos_b, pos_c, mask = draft_blocks(buf, a[:, None], trunk.embed, R)
    out = drafter(torch.cat([t[:, :R] for t in taps], -1), emb, pos_c, pos_b, mask)
    d_drafts = trunk.lm_head(out[:, 1:]).argmax(-1)  # d1..d7
    # MTP, recursive: rows r <= a-1 from the trunk, deeper rows fed back from the layer's own output
    e_ids = buf.clone()
    hh = F.pad(h, (0, 0, 0, BLOCK))[:, : R + BLOCK].clone()
    m_drafts = []
    for j in range(1, BLOCK):
        x = mtp(trunk.embed(e_ids[:, 1 : R + BLOCK + 1]), hh)
        r = a - 2 + j  # the row that drafts d_j
        d = trunk.lm_head(mtp.shared_head.norm(x[rows, r])).argmax(-1)
        m_drafts.append(d)
        e_ids[rows, a + j] = d  # the next row's input token ...
        hh[rows, r + 1] = x[rows, r]  # ... and its hidden: this row's output
    m_drafts = torch.stack(m_drafts, 1)

    def curve(drafts):
        ok = (drafts == chain[:, 1:]).long().cumprod(1).float()
        return [round(x, 4) for x in ok.mean(0).tolist()]

    d_acc, m_acc = curve(d_drafts), curve(m_drafts)
    return {
        "rounds": n,
        "dflash_acceptance": d_acc,
        "dflash_tau": round(1 + sum(d_acc), 3),
        "mtp_acceptance": m_acc,
        "mtp_tau_k1": round(1 + m_acc[0], 3),
        "mtp_tau_k3": round(1 + sum(m_acc[:3]), 3),
    }


# ---------------------------------------------------------------- the heads on the trunk's own text


@torch.no_grad()
def greedy_sequences(folder: Path, train: torch.Tensor, n: int, g: torch.Generator, batch: int = 32):
    """n sequences of the training windows' length T: a prompt of 32..T/2 tokens (the start of a training
    window), then the trunk's greedy continuation to T tokens (EOS not stopping it), generated by moesaic
    from the written checkpoint `folder` in fp32; and where each continuation starts. At T = 0 drafts are
    judged against exactly this text, which the corpus is not: its tokens are not the trunk's argmax."""
    import moesaic  # the engine writes the heads' data (scripts may import the package)

    llm = moesaic.LLM(str(folder), dtype="float32")
    T = train.shape[1]
    seqs = train[torch.randint(len(train), (n,), generator=g)].clone()
    starts = torch.randint(32, T // 2 + 1, (n,), generator=g)
    for i in range(0, n, batch):
        rows = range(i, min(n, i + batch))
        prompts = [seqs[j, : starts[j]].tolist() for j in rows]
        params = [
            moesaic.SamplingParams(max_tokens=T - len(p), temperature=0.0, ignore_eos=True) for p in prompts
        ]
        for j, out in zip(rows, llm.generate(prompts, params)):
            seqs[j, starts[j] :] = torch.tensor(out.token_ids)
    return seqs, starts


def greedy_losses(trunk, mtp, drafter, ids, starts, anchors, depth: int):
    """The heads' soft losses on sequences whose tokens from `starts` on are the trunk's greedy text, on the
    rows whose target lies there. MTP at depth k = 1..depth is run the way it drafts: x_k at position p =
    layer(t_{p+k}, x_{k-1} at p), x_0 = the trunk's hidden, predicting token p+k+1 (teacher: the trunk's
    row p+k). DFlash blocks are anchored inside the continuation. Returns (MTP loss by depth, DFlash loss
    by block position, MTP top-1 agreement by depth, DFlash agreement by position)."""
    with torch.no_grad():
        logits, h, taps = trunk(ids)
    T = ids.shape[1]
    pos = torch.arange(T)
    x, m_loss, m_agree = h, [], []
    for k in range(1, depth + 1):
        x = mtp(trunk.embed(ids[:, k:]), x[:, :-1])  # length T - k
        m_logits = trunk.lm_head(mtp.shared_head.norm(x[:, :-1]))  # positions p = 0 .. T-k-2
        teacher = logits[:, k:-1]  # rows p + k
        keep = (pos[None, : T - k - 1] + k) >= starts[:, None]
        m_loss.append(soft_ce(m_logits, teacher)[keep].mean())
        m_agree.append((m_logits.argmax(-1) == teacher.argmax(-1))[keep].float().mean())
    d_loss, d_agree = dflash_losses(trunk, drafter, ids, anchors, logits, taps)
    return torch.stack(m_loss), d_loss, torch.stack(m_agree), d_agree


def continuation_anchors(starts: torch.Tensor, T: int, M: int, g: torch.Generator) -> torch.Tensor:
    """M distinct anchors per sequence in [start, T - BLOCK]: blocks whose anchor token is greedy text."""
    return torch.stack([torch.randperm(T - BLOCK - int(s) + 1, generator=g)[:M] + s for s in starts])


def distill_heads(trunk, mtp, drafter, seqs, starts, held, held_starts, a, log) -> list[dict]:
    """Fine-tunes both heads on the trunk's greedy text (greedy_losses), the trunk frozen: MTP by depth with
    weights 1, 0.8, 0.6, .., DFlash by position with its decaying weights; AdamW with the heads' schedule."""
    g = torch.Generator().manual_seed(7)
    params = [p for m in (mtp, drafter) for p in m.parameters() if p.requires_grad]
    opt = adamw(params, a.distill_lr)
    balance = RouterBalance([mtp])
    m_w = torch.tensor([1.0 - 0.2 * k for k in range(a.mtp_depth)])
    d_w = dflash_weights(a.gamma)
    T = seqs.shape[1]
    held_anchors = continuation_anchors(held_starts, T, a.anchors, torch.Generator().manual_seed(8))
    curve, run, t0 = [], [], time.time()
    order = torch.arange(len(seqs))
    for step, idx in batches(order, a.batch, a.distill_steps, g):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, a.distill_steps, a.distill_lr, a.warmup // 5)
        ids, st = seqs[idx], starts[idx]
        balance.reset()
        m_l, d_l, _, _ = greedy_losses(
            trunk, mtp, drafter, ids, st, continuation_anchors(st, T, a.anchors, g), a.mtp_depth
        )
        ((m_l * m_w).sum() + (d_l * d_w).sum()).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        balance.step()
        run.append((m_l.tolist(), (d_l * d_w).sum().item()))
        if (step + 1) % a.eval_every == 0 or step + 1 == a.distill_steps:
            ev = greedy_heldout(trunk, mtp, drafter, held, held_starts, held_anchors, a.mtp_depth, d_w)
            row = {
                "step": step + 1,
                "mtp_train": [round(sum(r[0][k] for r in run) / len(run), 4) for k in range(a.mtp_depth)],
                "dflash_train": round(sum(r[1] for r in run) / len(run), 4),
                **ev,
            }
            curve.append(row)
            run = []
            log(
                f"distill step {step + 1}/{a.distill_steps} MTP by depth {row['mtp_train']} / {ev['mtp_heldout']} "
                f"(agree {ev['mtp_agree']}) DFlash {row['dflash_train']:.3f}/{ev['dflash_heldout']:.3f} "
                f"(agree {ev['dflash_agree']})  {(time.time() - t0) / 60:.1f} min"
            )
    for hook in balance.hooks:
        hook.remove()
    return curve


@torch.no_grad()
def greedy_heldout(trunk, mtp, drafter, held, starts, anchors, depth, d_w, bs: int = 4) -> dict:
    parts = [
        greedy_losses(trunk, mtp, drafter, held[i : i + bs], starts[i : i + bs], anchors[i : i + bs], depth)
        for i in range(0, len(held), bs)
    ]
    mean = [sum(p[j] for p in parts) / len(parts) for j in range(4)]
    r = lambda t: [round(x, 4) for x in t.tolist()]  # noqa: E731
    return {
        "mtp_heldout": r(mean[0]),
        "dflash_heldout": (mean[1] * d_w).sum().item(),
        "mtp_agree": r(mean[2]),
        "dflash_agree": r(mean[3]),
    }


# ---------------------------------------------------------------- the checkpoint


def release_tensors(trunk: Trunk, mtp: MTPLayer, L: int) -> dict[str, torch.Tensor]:
    """transformers' module names -> GLM-5.3's release names (what moesaic's glm5next.checkpoint_naming
    reads): model.language_model.*, hc_attn_fn, q/k/v_conv1d, self_attn.f_a_proj, one tensor per expert;
    the MTP layer as layer L = num_hidden_layers; lm_head at the top."""
    sd = dict(trunk.model.state_dict())
    sd.update({f"layers.{L}.{k}": v for k, v in mtp.state_dict().items()})
    out = {"lm_head.weight": trunk.lm_head.weight.detach()}
    for name, t in sd.items():
        t = t.detach()
        for site, ck in (("attn_hc", "hc_attn"), ("ffn_hc", "hc_ffn")):
            for part in ("fn", "base", "scale"):
                name = name.replace(f".{site}.{part}", f".{ck}_{part}")
        name = "model.language_model." + name.replace("self_attn.forget_gate.", "self_attn.")
        if name.endswith("self_attn.conv1d.weight"):
            base = name[: -len("conv1d.weight")]
            for x, part in zip("qkv", t.chunk(3)):
                out[f"{base}{x}_conv1d.weight"] = part
        elif name.endswith("mlp.experts.gate_up_proj"):
            base, inter = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{base}{e}.up_proj.weight"] = t[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"{name[: -len('down_proj')]}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


def from_release(tensors: dict[str, torch.Tensor], text: dict):
    """The inverse of release_tensors: (trunk state dict for Glm5NextTextModel, lm_head, MTP state dict)."""
    L, p = text["num_hidden_layers"], "model.language_model."
    trunk, mtp, experts = {}, {}, {}
    for name, t in tensors.items():
        if name == "lm_head.weight":
            continue
        n = name[len(p) :]
        for site, ck in (("attn_hc", "hc_attn"), ("ffn_hc", "hc_ffn")):
            for part in ("fn", "base", "scale"):
                n = n.replace(f".{ck}_{part}", f".{site}.{part}")
        for part in ("f_a_proj", "f_b_proj", "dt_bias", "A_log"):
            n = n.replace(f"self_attn.{part}", f"self_attn.forget_gate.{part}")
        dest = mtp if n.startswith(f"layers.{L}.") else trunk
        if dest is mtp:
            n = n[len(f"layers.{L}.") :]
        if ".mlp.experts." in "." + n:
            base, e, kind = n.rsplit(".", 3)[0], int(n.rsplit(".", 3)[1]), n.rsplit(".", 3)[2]
            experts.setdefault((id(dest), base), (dest, {}))[1][(e, kind)] = t
        elif n.endswith("_conv1d.weight"):
            base = n[: -len("q_conv1d.weight")]
            dest.setdefault(base + "conv1d.parts", {})[n[-len("q_conv1d.weight")]] = t
        else:
            dest[n] = t
    for dest in (trunk, mtp):
        for key in [k for k in dest if k.endswith("conv1d.parts")]:
            parts = dest.pop(key)
            dest[key[: -len("parts")] + "weight"] = torch.cat([parts[x] for x in "qkv"])
    for (_, base), (dest, ex) in experts.items():
        E = 1 + max(e for e, _ in ex)
        dest[base + ".gate_up_proj"] = torch.stack(
            [torch.cat([ex[(e, "gate_proj")], ex[(e, "up_proj")]]) for e in range(E)]
        )
        dest[base + ".down_proj"] = torch.stack([ex[(e, "down_proj")] for e in range(E)])
    return trunk, tensors["lm_head.weight"], mtp


def stored_dtype(name: str) -> torch.dtype:
    return torch.float32 if name.endswith(FP32_NAMES) else torch.bfloat16


def round_to_stored(modules) -> None:
    """Rounds every parameter stored in bf16 in place, so that what is evaluated is what is shipped."""
    with torch.no_grad():
        for m in modules:
            for name, p in m.named_parameters():
                if not name.endswith(FP32_MODULE_NAMES):
                    p.copy_(p.to(torch.bfloat16).float())


def write_target(folder: Path, trunk, mtp, tok, meta: dict) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = release_tensors(trunk, mtp, TEXT_CONFIG["num_hidden_layers"])
    save_file(
        {k: v.to(stored_dtype(k)).contiguous() for k, v in sorted(tensors.items())},
        str(folder / "model.safetensors"),
        metadata={"format": "pt"},
    )
    config = {
        "architectures": ["Glm5NextForConditionalGeneration"],
        "model_type": "glm5_next",
        "text_config": TEXT_CONFIG,
        "tie_word_embeddings": False,
        "eos_token_id": EOS_IDS,
        "pad_token_id": EOT,
        "torch_dtype": "bfloat16",
        "moesaic_demo": meta,
    }
    (folder / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,  # GLM prompts open with [gMASK]<sop> (the chat template writes them)
                "add_bos_token": False,
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "mask_token": "[MASK]",
                "additional_special_tokens": SPECIAL_TOKENS[1:],
                "model_max_length": TEXT_CONFIG["max_position_embeddings"],
                "clean_up_tokenization_spaces": False,
            },
            indent=1,
        )
        + "\n"
    )
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def write_drafter(folder: Path, drafter: DFlashDrafter, meta: dict) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.detach().to(torch.bfloat16).contiguous() for k, v in sorted(drafter.state_dict().items())},
        str(folder / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (folder / "config.json").write_text(json.dumps({**DRAFT_CONFIG, "moesaic_demo": meta}, indent=1) + "\n")


def load_target(folder: Path):
    """(Trunk, MTPLayer, config) from a written target folder, in fp32 (for checks and tests)."""
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())
    text = config["text_config"]
    tensors = {k: v.float() for k, v in load_file(str(folder / "model.safetensors")).items()}
    sd, head, mtp_sd = from_release(tensors, text)
    trunk, mtp = Trunk(text), MTPLayer(text)
    trunk.model.load_state_dict(sd, strict=True)
    with torch.no_grad():
        trunk.lm_head.weight.copy_(head)
    mtp.load_state_dict(mtp_sd, strict=True)
    return trunk.eval(), mtp.eval(), config


def load_drafter(folder: Path) -> DFlashDrafter:
    from safetensors.torch import load_file

    c = json.loads((folder / "config.json").read_text())
    d = DFlashDrafter(c)
    d.load_state_dict({k: v.float() for k, v in load_file(str(folder / "model.safetensors")).items()})
    return d.eval()


def curves_markdown(trunk_curve: list[dict], head_curve: list[dict]) -> str:
    """The loss curves as markdown tables (mean loss in nats per predicted token)."""
    out = ["| trunk step | train | held-out | max/mean expert load |", "|---:|---:|---:|---:|"]
    out += [
        f"| {r['step']} | {r['train']:.3f} | {r['heldout']:.3f} | {r['max_expert_load']:.2f} |"
        for r in trunk_curve
    ]
    out += [
        "",
        "| head step | MTP train | MTP held-out | MTP agree | DFlash train | DFlash held-out | DFlash agree k=1..7 "
        "| indexer train | indexer held-out |",
        "|---:|---:|---:|---:|---:|---:|:---|---:|---:|",
    ]
    out += [
        f"| {r['step']} | {r['mtp_train']:.3f} | {r['mtp_heldout']:.3f} | {r['mtp_agree']:.3f} | "
        f"{r['dflash_train']:.3f} | {r['dflash_heldout']:.3f} | {' '.join(f'{x:.2f}' for x in r['dflash_agree'])} | "
        f"{r['indexer_train']:.3f} | {r['indexer_heldout']:.3f} |"
        for r in head_curve
    ]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------- main


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--steps", type=int, default=1400, help="trunk steps")
    ap.add_argument("--head-steps", type=int, default=600, help="MTP + DFlash steps on the frozen trunk")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--head-lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--anchors", type=int, default=32, help="DFlash blocks per sequence per step")
    ap.add_argument("--gamma", type=float, default=4.0, help="DFlash loss decay over block positions")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--heldout-windows", type=int, default=24)
    ap.add_argument("--max-files", type=int, default=None, help="a prefix of the corpus (for a quick try)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--distill-steps", type=int, default=300, help="both heads on the trunk's greedy text")
    ap.add_argument("--distill-seqs", type=int, default=400, help="greedy sequences generated for it")
    ap.add_argument("--distill-lr", type=float, default=5e-4)
    ap.add_argument("--mtp-depth", type=int, default=3, help="MTP recursion depths trained in that phase")
    ap.add_argument(
        "--distill-from",
        type=Path,
        help="run only that phase, on the heads an earlier run wrote to this folder (e.g. moesaic/demo/trained)",
    )
    ap.add_argument(
        "--trunk-from",
        type=Path,
        help="skip the trunk phase: the OUT/trunk.pt an earlier run of the same arguments wrote",
    )
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    t_start = time.time()
    log_lines = []

    def log(msg):
        line = f"[{(time.time() - t_start) / 60:6.1f} min] {msg}"
        log_lines.append(line)
        print(line, flush=True)

    use_fast_kda()
    log(f"kda_chunk vs transformers' KDA recurrence: max abs err {check_kda_chunk():.1e}")

    if a.distill_from is not None:
        distill_phase(a, a.distill_from, log, log_lines)
        return
    docs, corpus = read_corpus(a.max_files)
    train_docs, held_docs, n_chats = split_documents(docs)
    train_docs = shuffled(train_docs)
    corpus["chat_examples"] = n_chats
    log(f"corpus: {corpus['files']} files, {corpus['bytes']} bytes, {corpus['chat_examples']} chat turns")
    tok = train_tokenizer(train_docs)
    train_ids, held_ids = token_stream(tok, train_docs), token_stream(tok, held_docs)
    corpus["train_tokens"], corpus["heldout_tokens"] = len(train_ids), len(held_ids)
    train, held_all = windows(train_ids, a.context), windows(held_ids, a.context)
    held = heldout_sample(held_all, a.heldout_windows)
    log(
        f"tokenizer: {tok.get_vocab_size()} tokens; train {len(train_ids)} tokens ({len(train)} windows), held-out {len(held)} windows"
    )

    torch.manual_seed(a.seed)
    trunk = Trunk(TEXT_CONFIG)
    n_params = sum(p.numel() for p in trunk.parameters())
    log(f"trunk: {n_params / 1e6:.2f}M parameters")
    if a.trunk_from is None:
        trunk.train()
        trunk_curve = train_trunk(trunk, train, held, a, log)
        a.out.mkdir(parents=True, exist_ok=True)
        trunk_minutes = round((time.time() - t_start) / 60, 1)
        saved = {
            "state": trunk.state_dict(),
            "curve": trunk_curve,
            "tokenizer": tok.to_str(),
            "minutes": trunk_minutes,
        }
        torch.save(saved, a.out / "trunk.pt")
    else:
        saved = torch.load(a.trunk_from)
        if saved["tokenizer"] != tok.to_str():
            raise SystemExit(f"{a.trunk_from} was trained with another tokenizer (other corpus or arguments)")
        trunk.load_state_dict(saved["state"])
        trunk_curve, trunk_minutes = saved["curve"], saved.get("minutes")
        log(f"trunk from {a.trunk_from}")
    trunk.eval()
    round_to_stored([trunk])
    for p in trunk.parameters():
        p.requires_grad_(False)
    trunk_bf16 = trunk_loss(trunk, held)
    log(f"trunk held-out loss with the stored (bf16) weights: {trunk_bf16:.4f}")
    agree = check_indexer_scores(trunk, held[:2], TEXT_CONFIG)
    log(f"indexer_scores vs transformers' indexer: same top-8 pools on {agree:.0%} of the rows checked")
    if agree < 0.95:
        raise SystemExit("indexer_scores does not rank pools as transformers' indexer does")
    indexers_before = [
        {k: v.clone() for k, v in layer.self_attn.indexer.state_dict().items()}
        for layer in trunk.model.layers
        if getattr(layer.self_attn, "indexer", None)
    ]

    torch.manual_seed(a.seed + 1)
    mtp = MTPLayer(TEXT_CONFIG)
    mtp.init_from(trunk, layer=TEXT_CONFIG["num_hidden_layers"] - 1)
    drafter = DFlashDrafter(DRAFT_CONFIG)
    distill = IndexerDistill(trunk, mtp, TEXT_CONFIG)
    mtp.train()
    drafter.train()
    head_curve = train_heads(trunk, mtp, drafter, distill, train, held, a, log)
    mtp.eval()
    drafter.eval()
    round_to_stored([trunk, mtp, drafter])
    rounds = draft_rounds(trunk, mtp, drafter, held_all, torch.Generator().manual_seed(6))
    final_heads = heads_summary(trunk, mtp, drafter, distill, held, a)
    log(f"stored weights: {final_heads}")
    log(f"draft rounds: {rounds}")
    long = windows(held_ids, 2 * a.context)[: a.heldout_windows // 2]
    long_context = {
        "context": 2 * a.context,
        "index_topk": a.context // 2,
        "windows": len(long),
        "every_key": round(sparse_context_loss(trunk, long, 2 * a.context), 4),
        "indexer_trained": round(sparse_context_loss(trunk, long, a.context // 2), 4),
        "indexer_untrained": round(sparse_context_loss(trunk, long, a.context // 2, indexers_before), 4),
    }
    log(f"held-out loss beyond index_topk: {long_context}")

    run = {
        "script": "scripts/train_demo.py",
        "argv": sys.argv[1:] if argv is None else list(argv),
        "seed": a.seed,
        "torch": torch.__version__,
        "context": a.context,
        "batch": a.batch,
        "trunk_steps": a.steps,
        "head_steps": a.head_steps,
        "minutes": round((time.time() - t_start) / 60, 1),
        "trunk_phase_minutes": trunk_minutes,  # of the run that trained the trunk (up to trunk.pt)
    }
    meta = {
        "trained": True,
        "name": "glm5-code",
        "params": n_params,
        "mtp_params": sum(p.numel() for p in mtp.parameters()),
        "corpus": corpus,
        "run": run,
        "trunk_heldout_loss": round(trunk_bf16, 4),
        "heads_heldout": final_heads,
        "draft_rounds": rounds,
        "long_context": long_context,
        "mtp_hidden": "pre-final-norm trunk hidden (mean over the mHC streams of the last layer)",
        "drafter": "glm5-code-dflash",
    }
    write_target(a.out / "glm5-code", trunk, mtp, tok, meta)
    write_drafter(
        a.out / "glm5-code-dflash",
        drafter,
        {
            "trained": True,
            "target": "glm5-code",
            "params": sum(p.numel() for p in drafter.parameters()),
            "target_hidden": "per tap layer i: the mean over the hc_mult mHC streams of layer i's output",
            "heads_heldout": final_heads,
            "draft_rounds": rounds,
            "run": run,
        },
    )
    (a.out / "training_log.json").write_text(
        json.dumps({"trunk": trunk_curve, "heads": head_curve, "log": log_lines, "meta": meta}, indent=1)
        + "\n"
    )
    (a.out / "loss_curves.md").write_text(curves_markdown(trunk_curve, head_curve))
    log(f"written to {a.out}")
    if a.distill_steps > 0:
        distill_phase(a, a.out, log, log_lines)


def shuffled(train_docs: list[str]) -> list[str]:
    """A fixed shuffle of the training documents (files and chat turns) before packing."""
    perm = torch.randperm(len(train_docs), generator=torch.Generator().manual_seed(4)).tolist()
    return [train_docs[i] for i in perm]


def heldout_sample(held_all: torch.Tensor, n: int) -> torch.Tensor:
    return held_all[torch.randperm(len(held_all), generator=torch.Generator().manual_seed(5))[:n]]


def heads_summary(trunk, mtp, drafter, distill, held, a) -> dict:
    """The heads' held-out losses and agreement on real code (teacher-forced), as config.json records them."""
    anchors = sample_anchors(len(held), held.shape[1], a.anchors, torch.Generator().manual_seed(3))
    return heads_heldout(trunk, mtp, drafter, distill, held, anchors, dflash_weights(a.gamma))


def distill_phase(a, src: Path, log, log_lines) -> None:
    """Phase 4: the heads `src` holds, fine-tuned on the trunk's greedy text (greedy_sequences,
    distill_heads); the trunk is loaded and written back unchanged. Writes a.out like the full run."""
    from tokenizers import Tokenizer

    t0 = time.time()
    target = src / "glm5-code"
    trunk, mtp, config = load_target(target)
    drafter = load_drafter(src / "glm5-code-dflash")
    for p in trunk.parameters():
        p.requires_grad_(False)
    tok = Tokenizer.from_file(str(target / "tokenizer.json"))
    docs, _ = read_corpus(a.max_files)
    train_docs, held_docs, _ = split_documents(docs)
    train = windows(token_stream(tok, shuffled(train_docs)), a.context)
    held_all = windows(token_stream(tok, held_docs), a.context)
    before = draft_rounds(trunk, mtp, drafter, held_all, torch.Generator().manual_seed(6))
    log(f"distill: draft rounds of the heads in {src}: {before}")
    seqs, starts = greedy_sequences(target, train, a.distill_seqs, torch.Generator().manual_seed(9))
    held = heldout_sample(held_all, a.heldout_windows)
    held_seqs, held_starts = greedy_sequences(
        target, held, a.heldout_windows, torch.Generator().manual_seed(10)
    )
    gen_minutes = round((time.time() - t0) / 60, 1)
    log(f"distill: {len(seqs)} + {len(held_seqs)} greedy sequences generated in {gen_minutes} min")
    mtp.train()
    drafter.train()
    curve = distill_heads(trunk, mtp, drafter, seqs, starts, held_seqs, held_starts, a, log)
    mtp.eval()
    drafter.eval()
    round_to_stored([mtp, drafter])
    rounds = draft_rounds(trunk, mtp, drafter, held_all, torch.Generator().manual_seed(6))
    log(f"distill: draft rounds after: {rounds}")
    heads = heads_summary(trunk, mtp, drafter, IndexerDistill(trunk, mtp, TEXT_CONFIG), held, a)
    run = {
        "argv": sys.argv[1:],
        "steps": a.distill_steps,
        "sequences": a.distill_seqs,
        "lr": a.distill_lr,
        "mtp_depth": a.mtp_depth,
        "generation_minutes": gen_minutes,
        "minutes": round((time.time() - t0) / 60, 1),
        "draft_rounds_before": before,
        "greedy_heldout": curve[-1],
    }
    meta = {**config["moesaic_demo"], "heads_heldout": heads, "draft_rounds": rounds, "distill": run}
    write_target(a.out / "glm5-code", trunk, mtp, tok, meta)
    d_meta = json.loads((src / "glm5-code-dflash" / "config.json").read_text())["moesaic_demo"]
    write_drafter(
        a.out / "glm5-code-dflash",
        drafter,
        {**d_meta, "heads_heldout": heads, "draft_rounds": rounds, "distill": run},
    )
    log_file = src / "training_log.json"
    saved = json.loads(log_file.read_text()) if log_file.exists() else {}
    saved.update({"distill": curve, "meta": meta})
    # a full run's log_lines hold the earlier phases' lines too, which src's log already has otherwise
    saved["log"] = log_lines if src.resolve() == a.out.resolve() else saved.get("log", []) + log_lines
    (a.out / "training_log.json").write_text(json.dumps(saved, indent=1) + "\n")
    log(f"distill: written to {a.out}")


if __name__ == "__main__":
    main()
