"""DeepSeek-V4 compressed attention: the sliding window with a per-head sink, the HCA and CSA
compressors, the lightning indexer, the grouped output projection, and the state one such
attention layer keeps per sequence (oracle: transformers 5.23
`src/transformers/models/deepseek_v4/modeling_deepseek_v4.py`; docs/families/deepseek_v4.md).
DeepSeek-V4.1 reuses every piece: its ratio-1 compressors have no gate, its indexer may be limited
to candidate blocks (`indexer_select`), and its index keys are made from the entries before rope
(`compressor_update` returns them).

Every layer attends with one shared 512-wide key (= value) per token, roped on its trailing
`rope_dim` channels, over the last `window` tokens (itself included) plus, on compressed layers,
pooled entries:

    s_i = q·k_i / sqrt(D) ;  p_i = exp(s_i) / (Σ_j exp(s_j) + exp(sink_h))     # the sink only divides
    o   = rope⁻¹(Σ_i p_i k_i)                                                  # V = K carries rope

HCA (ratio m', no overlap): entry w = RMSNorm(Σ_j softmax_j(gate_j + ape_j) ⊙ kv_j) over the tokens
w·m' … w·m'+m'−1, roped at w·m'. CSA (ratio m, overlap): each token projects two series; entry w
pools 2m slots, window w−1's first series and window w's second (window 0: the first half has
weight 0). An entry exists once its window is complete; query t sees entry w iff w < (t+1) // m.
HCA layers attend to every visible entry; CSA layers to the ≤ index_topk entries the lightning
indexer picks: score(t, w) = Σ_h wt_h · ReLU(q_h·K_w) / sqrt(c_I), over its own (overlapped,
width c_I) compressor's entries.

State per sequence and layer (`AttentionState`): the window's key rows (`TailRows`, the last
window − 1 tokens), and per compressor the raw (kv, gate) rows of its open window — plus, with
overlap, of the window before it, from which the carried first series is re-derived — (`TailRows`)
and the closed entries (`TokenRows`). Each TailRows keeps `rollback_window` rows more than it reads,
so rollback(n ≤ rollback_window) is exact: entries are truncated to (T − n) // m and reopened
windows are pooled again from the kept raw rows. transformers keeps the carried first series
(m rows) instead of the whole previous window (2m − 1 rows with the open one): m·(2c) more
elements per CSA compressor, for one code path that re-derives it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from ..cache.state import TailRows, TokenRows, can_rollback
from ..kernels import cpu
from ..kernels.triton import kernels
from .linear import kept, linear, matmul, operand, products
from .norms import rms_norm_cast_once, unit_weight
from .rope import cos_sin, rope_pairs

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"

# query blocks are sized so that one block's scores stay under this many elements
_SCORE_BUDGET = 1 << 22


# ---------------------------------------------------------------- rope on the trailing channels


RECENT = 4  # positions tensors whose angles a RopeTail keeps


@dataclass(frozen=True)
class RopeTail:
    """One rope set applied to the trailing 2·len(freqs) channels, pairs kept in place (V4's
    [nope | rope] layout). `factor` multiplies cos/sin (YaRN's attention factor; 1 for V4)."""

    freqs: Tensor  # [rope_dim / 2] fp32
    factor: float = 1.0
    # [positions, cos, sin, -sin or None] of the last RECENT positions tensors roped at, most recently used
    # first. A forward's layers rope at the same batch.positions three or four times each (q, kv, the
    # indexer's query, the output's inverse), between compressors' entries at their own positions (two new
    # tensors a layer where both of a CSA layer's compressors close one): the angles are made once a forward,
    # not once a call (two entries kept in order of making let the entries evict batch.positions: the
    # benchmark's DeepSeek-V4 step made angles ~4.7 times, now ~3.5, one per RopeTail and per closed entry).
    # Keyed by the tensor object, which is held (so its id is not reused); positions are never written in
    # place.
    recent: list = field(default_factory=list, compare=False, repr=False)

    @property
    def dim(self) -> int:
        return 2 * self.freqs.shape[0]

    def angles(self, positions: Tensor, inverse: bool = False) -> tuple[Tensor, Tensor]:
        """(cos, sin) [n, dim / 2] at positions [n] (sin negated for `inverse`)."""
        hit = next((e for e in self.recent if e[0] is positions), None)
        if hit is None:
            hit = [positions, *cos_sin(self.freqs, positions, self.factor), None]
        if not self.recent or self.recent[0] is not hit:
            self.recent[:] = [hit, *(e for e in self.recent if e is not hit)][:RECENT]
        if not inverse:
            return hit[1], hit[2]
        if hit[3] is None:
            hit[3] = -hit[2]
        return hit[1], hit[3]

    def __call__(self, x: Tensor, positions: Tensor, inverse: bool = False) -> Tensor:
        """x [n, ..., D] at positions [n]; `inverse` rotates by −angle."""
        return rope_pairs(x, *self.angles(positions, inverse), keep=x.shape[-1] - self.dim)


def fused_inputs(qa, kv, q_b, q_a_norm, kv_norm, eps: float, heads: int, head_norm: bool, rope, positions):
    """DeepSeek-V4's attention inputs after x's products (models/deepseek_v4.attention_inputs: qr = the q_a rows'
    cast-once norm, q = q_b's product per head, head-RMS'd where `head_norm`, and kv = the kv rows' norm, q and kv
    rotated by `rope` at positions) in one compiled call on the CPU, the same bits: (qr, q, kv), or None where
    it does not apply (the caller runs the code)."""
    if not qa.is_cpu or (op := operand(q_b)) is None:  # as sink_attention's: no Triton kernel for these steps
        return None
    ones = unit_weight(kv.shape[-1], kv.device) if head_norm else None
    return cpu.v4_inputs(qa, kv, op, q_a_norm, kv_norm, eps, heads, ones, *rope.angles(positions))


def fused_output(o: Tensor, wo_a: Tensor, wo_b, groups: int, rope, positions: Tensor) -> Tensor | None:
    """DeepSeek-V4's attention output (models/deepseek_v4.attention_output: o [N, H, D] rotated back by `rope` at
    positions, then `grouped_out`) in one compiled call on the CPU, the same bits; None where it does not apply
    (the caller runs the code)."""
    if not (o.is_cpu and type(wo_a) is torch.Tensor and wo_a.is_contiguous()):
        return None
    if (op := operand(wo_b)) is None:
        return None
    stack = wo_a.view(groups, wo_a.shape[0] // groups, -1)  # group g's rows: matrix g of a stack
    return cpu.v4_output(o, *rope.angles(positions, inverse=True), stack, op)


def grouped_out(o: Tensor, wo_a: Tensor, wo_b: Tensor, groups: int) -> Tensor:
    """The grouped low-rank output projection: o [N, H·D] split into `groups` contiguous blocks of
    whole heads, block g through wo_a rows [g·r, (g+1)·r), then the concatenation through wo_b."""
    N = o.shape[0]
    x = o.reshape(N, groups, -1)  # [N, G, H·D/G]
    r = wo_a.shape[0] // groups
    # each group's rows of wo_a are a [r, H·D/G] linear weight: `linear` streams it through the CPU kernels
    # (a batched torch.bmm took ~4x as long for one decode row)
    z = torch.cat([linear(x[:, g].contiguous(), wo_a[g * r : (g + 1) * r]) for g in range(groups)], dim=-1)
    return linear(z, wo_b)


# ---------------------------------------------------------------- compressors


@dataclass(frozen=True)
class CompressorDims:
    ratio: int  # m: tokens per entry
    width: int  # entry width (head_dim; index_head_dim for the indexer's compressor)
    overlap: bool  # CSA: two series per token, an entry pools 2m slots

    @property
    def proj_width(self) -> int:
        """Rows of wkv / wgate, columns of ape."""
        return self.width * (2 if self.overlap else 1)

    @property
    def rows_read(self) -> int:
        """Raw rows a forward reads back: the open window (≤ m − 1), and with overlap the one before."""
        return (2 if self.overlap else 1) * self.ratio - 1


@dataclass(frozen=True)
class CompressorWeights:
    wkv: object  # [proj_width, d]
    wgate: object | None  # [proj_width, d]; None: a one-token group (V4.1's ratio 1), every weight 1
    ape: Tensor  # [ratio, proj_width] position bias on the gate (fp32; zeros where a model has none)
    norm: Tensor  # [width] RMSNorm gain of the pooled entry


def compressor_inputs(x: Tensor, w: CompressorWeights, lin=None) -> tuple[Tensor, Tensor]:
    """(kv, gate) [N, proj_width] projections of the packed layer input that `compressor_update` takes
    (`lin`: linear(x, ·) as layers/linear.products gives it, else linear)."""
    lin = lin or products(x, ())
    kv = lin(w.wkv)
    return kv, torch.zeros_like(kv) if w.wgate is None else lin(w.wgate)


class CompressorState:
    """One compressor's per-sequence state: raw rows of its open window(s) and its closed entries."""

    def __init__(self, dims: CompressorDims, dtype, device, max_tokens: int, rollback_window: int):
        self.dims = dims
        pw = dims.proj_width
        self.raw = TailRows(
            {"kv": pw, "gate": pw}, dtype, device, dims.rows_read + rollback_window, dims.rows_read
        )
        self.entries = TokenRows({"entry": dims.width}, dtype, device, max_tokens // dims.ratio + 1)
        self.no_entries = torch.empty(0, dims.width, dtype=dtype, device=device)  # (no window closed)

    def can_rollback(self, n: int) -> bool:
        return self.raw.can_rollback(n)

    def rollback(self, n: int) -> None:
        self.raw.rollback(n)
        self.entries.rollback(self.entries.length - self.raw.length // self.dims.ratio)

    def snapshot(self):
        return self.raw.snapshot(), self.entries.snapshot()

    def want(self, points) -> None:
        self.raw.want(points)

    def snapshot_at(self, t: int):
        """After t tokens: the raw rows kept there, and the entries closed by then (as `rollback` counts them)."""
        return self.raw.snapshot_at(t), self.entries.snapshot_at(t // self.dims.ratio)

    def restore(self, snap) -> None:
        self.raw.restore(snap[0])
        self.entries.restore(snap[1])

    def held_entries(self) -> Tensor:
        """The closed entries [E, width]."""
        return self.entries.bufs["entry"][: self.entries.length]

    @property
    def nbytes(self) -> int:
        return self.raw.nbytes + self.entries.nbytes

    @staticmethod
    def nbytes_for(dims: CompressorDims, rollback_window: int, dtype_bytes: int) -> tuple[int, int]:
        """(bytes per token — an upper bound, exact when the ratio divides width·bytes —, fixed bytes)."""
        per_token = math.ceil(dims.width * dtype_bytes / dims.ratio)
        pw = dims.proj_width
        return per_token, TailRows.nbytes_for(
            {"kv": pw, "gate": pw}, dims.rows_read + rollback_window, dtype_bytes
        )


def pool_windows(kv: Tensor, gate: Tensor, ape: Tensor, dims: CompressorDims, has_prev: bool) -> Tensor:
    """Softmax-gated pooling of complete windows (before the entry norm). kv/gate [rows, proj_width]
    hold whole windows; with overlap and `has_prev` the first window is only the predecessor of the
    second (its first series feeds entry 0 of this call). Returns [entries, width]."""
    if tk := kernels("compressor", kv):
        return tk.pool_windows(kv, gate, ape, dims, has_prev)
    m, C = dims.ratio, dims.width
    W = kv.shape[0] // m
    k = kv.view(W, m, -1)
    g = gate.view(W, m, -1) + ape  # fp32 once ape is (the gate as transformers adds it)
    if not dims.overlap:
        return (k * g.softmax(dim=1, dtype=torch.float32).to(k.dtype)).sum(dim=1)
    G = W - 1 if has_prev else W
    slots_k = k.new_zeros(G, 2 * m, C)
    slots_g = g.new_full((G, 2 * m, C), float("-inf"))  # no predecessor: weight 0
    slots_k[:, m:] = k[W - G :, :, C:]
    slots_g[:, m:] = g[W - G :, :, C:]
    if has_prev:
        slots_k[:, :m] = k[:G, :, :C]
        slots_g[:, :m] = g[:G, :, :C]
    elif G > 1:
        slots_k[1:, :m] = k[: G - 1, :, :C]
        slots_g[1:, :m] = g[: G - 1, :, :C]
    return (slots_k * slots_g.softmax(dim=1, dtype=torch.float32).to(slots_k.dtype)).sum(dim=1)


def compressor_update(
    state: CompressorState, kv: Tensor, gate: Tensor, w: CompressorWeights, eps: float, rope: RopeTail
) -> tuple[Tensor, Tensor, int]:
    """Appends n new tokens' raw projections (kv/gate [n, proj_width], `compressor_inputs` of the
    layer input), closes every window they complete into an entry (pooled, RMSNorm-ed, roped at its
    first token's position). Returns (all entries so far [E, width], the new entries before rope
    [E1 − E0, width], E0 = the index of the first new one)."""
    d, m = state.dims, state.dims.ratio
    T0, n = state.raw.length, kv.shape[0]
    held = state.raw.held
    raw = state.raw.append(kv=kv, gate=gate)
    E0, E1 = T0 // m, (T0 + n) // m
    if E1 == E0:
        return state.held_entries(), state.no_entries, E0
    has_prev = d.overlap and E0 > 0
    first = (E0 - 1 if has_prev else E0) * m
    a, b = first - (T0 - held), E1 * m - (T0 - held)
    rows = raw["kv"][a:b], raw["gate"][a:b]
    got = None
    # the code below in one call
    if kv.is_cpu and kv.dtype == rows[0].dtype and not kernels("compressor", kv):
        got = cpu.compress_rows(
            *rows, w.ape, m, d.width, d.overlap, has_prev, w.norm, eps, rope.freqs, rope.factor, E0
        )
    if got is not None:
        latent, new = got
    else:
        pooled = pool_windows(*rows, w.ape, d, has_prev)
        latent = rms_norm_cast_once(pooled.to(kv.dtype), w.norm, eps)
        new = rope(latent, torch.arange(E0, E1, device=kv.device) * m)
    return state.entries.append(entry=new)["entry"], latent, E0


# ---------------------------------------------------------------- the lightning indexer


def index_score_blocks(q: Tensor, weights: Tensor, keys: Tensor, positions: Tensor, ratio: int):
    """The lightning indexer's scores, in blocks of queries that bound memory. q [n, H, c] (roped),
    weights [n, H] fp32 (already scaled by H^-0.5), keys [E, c] (E > 0), positions [n]. Yields
    (i, j, s, visible): s [j-i, E] fp32 scores of queries i..j-1, -inf on entries not yet closed
    for them; visible [j-i, 1] how many entries each of them sees."""
    n, H, c = q.shape
    E = keys.shape[0]
    visible = (positions + 1) // ratio
    kf = keys.float().t()
    entry = torch.arange(E, device=q.device)
    step = max(1, _SCORE_BUDGET // (H * E))
    for i in range(0, n, step):
        j = min(n, i + step)
        s = torch.relu(torch.matmul(q[i:j].float(), kf)) * c**-0.5  # [b, H, E]
        s = (s * weights[i:j, :, None]).sum(dim=1)
        vis = visible[i:j, None]
        yield i, j, s.masked_fill(entry[None] >= vis, float("-inf")), vis


def indexer_select(
    q: Tensor,
    weights: Tensor,
    keys: Tensor,
    positions: Tensor,
    ratio: int,
    topk: int,
    block: int = 1,
    topk_blocks: int = 0,
    allowed: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Top-k visible entries per query (arguments as `index_score_blocks`). Returns (sel [n, min(topk, E)]
    entry indices, -1 where nothing is selected; None, or with topk_blocks > 0 (V4.1's candidate
    source) the candidate blocks [n, ceil(E / block)] bool: the topk_blocks blocks of `block` entries
    with the highest max score, the block of the newest visible entry pinned). `allowed` [n, nb]
    (another layer's candidate blocks) sets the scores outside them to −inf."""
    if tk := kernels("indexer", q):
        return tk.indexer_select(q, weights, keys, positions, ratio, topk, block, topk_blocks, allowed)
    n, E = q.shape[0], keys.shape[0]
    k = min(topk, E)
    nb = -(-E // block)
    sel = torch.full((n, k), -1, dtype=torch.long, device=q.device)
    keep = torch.zeros(n, nb, dtype=torch.bool, device=q.device) if topk_blocks else None
    if E == 0:
        return sel, keep
    entry = torch.arange(E, device=q.device)
    for i, j, s, vis in index_score_blocks(q, weights, keys, positions, ratio):
        if topk_blocks:
            bs = F.pad(s, (0, nb * block - E), value=float("-inf")).view(j - i, nb, block).amax(-1)
            newest = vis - 1  # [j - i, 1]; -1: no entry visible yet (then every block is -inf already)
            col = newest.clamp(min=0) // block
            bs.scatter_(1, col, torch.where(newest >= 0, float("inf"), bs.gather(1, col)))
            val, idx = bs.topk(min(topk_blocks, nb), dim=-1)
            keep[i:j].scatter_(1, idx, val > float("-inf"))
        if allowed is not None:
            s = s.masked_fill(~allowed[i:j][:, entry // block], float("-inf"))
        val, idx = s.topk(k, dim=-1)
        sel[i:j] = torch.where(val == float("-inf"), -1, idx)
    return sel, keep


def visible_entries(positions: Tensor, num_entries: int, ratio: int, newest: bool = False) -> Tensor:
    """`indexer_select`'s selection (without candidate blocks) when num_entries <= topk: the top-k then keeps
    every entry a query sees, whatever the scores, so the indexer's queries and scores can be skipped. The
    same entries [n, num_entries] (-1 where not yet closed for the query), in entry order instead of score
    order. `newest`: the caller's word that the entries are every one the sequence has closed, its tokens
    compressed up to the last query's: one query (a decode row) then sees them all, one arange (~75 us of
    four small ops inside a DeepSeek-V4 decode step, measured)."""
    if newest and positions.shape[0] == 1 and positions.is_cpu:
        return _every_entry(num_entries)
    entry = torch.arange(num_entries, device=positions.device)
    if newest and positions.shape[0] == 1:
        return entry.view(1, num_entries)
    visible = (positions + 1) // ratio
    return entry.expand(positions.shape[0], num_entries).masked_fill(entry[None] >= visible[:, None], -1)


_EVERY: list = [None]  # the last _every_entry answer: a step's CSA layers ask for the same count


def _every_entry(num_entries: int) -> Tensor:
    """arange(num_entries) as [1, num_entries] on the CPU, kept for the next call with the same count (read only:
    the selection it stands for is only read; a GPU's selection is made anew, as a CUDA graph may capture it)."""
    kept = _EVERY[0]
    if kept is None or kept.shape[1] != num_entries:
        kept = _EVERY[0] = torch.arange(num_entries).view(1, num_entries)
    return kept


# ---------------------------------------------------------------- attention with a sink


def sink_step(heads: int, dim: int, window: int, entries: int) -> int:
    """sink_attention's block of queries: b queries score b·H·(window + b + E) logits and gather b·E·D entry
    values (CSA)."""
    return max(
        1,
        min(128, _SCORE_BUDGET // (heads * (window + 128 + entries)), _SCORE_BUDGET // max(1, entries * dim)),
    )


def fused_attention(layers: list, batch, qa, kv, comp, idx, w, cfg, kind: str, rope):
    """DeepSeek-V4's attention after the layer input's products (models/deepseek_v4.py: attention_inputs, each
    sequence's window and compressor appends, its sink attention over the window and the entries a CSA layer's
    indexer would keep, attention_output) in one compiled call on the CPU (cpu.v4_attention), the same bits, for
    decode rows and verify blocks while a CSA layer's entries fit index_topk (so the indexer keeps every visible
    one); a compressor that closes a window in this step pools it by compressor_update first. `layers`: each
    sequence's AttentionState; comp / idx: (kv, gate) of the compressor and the indexer's compressor or None; w:
    the layer's weights (q_b, q_a_norm, kv_norm, o_a, o_b, sinks; fused_plans keeps cpu.v4_plan by rows and
    threads); each head's query RMS-normed (V4's attention_inputs). [N, d], or None where it does not apply
    (nothing moved: the caller runs the code)."""
    N, H, D = qa.shape[0], cfg.num_attention_heads, cfg.head_dim
    if not (qa.is_cpu and N <= cpu.MAX_ROWS and type(w.o_a) is torch.Tensor):
        return None

    def make():
        q_b, o_b = operand(w.q_b), operand(w.o_b)
        if q_b is None or o_b is None:
            return None
        groups = cfg.o_groups
        o_a = w.o_a.view(groups, w.o_a.shape[0] // groups, -1)  # group g's rows: matrix g of a stack
        return cpu.v4_plan(q_b, w.q_a_norm, w.kv_norm, o_a, o_b, N, H, D)

    if (plan := kept(w.fused_plans, (N, torch.get_num_threads()), make)) is None:
        return None
    rows = [t for p in (comp, idx) if p is not None for t in p]  # sources 1, 2 (kv, gate), then 3, 4
    dt = qa.dtype
    if any(t.dtype != dt for t in rows):
        return None
    at = 0
    for s, st in zip(batch.seqs, layers):
        if s.start != at or st.window.dtype != dt or not st.window.room(s.n):
            return None
        if st.indexer is not None and not _entries_after(st.indexer, s.n) <= cfg.index_topk:
            return None  # the indexer's scores choose
        at += s.n
    if at != N:
        return None
    parts = [(c, p) for c, p in ((w.compressor, comp), (w.index_compressor, idx)) if p is not None]
    window = cfg.sliding_window
    mode = 0 if comp is None else 1 if idx is not None else 2  # sink attention: none, CSA's entries, HCA's
    ratio = cfg.hca_ratio if kind == HCA else cfg.csa_ratio

    def place():
        """Each ring's room claimed (the states advance): cpu.v4_attention's `attend` arguments."""
        bufs, srcs, seqs, ats, firsts, lens, wins, win_rows, win_starts = [], [], [], [], [], [], [], [], []
        entries, counts, steps, threads = [], [], [], []
        for i, (s, st) in enumerate(zip(batch.seqs, layers)):
            win_starts.append(s.past - st.window.held)
            first, at = st.window.claim(s.n)
            bufs.append(st.window.bufs["kv"]), srcs.append(0), seqs.append(i), ats.append(at)
            wins.append(st.window.bufs["kv"]), win_rows.extend((first, at + s.n))
            for j, (c, (cw, (kv_rows, gate_rows))) in enumerate(zip((st.compressor, st.indexer), parts)):
                if _closes(c, s.n) or not c.raw.room(s.n):  # pooled here (or its ring compacted): the code
                    compressor_update(c, s.rows(kv_rows), s.rows(gate_rows), cw, cfg.rms_norm_eps, rope)
                    continue
                at_c = c.raw.claim(s.n)[1]
                for src in (1 + 2 * j, 2 + 2 * j):
                    bufs.append(c.raw.bufs["kv" if src % 2 else "gate"]), srcs.append(src)
                    seqs.append(i), ats.append(at_c)
            E = 0
            if mode:
                E = st.compressor.entries.length
                entries.append(st.compressor.entries.bufs["entry"]), counts.append(E)
            firsts.append(s.past), lens.append(s.n)
            steps.append(sink_step(H, D, window, E))
            threads.append(cpu.sink_threads(s.n, H, D, at + s.n - first, window, E))
        return (bufs, srcs, seqs, ats, batch.positions, lens, firsts, wins, win_rows, win_starts, window, w.sinks,
                cfg.head_dim**-0.5, entries, counts, mode, ratio, steps, threads)  # fmt: skip

    cos, sin = rope.angles(batch.positions)
    nsin = rope.angles(batch.positions, inverse=True)[1]
    ones = unit_weight(D, kv.device)
    return cpu.v4_attention(qa, kv, rows, plan, cfg.rms_norm_eps, H, ones, cos, sin, nsin, place)


def _entries_after(c: CompressorState, n: int) -> int:
    """c's entries once n more tokens are in."""
    return (c.raw.length + n) // c.dims.ratio


def _closes(c: CompressorState, n: int) -> bool:
    """Whether n more tokens close an entry of c (compressor_update then pools it)."""
    return _entries_after(c, n) > c.raw.length // c.dims.ratio


def sink_attention(
    q: Tensor,
    positions: Tensor,
    first: int,
    win: Tensor,
    win_start: int,
    window: int,
    sink: Tensor,
    scale: float,
    comp: Tensor | None = None,
    comp_sel: Tensor | None = None,
    comp_ratio: int = 0,
) -> Tensor:
    """One sequence's queries q [n, H, D] at consecutive positions (`first` = positions[0], known on
    the host) over
    * the window keys win [L, D] (positions win_start …; a query sees the last `window` including itself),
    * compressed entries comp [E, D]: with comp_sel [n, k] (-1 = none) the selected ones (CSA), else
      every entry w < (t+1) // comp_ratio (HCA),
    with one extra logit per head, sink [H], in the softmax denominator. K = V. Returns [n, H, D]."""
    n, H, D = q.shape
    dt = q.dtype
    p0 = first
    E = 0 if comp is None else (comp_sel.shape[1] if comp_sel is not None else comp.shape[0])
    step = sink_step(H, D, window, E)
    if q.is_cpu and n <= cpu.MAX_ROWS:  # decode rows, verify blocks: the code below in one call (bf16)
        args = (q, positions, first, win, win_start, window, sink, scale, comp, comp_sel, comp_ratio, step)
        if (fused := cpu.sink_attention(*args)) is not None:
            return fused
    elif q.is_cpu:  # a prompt's rows: by vdpbf16ps tiles (the code below reads ~10 GFLOP/s in small matmuls)
        args = (q, first, win, win_start, window, sink, scale, comp, comp_sel, comp_ratio)
        if (fused := cpu.sink_prompt(*args)) is not None:
            return fused
    sinks = sink.float().view(1, H, 1)
    out = q.new_empty(n, H, D)
    for i in range(0, n, step):
        j = min(n, i + step)
        lo = max(win_start, p0 + i - window + 1)
        keys = win[lo - win_start : p0 + j - win_start]  # positions lo .. p0 + j - 1
        kpos = torch.arange(lo, p0 + j, device=q.device)
        t = positions[i:j, None]
        s = matmul(q[i:j], keys.t()) * scale  # [b, H, L]
        s = s.float().masked_fill(((kpos > t) | (kpos <= t - window))[:, None], float("-inf"))
        vals = keys
        if comp is not None and comp_sel is None:
            sc = (matmul(q[i:j], comp.t()) * scale).float()
            hidden = torch.arange(comp.shape[0], device=q.device)[None] >= (t + 1) // comp_ratio
            s = torch.cat([s, sc.masked_fill(hidden[:, None], float("-inf"))], dim=-1)
            vals = torch.cat([keys, comp])
        elif comp is not None:
            sel = comp_sel[i:j]
            picked = comp[sel.clamp(min=0)]  # [b, k, D]
            sc = (matmul(q[i:j], picked.transpose(1, 2)) * scale).float()
            s = torch.cat([s, sc.masked_fill((sel < 0)[:, None], float("-inf"))], dim=-1)
        logits = torch.cat([s, sinks.expand(j - i, H, 1)], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        p = torch.softmax(logits, dim=-1)[..., :-1].to(dt)
        if comp is not None and comp_sel is not None:
            L = keys.shape[0]
            out[i:j] = matmul(p[..., :L], keys) + matmul(p[..., L:], picked)
        else:
            out[i:j] = matmul(p, vals)
    return out


# ---------------------------------------------------------------- one layer's state


class AttentionState:
    """One attention layer's state for one sequence: the window's key rows, and on CSA/HCA layers the
    compressor (and on CSA the indexer's compressor)."""

    def __init__(
        self,
        window: TailRows,
        compressor: CompressorState | None = None,
        indexer: CompressorState | None = None,
    ):
        self.window = window
        self.compressor = compressor
        self.indexer = indexer

    def _parts(self):
        return [p for p in (self.window, self.compressor, self.indexer) if p is not None]

    def can_rollback(self, n: int) -> bool:
        return all(can_rollback(p, n) for p in self._parts())

    def rollback(self, n: int) -> None:
        for p in self._parts():
            p.rollback(n)

    def snapshot(self):
        return [p.snapshot() for p in self._parts()]

    def want(self, points) -> None:
        for p in self._parts():
            if hasattr(p, "want"):  # (V4.1's index keys follow their compressor's entries)
                p.want(points)

    def snapshot_at(self, t: int):
        return [p.snapshot_at(t) for p in self._parts()]

    def restore(self, snap) -> None:
        for p, s in zip(self._parts(), snap, strict=True):
            p.restore(s)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self._parts())


def layer_compressors(kind: str, head_dim: int, index_head_dim: int, csa_ratio: int, hca_ratio: int):
    """(compressor dims, indexer compressor dims) of a layer kind; None where it has none."""
    if kind == CSA:
        return CompressorDims(csa_ratio, head_dim, True), CompressorDims(csa_ratio, index_head_dim, True)
    if kind == HCA:
        return CompressorDims(hca_ratio, head_dim, False), None
    return None, None


def new_attention_state(
    kind: str,
    head_dim: int,
    index_head_dim: int,
    csa_ratio: int,
    hca_ratio: int,
    window: int,
    dtype,
    device,
    max_tokens: int,
    rollback_window: int = 0,
) -> AttentionState:
    comp, idx = layer_compressors(kind, head_dim, index_head_dim, csa_ratio, hca_ratio)
    return AttentionState(
        TailRows({"kv": head_dim}, dtype, device, window - 1 + rollback_window, window - 1),
        None if comp is None else CompressorState(comp, dtype, device, max_tokens, rollback_window),
        None if idx is None else CompressorState(idx, dtype, device, max_tokens, rollback_window),
    )


def attention_state_bytes(
    kind: str,
    head_dim: int,
    index_head_dim: int,
    csa_ratio: int,
    hca_ratio: int,
    window: int,
    dtype_bytes: int,
    rollback_window: int = 0,
) -> tuple[int, int]:
    """(bytes per token, fixed bytes) of one layer's `AttentionState`, from the config alone."""
    per_token, fixed = 0, TailRows.nbytes_for({"kv": head_dim}, window - 1 + rollback_window, dtype_bytes)
    for dims in layer_compressors(kind, head_dim, index_head_dim, csa_ratio, hca_ratio):
        if dims is not None:
            pt, fx = CompressorState.nbytes_for(dims, rollback_window, dtype_bytes)
            per_token, fixed = per_token + pt, fixed + fx
    return per_token, fixed
