"""DFlash drafting (arXiv 2602.06036, "DFlash: Block Diffusion for Flash Speculative Decoding"; z-lab's
`DFlashDraftModel` layout, `z-lab/dflash` dflash/model.py): a few Qwen3-style layers that draft a whole
block at once, non-causally, from the target's own hidden states.

    c_j = RMSNorm(fc · concat[target layer i's output at row j, for i in target_layer_ids]; hidden_norm)
    block b = [t_a, MASK × (B - 1)] at positions a .. a + B - 1  (t_a: the newest committed token)
    x = E[b]                                                      (E, W: the TARGET's embedding and lm_head)
    each layer:  x̂ = RMSNorm(x; input_layernorm)
                 Q = rope(q_norm(q_proj x̂));  K = [rope(k_norm(k_proj c_j)) ; rope(k_norm(k_proj x̂))]
                 V = [v_proj c_j ; v_proj x̂]; x += o_proj(softmax(Q Kᵀ / sqrt(hd)) V)   (no causal mask)
                 x += down(silu(gate x̃) · up x̃),  x̃ = RMSNorm(x; post_attention_layernorm)
    drafts d_k = argmax W · RMSNorm(x_k; norm), k = 1 .. B - 1   (row 0, the anchor, predicts nothing)

(A DSpark drafter, spec/dspark.py, is this backbone with its rows shifted by one and two small heads.)

rope is Qwen3's (halves rotated) with `rope_theta`. The context K/V (each layer's own k_proj / v_proj of c)
depend only on committed rows, so they are cached per sequence and per layer; the block's K/V are computed
each round and never kept, so a rejected draft leaves nothing behind (z-lab crops its cache back to the
committed length; here the context cache only ever receives committed rows). Rows the target did not
compute (a prefix served by the prefix cache) have no features: the context starts after them.
`observe` only keeps the committed rows' tap features; the next `propose` that drafts for the sequence runs
them through fc and each layer's k / v, for every sequence it drafts for at once (a sequence that is not
drafting, e.g. turned off by the adaptive policy, costs a copy of its taps per step, not a drafter pass).
The trained demo's drafter (docs/train_demo.md §4) is exactly this.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..cache.state import TokenRows
from ..config import declared, positive, read_config, section
from ..errors import ConfigError
from ..layers.linear import linear
from ..layers.norms import rms_norm
from ..layers.rope import RopeConfig, cos_sin, inv_freq, rope_half
from ..weights.bind import Tensors
from ..weights.contract import Naming, TensorSpec, direct, load_tensors, plan_load
from ..weights.store import WeightStore
from .base import MAX_DEFERRED, Draft

WHERE = "the DFlash drafter's config.json"


@dataclass(frozen=True, kw_only=True)
class DFlashConfig:
    hidden_size: int = declared(check=positive)
    num_hidden_layers: int = declared(check=positive)
    num_attention_heads: int = declared(check=positive)
    num_key_value_heads: int = declared(check=positive)
    head_dim: int = declared(check=positive)
    intermediate_size: int = declared(check=positive)
    vocab_size: int = declared(check=positive)
    rms_norm_eps: float = declared(1e-6, check=positive)
    rope_theta: float = declared(1e7, check=positive)  # z-lab's default
    hidden_act: str = declared("silu")
    num_target_layers: int | None = declared(None, check=positive)
    draft_vocab_size: int | None = declared(None, check=positive)
    block_size: int  # dflash_config.block_size, else block_size, else 16
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    layer_types: tuple[str, ...]


def parse_config(raw: dict, where: str = WHERE) -> DFlashConfig:
    """The backbone's config. `mask_token_id` and `target_layer_ids` sit in `dflash_config` (z-lab) or at
    the top level (standalone DSpark drafters such as Kimi K3's `K3DSparkModel`)."""
    dc = section(raw, "dflash_config", where)
    block = dc.get("block_size", raw.get("block_size", 16))
    if not isinstance(block, int) or isinstance(block, bool) or block < 2:
        raise ConfigError(f"{where}: field 'block_size' must be an integer >= 2, got {block!r}")
    mask = dc.get("mask_token_id", raw.get("mask_token_id"))
    if not isinstance(mask, int) or isinstance(mask, bool) or mask < 0:
        raise ConfigError(f"{where}: field 'dflash_config.mask_token_id' must be a token id, got {mask!r}")
    taps = dc.get("target_layer_ids", raw.get("target_layer_ids"))
    if not isinstance(taps, list) or not taps or not all(isinstance(t, int) and t >= 0 for t in taps):
        raise ConfigError(
            f"{where}: field 'dflash_config.target_layer_ids' must be a list of layer indices, got {taps!r}"
        )
    n = raw.get("num_hidden_layers")
    types = raw.get("layer_types") or ["full_attention"] * (n if isinstance(n, int) else 0)
    if any(t != "full_attention" for t in types):
        raise ConfigError(
            f"{where}: field 'layer_types' is {types!r}; only full_attention drafter layers are supported "
            "(sliding-window drafter layers are not implemented)"
        )
    rope = raw.get("rope_scaling") or raw.get("rope_parameters")
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ConfigError(f"{where}: field 'rope_scaling' {rope!r} is not supported (plain rope only)")
    cfg = read_config(
        DFlashConfig,
        raw,
        where,
        block_size=block,
        mask_token_id=mask,
        target_layer_ids=tuple(taps),
        layer_types=tuple(types),
    )
    if cfg.hidden_act != "silu":
        raise ConfigError(f"{where}: field 'hidden_act' must be 'silu', got {cfg.hidden_act!r}")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ConfigError(
            f"{where}: field 'num_key_value_heads' ({cfg.num_key_value_heads}) must divide "
            f"num_attention_heads ({cfg.num_attention_heads})"
        )
    return cfg


def check_against_target(cfg: DFlashConfig, model, target_cfg, where: str = WHERE) -> None:
    """A ConfigError naming the drafter's field that does not fit the target."""
    d, vocab = target_cfg.hidden_size, target_cfg.vocab_size
    layers = len(model.layers)
    if cfg.hidden_size != d:
        raise ConfigError(
            f"{where}: field 'hidden_size' is {cfg.hidden_size}, the target's hidden size is {d}"
        )
    if cfg.vocab_size != vocab:
        raise ConfigError(
            f"{where}: field 'vocab_size' is {cfg.vocab_size}, the target's vocabulary is {vocab}"
        )
    if cfg.draft_vocab_size is not None and cfg.draft_vocab_size != vocab:
        raise ConfigError(
            f"{where}: field 'draft_vocab_size' is {cfg.draft_vocab_size}: drafters with a reduced vocabulary "
            f"are not supported (the target's is {vocab})"
        )
    if cfg.num_target_layers is not None and cfg.num_target_layers != layers:
        raise ConfigError(
            f"{where}: field 'num_target_layers' is {cfg.num_target_layers}, the target has {layers} layers"
        )
    bad = [t for t in cfg.target_layer_ids if t >= layers]
    if bad:
        raise ConfigError(
            f"{where}: field 'dflash_config.target_layer_ids' names layers {bad}; the target has {layers}"
        )
    if cfg.mask_token_id >= vocab:
        raise ConfigError(
            f"{where}: field 'dflash_config.mask_token_id' is {cfg.mask_token_id}, outside the vocabulary ({vocab})"
        )


def tensor_specs(cfg: DFlashConfig) -> list[TensorSpec]:
    d, hd, I = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    specs = [
        TensorSpec("fc.weight", (d, len(cfg.target_layer_ids) * d), "draft"),
        TensorSpec("hidden_norm.weight", (d,), "norm"),
        TensorSpec("norm.weight", (d,), "norm"),
    ]
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        specs += [
            TensorSpec(p + "self_attn.q_proj.weight", (q, d), "attention", i),
            TensorSpec(p + "self_attn.k_proj.weight", (kv, d), "attention", i),
            TensorSpec(p + "self_attn.v_proj.weight", (kv, d), "attention", i),
            TensorSpec(p + "self_attn.o_proj.weight", (d, q), "attention", i),
            TensorSpec(p + "self_attn.q_norm.weight", (hd,), "norm", i),
            TensorSpec(p + "self_attn.k_norm.weight", (hd,), "norm", i),
            TensorSpec(p + "mlp.gate_proj.weight", (I, d), "mlp", i),
            TensorSpec(p + "mlp.up_proj.weight", (I, d), "mlp", i),
            TensorSpec(p + "mlp.down_proj.weight", (d, I), "mlp", i),
            TensorSpec(p + "input_layernorm.weight", (d,), "norm", i),
            TensorSpec(p + "post_attention_layernorm.weight", (d,), "norm", i),
        ]
    return specs


NAMING = Naming(
    "z-lab DFlash",
    lambda spec: direct(spec.name, spec.shape),
    [r"(model\.)?embed_tokens\.weight", r"lm_head\.weight"],
)


@dataclass
class DraftLayer:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


class DFlashProposer:
    """The block backbone. `first_row`: the first block row that predicts a token (DFlash: 1, the anchor
    row 0 predicts nothing; a DSpark drafter, spec/dspark.py: 0, row j predicts the token after row j)."""

    method = "dflash"

    def __init__(self, model, cfg: DFlashConfig, t: Tensors, first_row: int = 1):
        self.cfg = cfg
        self.taps = cfg.target_layer_ids
        self.first_row = first_row
        self.max_k = cfg.block_size - first_row
        self.embed, self.lm_head = model.embed, model.lm_head
        self.dtype, self.device = model.dtype, model.device
        self.fc = t("fc.weight")
        self.hidden_norm = t("hidden_norm.weight")
        self.norm = t("norm.weight")
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            w = t.under(f"layers.{i}.")
            a, m = w.under("self_attn."), w.under("mlp.")
            self.layers.append(
                DraftLayer(
                    a("q_proj.weight"),
                    a("k_proj.weight"),
                    a("v_proj.weight"),
                    a("o_proj.weight"),
                    a("q_norm.weight"),
                    a("k_norm.weight"),
                    w("input_layernorm.weight"),
                    w("post_attention_layernorm.weight"),
                    m("gate_proj.weight"),
                    m("up_proj.weight"),
                    m("down_proj.weight"),
                )
            )
        self.freqs = inv_freq(RopeConfig(dim=cfg.head_dim, theta=cfg.rope_theta)).to(self.device)
        kv = cfg.num_key_value_heads * cfg.head_dim
        self.widths = {f"{x}{i}": kv for i in range(cfg.num_hidden_layers) for x in "kv"}
        self.context: dict[int, TokenRows] = {}  # per sequence: every layer's context K (roped) and V
        self.length: dict[int, int] = {}  # committed rows seen (the next anchor's position)
        # per sequence: (first position, tap features [m, taps * d]) of committed rows not yet in its context
        self.deferred: dict[int, list[tuple[int, torch.Tensor]]] = {}

    # -- math
    def _keys(self, w: DraftLayer, x: torch.Tensor, angles: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """Roped, normed keys and values [n, KV * hd] of rows x (context features or normed block rows);
        `angles`: cos_sin of the rows' positions."""
        c = self.cfg
        n = x.shape[0]
        k = rms_norm(linear(x, w.k).view(n, c.num_key_value_heads, c.head_dim), w.k_norm, c.rms_norm_eps)
        return rope_half(k, *angles).flatten(1), linear(x, w.v)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx_k: list, ctx_v: list
    ) -> torch.Tensor:
        """Non-causal GQA of S blocks at once: q [S * B, H, hd] over each block's context rows (ctx_k[j],
        ctx_v[j] [T_j, KV * hd]) then its own rows (k, v [S * B, KV * hd]) -> [S * B, H * hd]. The contexts
        are padded to the longest, the padding masked. The products and the softmax in fp32 whatever the
        dtype (the output rounded to it once): bf16 operands made torch's CPU matmul round each score to
        bf16 and run several times slower than fp32's on the same ~0.5M MACs a head group."""
        c, B = self.cfg, self.cfg.block_size
        KV, hd = c.num_key_value_heads, c.head_dim
        S, rep = len(ctx_k), c.num_attention_heads // c.num_key_value_heads
        T = max(x.shape[0] for x in ctx_k) + B
        keys = k.new_zeros(S, T, KV * hd, dtype=torch.float32)
        values = v.new_zeros(S, T, KV * hd, dtype=torch.float32)
        masked = torch.zeros(S, T, dtype=torch.bool, device=k.device)
        for j, (ck, cv) in enumerate(zip(ctx_k, ctx_v)):
            n = ck.shape[0]
            keys[j, :n], values[j, :n] = ck, cv
            keys[j, n : n + B], values[j, n : n + B] = k[j * B : (j + 1) * B], v[j * B : (j + 1) * B]
            masked[j, n + B :] = True
        # each KV head's rep query heads over the block's B rows, as rep * B rows of that KV head
        q = q.float().view(S, B, KV, rep, hd).permute(0, 2, 3, 1, 4).reshape(S, KV, rep * B, hd)
        keys, values = keys.view(S, T, KV, hd).transpose(1, 2), values.view(S, T, KV, hd).transpose(1, 2)
        s = torch.matmul(q, keys.transpose(-1, -2)) * hd**-0.5  # [S, KV, rep * B, T]
        s = s.masked_fill(masked[:, None, None, :], float("-inf"))
        o = torch.matmul(torch.softmax(s, -1), values)  # [S, KV, rep * B, hd]
        return o.view(S, KV, rep, B, hd).permute(0, 3, 1, 2, 4).reshape(S * B, KV * rep * hd).to(v.dtype)

    # -- the interface
    def start(self, seq_id: int) -> None:
        self.context[seq_id] = TokenRows(self.widths, self.dtype, self.device, 1 << 40)
        self.length[seq_id] = 0
        self.deferred.pop(seq_id, None)

    def fork(self, parent: int, child: int) -> None:
        self._flush([parent])
        self.start(child)
        self.context[child].restore(self.context[parent].snapshot())
        self.length[child] = self.length[parent]

    @torch.inference_mode()
    def observe(self, seq_id: int, start: int, tokens: list[int], hidden: dict[int, torch.Tensor]) -> None:
        if start != self.length[seq_id]:
            raise ValueError(
                f"dflash: sequence {seq_id} has {self.length[seq_id]} rows, observe starts at {start}"
            )
        self.length[seq_id] = start + len(tokens)
        if not hidden:  # rows the target did not compute: no features for them
            return
        held = self.deferred.setdefault(seq_id, [])
        held.append((start, torch.cat([hidden[L].to(self.dtype) for L in self.taps], -1)))
        if sum(f.shape[0] for _, f in held) >= MAX_DEFERRED:  # a sequence that has not drafted for a while
            self._flush([seq_id])

    @torch.inference_mode()
    def _flush(self, seq_ids) -> None:
        """The deferred rows of `seq_ids` into their contexts: one fc and one k / v per layer for them all."""
        items = [(s, self.deferred.pop(s)) for s in seq_ids if self.deferred.get(s)]
        if not items:
            return
        c = self.cfg
        held = [x for _, rows in items for x in rows]
        feats = torch.cat([f for _, f in held])
        positions = torch.cat([torch.arange(p, p + f.shape[0]) for p, f in held]).to(self.device)
        ctx = rms_norm(linear(feats, self.fc), self.hidden_norm, c.rms_norm_eps)
        angles = cos_sin(self.freqs, positions)
        keys = [self._keys(w, ctx, angles) for w in self.layers]
        lo = 0
        for s, rows in items:
            hi = lo + sum(f.shape[0] for _, f in rows)
            add = {}
            for i, (k, v) in enumerate(keys):
                add[f"k{i}"], add[f"v{i}"] = k[lo:hi], v[lo:hi]
            self.context[s].append(**add)
            lo = hi

    @torch.inference_mode()
    def propose(self, requests: list[tuple[int, int, int]]) -> list[Draft]:
        # the rows past the longest draft are computed (the block attends to them) but not read
        longest = max(k for _, _, k in requests)
        drafts = linear(self.block_hidden(requests)[:, :longest], self.lm_head).argmax(-1)  # [S, longest]
        return [Draft(drafts[j, :k].tolist()) for j, (_, _, k) in enumerate(requests)]

    @torch.inference_mode()
    def block_logits(self, requests: list[tuple[int, int, int]]) -> torch.Tensor:
        """fp32 logits [S, max_k, vocab] of the predicting block rows for each (seq, last token, k)."""
        return linear(self.block_hidden(requests), self.lm_head).float()

    @torch.inference_mode()
    def block_hidden(self, requests: list[tuple[int, int, int]]) -> torch.Tensor:
        """The final-normed hidden [S, max_k, d] of block rows first_row .. B - 1 (what lm_head reads)."""
        c, B = self.cfg, self.cfg.block_size
        S = len(requests)
        self._flush([s for s, _, _ in requests])
        ids = torch.full((S, B), c.mask_token_id, dtype=torch.long, device=self.device)
        ids[:, 0] = torch.tensor([last for _, last, _ in requests], device=self.device)
        anchors = torch.tensor([self.length[s] for s, _, _ in requests], device=self.device)
        positions = (anchors[:, None] + torch.arange(B, device=self.device)).flatten()
        held = [self.context[s] for s, _, _ in requests]
        x = F.embedding(ids.flatten(), self.embed).to(self.dtype)  # [S * B, d]
        H, hd = c.num_attention_heads, c.head_dim
        angles = cos_sin(self.freqs, positions)  # the block's, for every layer's q and k
        for i, w in enumerate(self.layers):
            h = rms_norm(x, w.attn_norm, c.rms_norm_eps)
            q = rope_half(rms_norm(linear(h, w.q).view(S * B, H, hd), w.q_norm, c.rms_norm_eps), *angles)
            k, v = self._keys(w, h, angles)
            ctx_k = [t.bufs[f"k{i}"][: t.length] for t in held]
            out = self._attend(q, k, v, ctx_k, [t.bufs[f"v{i}"][: t.length] for t in held])
            x = x + linear(out, w.o)
            h = rms_norm(x, w.mlp_norm, c.rms_norm_eps)
            x = x + linear(F.silu(linear(h, w.gate)) * linear(h, w.up), w.down)
        x = x.view(S, B, -1)[:, self.first_row :]
        return rms_norm(x, self.norm, c.rms_norm_eps)

    def finish(self, seq_id: int) -> None:
        self.context.pop(seq_id, None)
        self.length.pop(seq_id, None)
        self.deferred.pop(seq_id, None)


def read_tensors(specs: list[TensorSpec], store: WeightStore, model, naming: Naming = NAMING) -> Tensors:
    """The drafter's tensors, checked against `specs` (one CheckpointError), in the target's dtype."""
    plan = plan_load(specs, store, naming)
    return Tensors(load_tensors(plan, store, model.dtype, model.device), plan.skipped_optional)


def open_folder(folder) -> WeightStore:
    """The drafter folder's store; a ConfigError naming the field when it holds no drafter config."""
    if not (Path(folder) / "config.json").is_file():
        raise ConfigError(
            f"speculative config: field 'model': {folder} has no config.json (not a drafter folder)"
        )
    return WeightStore(folder)


def load(model, target_cfg, folder) -> DFlashProposer:
    store = open_folder(folder)
    raw = store.config
    dc = raw.get("dflash_config") if isinstance(raw.get("dflash_config"), dict) else {}
    if dc.get("projector_type", raw.get("projector_type")) == "dspark" or dc.get(
        "markov_rank", raw.get("markov_rank")
    ):
        raise ConfigError(
            f"{WHERE}: fields 'projector_type' / 'markov_rank' say this is a DSpark drafter (its rows are "
            "shifted by one and it has a Markov head): use method 'dspark' with this folder"
        )
    cfg = parse_config(raw)
    check_against_target(cfg, model, target_cfg)
    tensors = read_tensors(tensor_specs(cfg), store, model)
    proposer = DFlashProposer(model, cfg, tensors)
    tensors.check_all_taken()
    return proposer


def make_proposer(model, cfg, spec, folder) -> DFlashProposer:
    return load(model, cfg, folder)
