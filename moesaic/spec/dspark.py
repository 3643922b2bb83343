"""DSpark drafting (the semi-autoregressive drafter of arXiv 2607.05147: a parallel block backbone, a
low-rank Markov head over the previous token, a confidence head), in its two released forms: DeepSeek-V4.1's
own stages `mtp.{0,1,2}` (method "dspark" without a folder, `DsparkProposer`) and external drafter folders
for any target (method "dspark" with "model": a folder, `ExternalDsparkProposer`, see the second half).

V4.1's own stages. The stages are V4.1 blocks (delayed-pre mHC, window-only attention, their own MoE), run by the
family's own `Model.block`; what is DSpark's is their attention context and the heads. After the target
has consumed t_0 .. t_p and committed the next token y = t_{p+1}:

    c_j   = RMSNorm(main_proj · [hidden of target layer L at position j, for L in dspark_target_layer_ids];
                    main_norm)                          j <= p; the hidden is the layer's input streams' mean
    each stage keeps kv_j = rope(RMSNorm(c_j Wkv; kv_norm), j) of the last `sliding_window` positions
    block b = [y, noise x (B - 1)] at positions p+1 .. p+B, streams = copies of E[b]
    per stage: attention queries from the block rows only, keys = V = [kv_{p-W+1} .. kv_p ; the block's
               own kv rows] seen by every block row (no causal mask in the block), the stage's sinks
    x     = the streams collapsed by the last pre map;  u_i = lm_head(RMSNorm(x_i; norm))
    draft d_{i+1} = argmax(u_i + markov_head · markov_embed[prev_i]),  prev_0 = y, prev_i = d_i
    confidence_i = sigmoid(confidence_proj · [x_i ; markov_embed[prev_i]])   (the chance d_{i+1} is accepted)

so a round drafts B tokens for positions p+2 .. p+B+1 in one pass over the B rows. Sources (the release's
`inference/model.py` is not in moesaic; these public ports read it): the plain-torch port
`tests/dsv41_reference.py` of sfxnz/TensorFold (`absorb`, `propose`, `dspark_attention`), NVIDIA NeMo
AutoModel `nemo_automodel/components/models/deepseek_v41/dspark.py` (the training side: main_proj/main_norm
over the target states, stage ownership of the heads, the confidence head's input); docs/families/
deepseek_v41.md (the draft-head section) says which choices are moesaic's.

Which hidden is a target layer's: the mean of the streams entering layer L (after its Engram, which no
release target layer has), i.e. moesaic's tap of layer L - 1; a target layer 0 or an Engram layer is a
ConfigError. The rings hold committed rows only (drafted rows never enter), so nothing is rolled back.

External drafters (deepseek-ai/dspark_qwen3_8b_block7, Kimi K3's GQA drafters, speculators' and NeMo's
trainings): a DFlash backbone (spec/dflash.py: `fc` over the target's taps, `hidden_norm`, Qwen3-style layers
attending non-causally within the block, the TARGET's embedding and lm_head) whose block rows are shifted by
one, plus the two heads. With h_j the backbone's final-normed hidden of block row j (the block is
[t_a, MASK x (B - 1)] at positions a .. a + B - 1, t_a the newest committed token):

    z_j     = lm_head(h_j) + markov_w2 · markov_w1[prev_j]     prev_0 = t_a, prev_j = d_j (j >= 1)
    d_{j+1} = argmax z_j                                        j = 0 .. B - 1: row j drafts position a + j + 1
    conf_j  = sigmoid(proj · [h_j ; markov_w1[prev_j]] + bias)  (without the Markov part when
                                                                confidence_head_with_markov is false)

so a round drafts B tokens (`sample_from_anchor` false: the DFlash rows 1 .. B - 1, B - 1 tokens). Sources:
vLLM `vllm/model_executor/models/qwen3_dspark.py` (DSparkMarkovHead, DSparkConfidenceHead, the checkpoint's
`markov_head.markov_w1/w2`, `confidence_head.proj` with a bias, the target's embed/lm_head shared) and
`vllm/v1/worker/gpu/spec_decode/dspark/speculator.py` (anchor-as-first-prediction, the serial Markov walk,
prev_0 = the anchor); NVIDIA NeMo RL `nemo_rl/models/megatron/draft/dspark.py` and its pinned schema of
deepseek-ai/dspark_qwen3_8b_block7 (markov_w2 [draft_vocab, rank], proj [1, hidden + rank] and bias [1]);
the vLLM speculators DSpark guide (markov_rank 0 needs confidence_head_with_markov false). Taps: target layer
i is the output of decoder layer i (vLLM adds one to these ids for its aux-hidden-state indices, as for
DFlash), moesaic's `batch.tap(i, ...)`; on Kimi K3 that is the AttnRes "prefix" stream (the running partial
sum after layer i), the default of vLLM's K3 capture. docs/drafters.md says what is not supported.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..cache.state import TailRows
from ..errors import ConfigError
from ..layers import mhc
from ..layers.csa import RopeTail
from ..layers.linear import linear
from ..layers.norms import rms_norm_cast_once
from ..layers.rope import inv_freq
from ..models import deepseek_v41
from ..models.deepseek_v4 import attention_inputs, attention_kv, attention_output
from ..weights.bind import Tensors
from ..weights.contract import Naming, TensorSpec
from . import dflash
from .base import Draft
from .mtp import draft_count


def attend_all(q: torch.Tensor, keys: torch.Tensor, sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, H, D] over every key row keys [L, D] (K = V), one sink logit per head in the denominator."""
    n, H, _ = q.shape
    s = (torch.matmul(q, keys.t()) * scale).float()  # [n, H, L]
    logits = torch.cat([s, sinks.float().view(1, H, 1).expand(n, H, 1)], dim=-1)
    return torch.matmul(torch.softmax(logits, dim=-1)[..., :-1].to(q.dtype), keys)


@dataclass
class _Seq:
    rings: list[TailRows]  # per stage: the kv rows of the last `sliding_window` committed positions
    seen: int = 0  # target positions observed
    confidence: list[float] = field(default_factory=list)  # of the last drafts, one per drafted token


class DsparkProposer:
    """A DraftProposer (spec/base.py) over V4.1's bound DSpark stages (`Model.dspark`); greedy drafts
    (probs None). `confidence(seq_id)` gives the confidence head's estimates for the last drafts."""

    method = "dspark"

    def __init__(self, model: deepseek_v41.Model, max_k: int):
        c, self.model, self.w = model.cfg, model, model.dspark
        self.ds, self.max_k = c.dspark, max_k
        self.taps = tuple(L - 1 for L in self.ds.target_layer_ids)
        self.rope = RopeTail(inv_freq(c.rope_main).to(model.device), c.rope_main_factor)  # ratio 0: main rope
        router = dataclasses.replace(model.moe.router, top_k=self.ds.num_experts_per_tok)
        self.moe = dataclasses.replace(model.moe, router=router)
        self.seqs: dict[int, _Seq] = {}

    def start(self, seq_id: int) -> None:
        W, m = self.model.cfg.sliding_window, self.model
        rings = [TailRows({"kv": m.cfg.head_dim}, m.dtype, m.device, W, W) for _ in self.w.stages]
        self.seqs[seq_id] = _Seq(rings)

    def finish(self, seq_id: int) -> None:
        self.seqs.pop(seq_id, None)

    def confidence(self, seq_id: int) -> list[float]:
        return self.seqs[seq_id].confidence

    def context(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        """c [m, d] of committed rows from the target's taps."""
        m, eps = self.model, self.model.cfg.rms_norm_eps
        x = torch.cat([hidden[L].to(device=m.device, dtype=m.dtype) for L in self.taps], dim=-1)
        return rms_norm_cast_once(linear(x, self.w.main_proj), self.w.main_norm, eps)

    def fork(self, parent: int, child: int) -> None:
        """A parallel sample of `parent` (n > 1): `child` starts with its context rows."""
        p = self.seqs[parent]
        self.start(child)
        for ring, src in zip(self.seqs[child].rings, p.rings):
            ring.restore(src.snapshot())
        self.seqs[child].seen = p.seen

    @torch.inference_mode()
    def observe(self, seq_id: int, start: int, tokens: list[int], hidden: dict[int, torch.Tensor]) -> None:
        s = self.seqs[seq_id]
        if start != s.seen:
            raise ValueError(f"sequence {seq_id}: observe at position {start}, the drafter has seen {s.seen}")
        if not hidden:  # rows the target did not compute (a prefix-cache hit): no context rows for them
            s.seen = start + len(tokens)
            return
        c = self.context(hidden)
        pos = torch.arange(start, start + c.shape[0], device=c.device)
        for ring, stage in zip(s.rings, self.w.stages):
            ring.append(kv=attention_kv(stage.attn, c, self.model.cfg, self.rope, pos))
        s.seen = start + c.shape[0]

    def stage_attention(
        self, stage, x: torch.Tensor, pos: torch.Tensor, rings: list[TailRows]
    ) -> torch.Tensor:
        """One stage's attention for the packed blocks x [N·B, d] at `pos`, block j over rings[j]."""
        cfg, B = self.model.cfg, self.ds.block_size
        _, q, kv = attention_inputs(stage.attn, x, cfg, self.rope, pos, cfg.q_head_norm)
        out = torch.empty_like(q)
        for j, ring in enumerate(rings):
            r = slice(j * B, (j + 1) * B)
            keys = torch.cat([ring.rows()["kv"], kv[r]])
            out[r] = attend_all(q[r], keys, stage.attn.sinks, cfg.head_dim**-0.5)
        return attention_output(stage.attn, out, cfg, self.rope, pos)

    @torch.inference_mode()
    def block_logits(self, seqs: list[_Seq], firsts: list[int]):
        """The backbone over one block per sequence: (base logits u [N, B, V] fp32, collapsed x [N, B, d])."""
        m, w, B = self.model, self.w, self.ds.block_size
        N, dev = len(seqs), m.device
        ids = torch.full((N, B), self.ds.noise_token_id, dtype=torch.long, device=dev)
        ids[:, 0] = torch.tensor(firsts, device=dev)
        pos = (
            torch.tensor([s.seen for s in seqs], device=dev)[:, None] + torch.arange(B, device=dev)
        ).flatten()
        h = mhc.expand(F.embedding(ids.flatten(), m.embed), m.cfg.hc_mult)
        pre = torch.zeros(h.shape[0], m.cfg.hc_mult, device=dev)
        pre[:, 0] = 1.0  # the streams are equal copies: the first site collapses with a one-hot
        for j, stage in enumerate(w.stages):
            rings = [s.rings[j] for s in seqs]
            h, pre = m.block(
                stage, h, pre, lambda x, st=stage, r=rings: self.stage_attention(st, x, pos, r), self.moe
            )
        x = mhc.collapse(h, pre)
        u = linear(rms_norm_cast_once(x, w.norm, m.cfg.rms_norm_eps), m.lm_head).float()
        return u.view(N, B, -1), x.view(N, B, -1)

    @torch.inference_mode()
    def propose(self, requests: list[tuple[int, int, int]]) -> list[Draft]:
        active = [i for i, (sid, _, k) in enumerate(requests) if k > 0 and self.seqs[sid].seen > 0]
        drafts: list[list[int]] = [[] for _ in requests]
        if not active:
            return [Draft(d) for d in drafts]
        seqs = [self.seqs[requests[i][0]] for i in active]
        u, x = self.block_logits(seqs, [requests[i][1] for i in active])
        prev = torch.tensor([requests[i][1] for i in active], device=u.device)
        embeds = []
        for b in range(self.ds.block_size):  # the Markov chain: each row's bias from the token before it
            e = self.w.markov_embed[prev]  # [N, r]
            prev = (u[:, b] + linear(e, self.w.markov_head).float()).argmax(-1)
            embeds.append(e)
            for n, i in enumerate(active):
                drafts[i].append(int(prev[n]))
        conf = torch.sigmoid(
            linear(torch.cat([x.float(), torch.stack(embeds, 1).float()], -1), self.w.confidence.float())
        )
        for n, i in enumerate(active):
            k = min(requests[i][2], self.ds.block_size)
            drafts[i] = drafts[i][:k]
            seqs[n].confidence = conf[n, :k, 0].tolist()
        return [Draft(d) for d in drafts]


def make_proposer(target_model, cfg=None, spec=None, folder=None):
    """The registry's factory for "dspark" (moesaic/spec/__init__.py). With a drafter `folder`: the external
    drafter in it, for any target. Without: the DSpark proposer of a DeepSeek-V4.1 model built by moesaic
    whose checkpoint ships its stages, drafting up to `spec.num_speculative_tokens` (default and most: the
    block size) a round."""
    if folder is not None:
        proposer = load_external(target_model, cfg, folder)
        draft_count(spec, proposer.max_k, default=proposer.max_k)
        return proposer
    if not isinstance(target_model, deepseek_v41.Model):
        raise ConfigError(
            f"speculative config: method 'dspark' without a drafter folder ('model') runs DeepSeek-V4.1's own "
            f"stages; this is {type(target_model).__module__}: give an external DSpark drafter folder"
        )
    if target_model.dspark is None:
        raise ConfigError(
            "speculative config: method 'dspark' needs the checkpoint's DSpark stages (mtp.*), and this "
            "checkpoint has none; or give an external DSpark drafter folder ('model')"
        )
    if not target_model.cfg.delayed_pre:
        raise ConfigError(
            "speculative config: the DSpark stages need V4.1's delayed-pre mHC (mhc_delayed_pre)"
        )
    block = target_model.cfg.dspark.block_size
    return DsparkProposer(target_model, draft_count(spec, block, default=block))


# ---------------------------------------------------------------- external DSpark drafters (a folder)

WHERE = "the DSpark drafter's config.json"
MARKOV_HEAD_TYPES = ("vanilla",)  # speculators also trains "gated" and "rnn" heads: not implemented
MLA_FIELDS = ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim")  # an MLA-layer drafter's config


@dataclass(frozen=True)
class HeadsConfig:
    """The DSpark fields of an external drafter's config.json (top level or in `dflash_config`)."""

    markov_rank: int  # 0: no Markov head
    confidence: bool  # enable_confidence_head
    confidence_with_markov: bool  # the confidence head also reads markov_w1[prev]
    sample_from_anchor: bool  # row j predicts position a + j + 1 (vLLM's default); false: DFlash's rows


def parse_heads(raw: dict) -> HeadsConfig:
    dc = raw.get("dflash_config") if isinstance(raw.get("dflash_config"), dict) else {}

    def get(key, default):
        return dc.get(key, raw.get(key, default))

    def flag(key, default) -> bool:
        v = get(key, default)
        if not isinstance(v, bool):
            raise ConfigError(f"{WHERE}: field {key!r} must be true or false, got {v!r}")
        return v

    mla = [k for k in MLA_FIELDS if raw.get(k) is not None]
    if mla:
        raise ConfigError(
            f"{WHERE}: field {mla[0]!r} says this drafter has MLA layers (e.g. lightseekorg/kimi-k3-dspark); "
            "moesaic runs DSpark drafters with GQA (Qwen3-style) layers only"
        )
    projector = get("projector_type", "dspark")
    if projector != "dspark":
        raise ConfigError(
            f"{WHERE}: field 'projector_type' is {projector!r}; method 'dspark' reads DSpark drafters "
            "(projector_type 'dspark')"
        )
    stream = get("aux_hidden_stream", "prefix")
    if stream != "prefix":
        raise ConfigError(
            f"{WHERE}: field 'aux_hidden_stream' is {stream!r}; moesaic's taps are the 'prefix' stream (a "
            "layer's output; on Kimi K3 the AttnRes partial sum), the AttnRes mix stream is not tapped"
        )
    rank = get("markov_rank", 0)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise ConfigError(f"{WHERE}: field 'markov_rank' must be an integer >= 0, got {rank!r}")
    kind = get("markov_head_type", "vanilla")
    if kind not in MARKOV_HEAD_TYPES:
        raise ConfigError(
            f"{WHERE}: field 'markov_head_type' is {kind!r}; supported: {', '.join(MARKOV_HEAD_TYPES)}"
        )
    heads = HeadsConfig(
        rank,
        flag("enable_confidence_head", False),
        flag("confidence_head_with_markov", True),
        flag("sample_from_anchor", True),
    )
    if heads.confidence and heads.confidence_with_markov and rank == 0:
        raise ConfigError(
            f"{WHERE}: field 'confidence_head_with_markov' is true but 'markov_rank' is 0 (no Markov head "
            "to read): set confidence_head_with_markov false"
        )
    return heads


def head_specs(cfg: dflash.DFlashConfig, heads: HeadsConfig) -> list[TensorSpec]:
    V, d, r = cfg.vocab_size, cfg.hidden_size, heads.markov_rank
    specs = []
    if r:  # markov_w1 is a table read a row at a time
        specs += [
            TensorSpec("markov_head.markov_w1.weight", (V, r), "draft", dense=True),
            TensorSpec("markov_head.markov_w2.weight", (V, r), "draft"),
        ]
    if heads.confidence:  # fp32, as vLLM keeps it
        width = d + r if heads.confidence_with_markov else d
        specs += [
            TensorSpec("confidence_head.proj.weight", (1, width), "draft", keep_fp32=True),
            TensorSpec("confidence_head.proj.bias", (1,), "draft", keep_fp32=True),
        ]
    return specs


def naming(heads: HeadsConfig) -> Naming:
    """DFlash's naming; a disabled confidence head's tensors are ignored (as vLLM drops them)."""
    extra = [] if heads.confidence else [r"confidence_head\..*"]
    return Naming("DSpark", dflash.NAMING.source, dflash.NAMING.ignore + extra)


class ExternalDsparkProposer(dflash.DFlashProposer):
    """A DraftProposer (spec/base.py) over an external DSpark drafter: DFlash's backbone and context
    caches with rows shifted by one, the Markov walk, the confidence head; greedy drafts (probs None).
    `confidence(seq_id)` gives the confidence head's estimates for the last drafts ([] without the head)."""

    method = "dspark"

    def __init__(self, model, cfg: dflash.DFlashConfig, heads: HeadsConfig, t: Tensors):
        super().__init__(model, cfg, t, first_row=0 if heads.sample_from_anchor else 1)
        self.heads = heads
        self.markov_w1 = self.markov_w2 = self.conf_w = self.conf_b = None
        if heads.markov_rank:
            self.markov_w1, self.markov_w2 = (
                t("markov_head.markov_w1.weight"),
                t("markov_head.markov_w2.weight"),
            )
        if heads.confidence:
            self.conf_w, self.conf_b = t("confidence_head.proj.weight"), t("confidence_head.proj.bias")
        self.last_confidence: dict[int, list[float]] = {}

    def confidence(self, seq_id: int) -> list[float]:
        return self.last_confidence.get(seq_id, [])

    def start(self, seq_id: int) -> None:
        super().start(seq_id)
        self.last_confidence.pop(seq_id, None)

    def finish(self, seq_id: int) -> None:
        super().finish(seq_id)
        self.last_confidence.pop(seq_id, None)

    @torch.inference_mode()
    def round(self, requests: list[tuple[int, int, int]]):
        """(logits z [S, max_k, vocab] fp32 with the Markov bias, confidence [S, max_k] fp32 or None): the
        serial walk over the block rows, each row biased by the argmax of the row before (the anchor first)."""
        h = self.block_hidden(requests)
        u = linear(h, self.lm_head).float()
        prev = torch.tensor([last for _, last, _ in requests], device=u.device)
        rows, feats = [], []
        for j in range(u.shape[1]):
            z = u[:, j]
            if self.markov_w1 is not None:
                e = self.markov_w1[prev]  # [S, r]
                z = z + linear(e, self.markov_w2).float()
                feats.append(e)
            prev = z.argmax(-1)
            rows.append(z)
        conf = None
        if self.conf_w is not None:
            x = h.float()
            if self.heads.confidence_with_markov:
                x = torch.cat([x, torch.stack(feats, 1).float()], -1)
            conf = torch.sigmoid(x @ self.conf_w[0] + self.conf_b[0])
        return torch.stack(rows, 1), conf

    def block_logits(self, requests: list[tuple[int, int, int]]) -> torch.Tensor:
        return self.round(requests)[0]

    def propose(self, requests: list[tuple[int, int, int]]) -> list[Draft]:
        z, conf = self.round(requests)
        drafts = z.argmax(-1)
        out = []
        for j, (sid, _, k) in enumerate(requests):
            out.append(Draft(drafts[j, :k].tolist()))
            if conf is not None:
                self.last_confidence[sid] = conf[j, :k].tolist()
        return out


def load_external(model, target_cfg, folder) -> ExternalDsparkProposer:
    store = dflash.open_folder(folder)
    heads = parse_heads(store.config)
    cfg = dflash.parse_config(store.config, WHERE)
    dflash.check_against_target(cfg, model, target_cfg, WHERE)
    t = dflash.read_tensors(dflash.tensor_specs(cfg) + head_specs(cfg, heads), store, model, naming(heads))
    proposer = ExternalDsparkProposer(model, cfg, heads, t)
    t.check_all_taken()
    return proposer
