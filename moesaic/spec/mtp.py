"""MTP drafting with the heads the checkpoints ship: GLM-5.3's MTP layer, DeepSeek-V4's `mtp.0`, Nemotron-H's
MTP blocks. Each is "one more decoder layer" of the target's own kind, run by the target family's own code
(glm5next `dsa_block`/`mlp`, deepseek_v4 `block`, nemotron_h `mixer`), fed the pair (token r+1, target
hidden r) and predicting token r+2 (DeepSeek-V3's multi-token prediction, arXiv 2412.19437 §2.2; vLLM
`vllm/model_executor/models/deepseek_mtp.py`, `nemotron_h_mtp.py`):

    GLM-5.3     x = eh_proj([RMSNorm(E[t]; enorm) ; RMSNorm(h; hnorm)])
                y = x + DSA(RMSNorm(x))     (own latent and indexer cache, full indexer, NoPE, no mHC)
                z = y + MoE(RMSNorm(y));    logits = lm_head(RMSNorm(z; shared_head.norm))
    DeepSeek-V4 x = e_proj(RMSNorm(E[t]; enorm)) + h_proj(RMSNorm(h; hnorm));  streams = copies of x
                streams = V4 block (sliding window + sink, own window cache; MoE)
                z = hc_head(streams) (weighted collapse);  logits = lm_head(RMSNorm(z; norm))
    Nemotron-H  x = eh_proj([RMSNorm(E[t]; enorm) ; RMSNorm(h; hnorm)])
                x = x + mixer_i(RMSNorm(x)) for the block's layers (mtp_layers_block_type, default attention,
                MoE; attention and Mamba layers keep their own cache);  z = RMSNorm(x; final_layernorm)
                logits = lm_head(z)

Which hidden h is (the target's tap `cache.batch.FINAL` is the input of its final norm):
* GLM-5.3: FINAL (the mean of the mHC streams of the last layer), exactly as docs/train_demo.md §3 trains it.
* DeepSeek-V4: FINAL (the weighted hc_head collapse, before the final norm). The wiring projects one
  vector per token (h_proj [d, d]) and expands to streams after the sum, so h is a collapsed hidden, not
  the streams; pre-norm as in GLM. No release publishes which one it trained on.
* Nemotron-H: RMSNorm(FINAL; norm_f), the target's post-norm hidden, which is what vLLM's Nemotron-H MTP
  receives (the target model's returned hidden states) and what its blocks return (after final_layernorm).
Deeper drafts recurse through the same layer with its own output z as the next hidden (train_demo.md §3;
vLLM `spec_step_idx % n` with n = 1). A checkpoint with several MTP layers drafts with the first one.

Rows (spec/base.py's convention). Head row r sits at position r and is built from (t_{r+1}, h_r). After the
target has consumed t_0 .. t_{n-1} (hiddens h_0 .. h_{n-1}) and committed t_n, the head holds rows
0 .. n-2 (row n-1 waits for t_n); `propose(t_n)` builds row n-1 (committed: both inputs are), drafts
d_1 from it, then rows n .. n+k-2 from (d_i, z_{n-2+i}) (drafted). The next `observe` rolls the drafted
rows back and appends the committed ones from the verify forward's hiddens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..cache.batch import FINAL, ForwardBatch
from ..cache.state import SequenceState, TokenRows
from ..errors import ConfigError
from ..layers.csa import SLIDING, new_attention_state
from ..layers.linear import linear
from ..layers.mhc import Streams, expand, head_weighted
from ..layers.norms import rms_norm, rms_norm_cast_once, rms_norm_fp32_weight
from ..models import deepseek_v4, glm5next, nemotron_h
from .base import MAX_DEFERRED, Draft

DEFAULT_K = 3  # drafts per round when the speculative config does not say


# ---------------------------------------------------------------- the heads (one per family)


class GlmHead:
    """GLM-5.3's MTP layer (`glm5next.MtpLayer`), docs/train_demo.md §3."""

    def __init__(self, model: glm5next.Model):
        self.model, self.w = model, model.mtp[0]

    def new_state(self, rollback_window: int) -> SequenceState:
        c = self.model.cfg  # one full-indexer DSA layer: latent and indexer rows, rolled back for free
        widths = {"latent": c.kv_lora_rank, "k": c.index_head_dim, "z": c.index_head_dim}
        return SequenceState(
            [TokenRows(widths, self.model.dtype, self.model.device, c.max_position_embeddings)]
        )

    def hidden(self, final: torch.Tensor) -> torch.Tensor:
        return final

    def rows(self, batch: ForwardBatch, h: torch.Tensor) -> torch.Tensor:
        m, w, eps = self.model, self.w, self.model.cfg.rms_norm_eps
        e = F.embedding(batch.token_ids, m.embed)
        x = linear(torch.cat([rms_norm(e, w.enorm, eps), rms_norm(h, w.hnorm, eps)], dim=-1), w.eh_proj)
        x = x + m.dsa_block(0, w.attn, rms_norm(x, w.attn_norm, eps), batch, None, {})[0]
        return x + m.mlp(w.mlp, rms_norm(x, w.mlp_norm, eps))

    def logits(self, z: torch.Tensor) -> torch.Tensor:
        return linear(rms_norm(z, self.w.head_norm, self.model.cfg.rms_norm_eps), self.model.lm_head).float()


class DeepseekV4Head:
    """DeepSeek-V4's MTP layer (`deepseek_v4.MtpBlock`): a sliding-window V4 block with its own hyper
    head (docs/families/deepseek_v4.md, the draft-head section)."""

    def __init__(self, model: deepseek_v4.Model):
        self.model, self.w = model, model.mtp[0]

    def new_state(self, rollback_window: int) -> SequenceState:
        c, m = self.model.cfg, self.model
        return SequenceState(
            [
                new_attention_state(
                    SLIDING,
                    c.head_dim,
                    c.index_head_dim,
                    c.csa_ratio,
                    c.hca_ratio,
                    c.sliding_window,
                    m.dtype,
                    m.device,
                    c.max_position_embeddings,
                    rollback_window,
                )
            ]
        )

    def hidden(self, final: torch.Tensor) -> torch.Tensor:
        return final

    def rows(self, batch: ForwardBatch, h: torch.Tensor) -> torch.Tensor:
        m, w, eps = self.model, self.w, self.model.cfg.rms_norm_eps
        e = rms_norm_cast_once(F.embedding(batch.token_ids, m.embed), w.enorm, eps)
        x = linear(e, w.e_proj) + linear(rms_norm_cast_once(h, w.hnorm, eps), w.h_proj)
        streams = Streams(expand(x, m.cfg.hc_mult), m.hc)
        m.block(0, w.layer, streams, batch, SLIDING)
        return head_weighted(streams.value(), w.hc_head.fn, w.hc_head.base, w.hc_head.scale, m.hc)

    def logits(self, z: torch.Tensor) -> torch.Tensor:
        m = self.model
        return linear(rms_norm_cast_once(z, self.w.norm, m.cfg.rms_norm_eps), m.lm_head).float()


class NemotronHHead:
    """Nemotron-H's MTP block (`nemotron_h.MtpBlock`): its layers as bound (attention, MoE, ... per
    `mtp_layers_block_type`), vLLM's `NemotronHMultiTokenPredictor` wiring."""

    def __init__(self, model: nemotron_h.Model):
        self.model, self.w = model, model.mtp[0]

    def new_state(self, rollback_window: int) -> SequenceState:
        return self.model.new_state(rollback_window, kinds=tuple(layer.kind for layer in self.w.layers))

    def hidden(self, final: torch.Tensor) -> torch.Tensor:
        return rms_norm_fp32_weight(final, self.model.norm_f, self.model.cfg.layer_norm_epsilon)

    def rows(self, batch: ForwardBatch, h: torch.Tensor) -> torch.Tensor:
        m, w, eps = self.model, self.w, self.model.cfg.layer_norm_epsilon
        e = F.embedding(batch.token_ids, m.embed)
        x = linear(
            torch.cat([rms_norm_fp32_weight(e, w.enorm, eps), rms_norm_fp32_weight(h, w.hnorm, eps)], -1),
            w.eh_proj,
        )
        for i, layer in enumerate(w.layers):
            x = x + m.mixer(i, layer, rms_norm_fp32_weight(x, layer.norm, eps), batch)
        return rms_norm_fp32_weight(x, w.final_norm, eps)

    def logits(self, z: torch.Tensor) -> torch.Tensor:
        return linear(z, self.model.lm_head).float()


HEADS = {glm5next.Model: GlmHead, deepseek_v4.Model: DeepseekV4Head, nemotron_h.Model: NemotronHHead}


# ---------------------------------------------------------------- the proposer


@dataclass
class _Seq:
    state: SequenceState  # the head's cache; state.num_tokens = head rows held
    committed: int = 0  # head rows of committed pairs held (rows from here on are drafted)
    seen: int = 0  # target positions observed (their hiddens given)
    pending: torch.Tensor | None = None  # h_{seen-1}: its row waits for token t_seen
    last_token: int | None = None  # t_seen, when row seen-1 was built by propose
    last_z: torch.Tensor | None = None  # that row's output
    # committed rows known but not yet run (their input tokens and hiddens): observe defers them so that
    # the next propose runs them in the same head forward as its first draft row, for every sequence at once
    deferred_ids: list = field(default_factory=list)
    deferred_h: list = field(default_factory=list)


class MtpProposer:
    """A DraftProposer (spec/base.py) over one family head: per sequence the head's own cache, rolled
    back to the committed rows at every observe and propose; greedy drafts (probs None)."""

    method = "mtp"
    taps = (FINAL,)

    def __init__(self, head, max_k: int = DEFAULT_K):
        self.head, self.max_k = head, max_k
        self.seqs: dict[int, _Seq] = {}

    def start(self, seq_id: int) -> None:
        self.seqs[seq_id] = _Seq(self.head.new_state(self.max_k))

    def finish(self, seq_id: int) -> None:
        self.seqs.pop(seq_id, None)

    def fork(self, parent: int, child: int) -> None:
        """A parallel sample of `parent` (n > 1): `child` starts with its committed rows."""
        p = self.seqs[parent]
        self._forget_drafts(p)
        state = self.head.new_state(self.max_k)
        state.restore(p.state.snapshot())
        self.seqs[child] = dataclasses.replace(
            p, state=state, deferred_ids=list(p.deferred_ids), deferred_h=list(p.deferred_h)
        )

    def _forget_drafts(self, s: _Seq) -> None:
        s.state.rollback(s.state.num_tokens - s.committed)

    @torch.inference_mode()
    def run(self, items: list[tuple[SequenceState, list[int], torch.Tensor]]) -> torch.Tensor:
        """The head over (state, input tokens t_{r+1}, hiddens h_r) per sequence, appended to each state;
        returns z [rows, d] for all rows, in order."""
        m = self.head.model
        batch = ForwardBatch.build([(st, ids) for st, ids, _ in items], device=m.device)
        h = torch.cat([x for _, _, x in items]).to(device=m.device, dtype=m.dtype)
        z = self.head.rows(batch, h)
        batch.finish()
        return z

    def observe(self, seq_id: int, start: int, tokens: list[int], hidden: dict[int, torch.Tensor]) -> None:
        s = self.seqs[seq_id]
        if start != s.seen:
            raise ValueError(f"sequence {seq_id}: observe at position {start}, the head has seen {s.seen}")
        self._forget_drafts(s)
        if (
            s.last_token is not None and s.committed == start and tokens[0] != s.last_token
        ):  # row start-1: other token
            s.state.rollback(1)
            s.committed -= 1
        if FINAL in hidden:
            h = self.head.hidden(hidden[FINAL])
        else:  # rows the target did not compute (a prefix-cache hit): the head sees their tokens only
            m = self.head.model
            h = torch.zeros(len(tokens), m.cfg.hidden_size, dtype=m.dtype, device=m.device)
        first = s.committed + len(s.deferred_ids)  # the first row to add: rows r in [first, start + m - 2]
        for r in range(first, start + len(tokens) - 1):
            s.deferred_h.append(h[r - start : r - start + 1] if r >= start else s.pending)
            s.deferred_ids.append(tokens[r + 1 - start])
        if len(s.deferred_ids) >= MAX_DEFERRED:  # a sequence that has not drafted for a while
            self._flush([s])
        s.seen, s.pending, s.last_token, s.last_z = start + len(tokens), h[-1:], None, None

    def _flush(
        self, seqs: list[_Seq], extra: list[tuple[int, torch.Tensor]] | None = None
    ) -> list[torch.Tensor]:
        """Runs each sequence's deferred rows (then its `extra` row: a token and a hidden), all in one head
        forward; returns each sequence's last output row."""
        items, ends = [], []
        for j, s in enumerate(seqs):
            ids, hs = s.deferred_ids, s.deferred_h
            if extra is not None:
                ids, hs = ids + [extra[j][0]], hs + [extra[j][1]]
            items.append((s.state, ids, torch.cat(hs)))
            ends.append((ends[-1] if ends else 0) + len(ids))
            s.committed += len(s.deferred_ids)
            s.deferred_ids, s.deferred_h = [], []
        out = self.run(items)
        return [out[e - 1 : e] for e in ends]

    def propose(self, requests: list[tuple[int, int, int]]) -> list[Draft]:
        drafts: list[list[int]] = [[] for _ in requests]
        z: dict[int, torch.Tensor] = {}  # request index -> the output z of its newest row
        build = []
        requests = [(sid, last, min(k, self.max_k)) for sid, last, k in requests]  # the rollback window
        for i, (sid, last, k) in enumerate(requests):
            s = self.seqs[sid]
            self._forget_drafts(s)
            if k <= 0 or s.pending is None:
                continue
            if s.committed == s.seen and s.last_token == last:
                z[i] = s.last_z
            else:
                if s.committed == s.seen:  # row seen-1 came from another token: rebuild it
                    s.state.rollback(1)
                    s.committed -= 1
                build.append(i)
        if build:  # the deferred committed rows and row seen-1 (with its token), every sequence at once
            seqs = [self.seqs[requests[i][0]] for i in build]
            out = self._flush(seqs, [(requests[i][1], s.pending) for i, s in zip(build, seqs)])
            for i, s, o in zip(build, seqs, out):
                s.committed, s.last_token, s.last_z = s.seen, requests[i][1], o
                z[i] = o
        active = sorted(z)
        for step in range(max((requests[i][2] for i in active), default=0)):
            active = [i for i in active if requests[i][2] > step]
            if not active:
                break
            if step:  # the drafted rows: (d_step, z of the row before)
                items = [(self.seqs[requests[i][0]].state, [drafts[i][-1]], z[i]) for i in active]
                out = self.run(items)
                z.update({i: out[j : j + 1] for j, i in enumerate(active)})
            tok = self.head.logits(torch.cat([z[i] for i in active])).argmax(-1).tolist()
            for i, t in zip(active, tok):
                drafts[i].append(t)
        return [Draft(d) for d in drafts]


# ---------------------------------------------------------------- factory


def draft_count(spec, limit: int | None = None, default: int = DEFAULT_K) -> int:
    """`num_speculative_tokens` of a speculative config (spec.SpecConfig, a dict, or None: `default`),
    checked against `limit`."""
    if spec is None:
        k = default
    elif isinstance(spec, dict):
        k = spec.get("num_speculative_tokens", default)
    else:
        k = spec.num_speculative_tokens
    if isinstance(k, bool) or not isinstance(k, int) or k < 1 or (limit is not None and k > limit):
        bound = "" if limit is None else f" and at most {limit}"
        raise ConfigError(
            f"speculative config: field 'num_speculative_tokens' must be an integer >= 1{bound}, got {k!r}"
        )
    return k


def make_proposer(target_model, cfg=None, spec=None, folder=None) -> MtpProposer:
    """The registry's factory for "mtp" (moesaic/spec/__init__.py): the MTP proposer of a target model
    built by moesaic (GLM-5.3, DeepSeek-V4, Nemotron-H) whose checkpoint ships its MTP weights, drafting
    up to `spec.num_speculative_tokens` a round; a ConfigError otherwise."""
    if folder is not None:
        raise ConfigError(
            "speculative config: method 'mtp' runs the checkpoint's own MTP heads; field 'model' (a drafter "
            "folder) does not apply to it"
        )
    head = next((h for cls, h in HEADS.items() if isinstance(target_model, cls)), None)
    if head is None:
        raise ConfigError(
            f"speculative config: method 'mtp' needs a model with MTP heads (GLM-5.3, DeepSeek-V4, "
            f"Nemotron-H); this is {type(target_model).__module__}"
        )
    if not target_model.mtp:
        raise ConfigError(
            "speculative config: method 'mtp' needs the checkpoint's MTP weights, and this checkpoint has "
            "none (num_nextn_predict_layers is set but its tensors are absent)"
        )
    return MtpProposer(head(target_model), draft_count(spec))
