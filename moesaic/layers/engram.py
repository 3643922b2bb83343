"""Engram n-gram memory of DeepSeek-V4.1-Flash (DeepSeek's `inference/engram.py` of
deepseek-ai/DeepSeek-V4.1-Flash; the project's write-up: docs/families/deepseek_v41.md).

At each Engram layer (1 and 14 in the release), before the layer's attention site, every token
looks up rows of a huge hashed table with the n-grams (n = 2..max_ngram_size) that end at it, and
a gate adds what it found into each hyper-connection stream:

    cid   = cmap[id]                          # compressed token class (built from the tokenizer)
    tok_s = cid[p - s], s = 0..S-1            # S = max_ngram_size; blocked -> cmap[pad_id], latching
    r_1 = tok_0·m_0 ^ tok_1·m_1, r_s = r_{s-1} ^ tok_s·m_s                 # int64, never wraps
    row(s, h) = r_s mod prime[s-1][h] + offset[s-1][h]                    # (S-1)·n_heads rows
    e     = concat_rows(table[row] · 2^(scale - 127))                     # [(S-1)·n_heads·head_dim]
    [key_0 .. key_{hc-1} | value] = wkv · e                               # keys first
    dot_c = Σ(h_c · q_weight_c · k_weight_c · key_c) · rsqrt(mean h_c² + eps)
                                                     · rsqrt(mean key_c² + eps) · d^-1/2
    h_c  += sigmoid(copysign(sqrt(max(|dot_c|, 1e-6)), dot_c)) · value    # per stream c

What the V4.1 model does with this module (all of it token-wise except the lookback state):

    ecfg   = EngramConfig.from_config(text_config)            # None when the model has no Engram
    hasher = EngramHash(ecfg, build_token_map(tokenizer, ecfg.compressed_vocab_size))
    state  = EngramState.for_config(ecfg, window=spec_window) # one per sequence, next to its KV state
    weights[j] = EngramWeights(EngramTable(rows, scales), wkv, q_weight, k_weight)
                                                              # bound by the model from its checkpoint
    # per forward, per sequence (prefill chunk, decode step or speculative block):
    rows = hasher.rows(token_ids, state, image_mask)          # [T, len(layer_ids), n_hash] int64;
                                                              #   appends the T tokens to state
    # in layer L = layer_ids[j], before its attention site, on the packed tokens of the batch:
    h = engram_forward(h, rows[:, j], weights[j], ecfg, image_mask)   # h [N, hc, d] -> [N, hc, d]

`rows` depends only on token ids, so a whole prompt's rows are known (and can be prefetched)
before any layer runs. `rollback(n)` of the sequence state rolls `state` back with the rest.

The table stays on disk: the model hands `EngramTable` views of the checkpoint file's map (its
contract marks the table `mapped`), and `gather` reads only the pages of the rows it gathers (264
bytes a row in the release), never the 94 GiB table.

What is exact and how it is known (tests/test_engram.py): the primes reproduce the published table
sizes 384,006,168 and 384,016,682 from the release's config values; the multipliers are frozen
integers that this module's own transcription of numpy's PCG64 + SeedSequence + Lemire sampling
reproduces (and numpy 2.4.6 agrees); the token map follows the release's normaliser chain, which
is the `tokenizers` normaliser sequence the release builds. Inferred, not published: eps = the
model's RMS eps; `q_weight · k_weight` taken in fp32; the gate's `copysign` (vs `sign`, which
differs only at dot = 0); the block at shift 0 (an image / unmapped token hashes as all-pad).
Not reproduced: the release's fp8 `Linear` also rounds the activations to fp8 (32-wide blocks)
before `wkv`; here the projection is weight-only (`linear`), like moesaic's other fp8 weights.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..cache.state import KeptInside
from ..config import declared, int_list, non_negative, positive, read_config, require
from ..errors import CheckpointError, ConfigError
from .linear import linear

__all__ = [
    "EngramConfig",
    "build_token_map",
    "normalize_token",
    "is_prime",
    "layer_primes",
    "table_rows",
    "EngramLayout",
    "engram_layouts",
    "FROZEN_MULTIPLIERS",
    "derive_multipliers",
    "layer_multipliers",
    "compress_ids",
    "ngram_rows",
    "EngramState",
    "EngramHash",
    "EngramTable",
    "EngramWeights",
    "engram_forward",
    "BLOCKED",
    "SCALE_BLOCK",
]

BLOCKED = -1  # a compressed id that blocks the n-grams reaching it: before the start, image, unmapped
SCALE_BLOCK = 32  # columns per E8M0 scale in the release's table rows (and the 32x32 wkv blocks)

# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------


# Bounds on the sizes a config may ask for, far above the release's (S = 4, 8 heads of 256-wide rows,
# tables from 16e6, 48 primes in all): past them the prime search and the gathers never finish, or the
# row numbers leave int64.
MAX_NGRAM = 16
MAX_HEADS = 64
MAX_HEAD_DIM = 2**16
MAX_TABLE_VOCAB = 2**40
MAX_PRIMES = 4096  # (S - 1) * n_heads * Engram layers


def _ints(raw: Mapping, key: str, where: str) -> tuple[int, ...]:
    """A non-empty list of integers (or one integer)."""
    v = int_list(raw, key, where, single=True)
    require(v is not None, where, key, v, "must be a non-empty list of integers")
    return v


@dataclass(frozen=True, kw_only=True)
class EngramConfig:
    """The Engram fields of a V4.1 text_config, plus the model dims the gate needs."""

    layer_ids: tuple[int, ...]  # engram_layer_ids: decoder layers with an Engram (in table order)
    num_embeddings: tuple[int, ...]  # engram_num_embeddings: rows of each layer's table
    max_ngram_size: int = declared(
        key="engram_max_ngram_size",
        check=lambda v: 2 <= v <= MAX_NGRAM,
        why=f"n-grams need n >= 2; at most {MAX_NGRAM}",
    )
    n_heads: int = declared(
        key="engram_n_heads", check=lambda v: 0 < v <= MAX_HEADS, why=f"must be in 1..{MAX_HEADS}"
    )  # primes per size
    head_dim: int = declared(
        key="engram_head_dim", check=lambda v: 0 < v <= MAX_HEAD_DIM, why=f"must be in 1..{MAX_HEAD_DIM}"
    )  # row width
    vocab_size: tuple[int, ...]  # engram_vocab_size per n-gram size: the prime search starts here
    compressed_vocab_size: int = declared(
        key="engram_compressed_vocab_size", check=lambda v: 0 < v < 2**31, why="must be in 1 .. 2^31 - 1"
    )
    pad_id: int = declared(
        key="engram_pad_id", check=non_negative, why="a token id"
    )  # blocked -> cmap[pad_id]
    hidden_size: int = declared(check=positive)  # d
    hc_mult: int = declared(4, check=positive)  # hyper-connection streams
    norm_eps: float = declared(1e-6, key="rms_norm_eps", check=non_negative)  # the gate's two RMS factors

    @property
    def n_hash(self) -> int:
        """Rows gathered per token and layer: (S - 1) · n_heads (24 in the release)."""
        return (self.max_ngram_size - 1) * self.n_heads

    @property
    def lookback(self) -> int:
        """Compressed ids a sequence keeps for the next token's n-grams: S - 1."""
        return self.max_ngram_size - 1

    @classmethod
    def from_config(cls, raw: Mapping, where: str = "config") -> EngramConfig | None:
        """Parses a V4.1 text_config (or a whole config with a `text_config`). None when it has no
        Engram layers (`engram_layer_ids` absent or empty). ConfigError names the field at fault,
        including `engram_num_embeddings` when a table's rows differ from its primes' sum."""
        if isinstance(raw.get("text_config"), Mapping):
            raw, where = raw["text_config"], f"{where}: text_config"
        if raw.get("engram_layer_ids") in (None, []):
            return None
        raw = dict(raw)
        layer_ids = _ints(raw, "engram_layer_ids", where)
        n_layers = raw.get("num_hidden_layers")
        for lid in layer_ids:
            inside = lid >= 0 and not (isinstance(n_layers, int) and lid >= n_layers)
            require(
                inside,
                where,
                "engram_layer_ids",
                list(layer_ids),
                f"layer {lid} is outside the model's {n_layers} layers",
            )
        require(
            len(set(layer_ids)) == len(layer_ids),
            where,
            "engram_layer_ids",
            list(layer_ids),
            "repeats a layer",
        )
        num_embeddings = _ints(raw, "engram_num_embeddings", where)
        require(
            len(num_embeddings) == len(layer_ids),
            where,
            "engram_num_embeddings",
            list(num_embeddings),
            f"one table per Engram layer: expected {len(layer_ids)} entries",
        )
        vocab = _ints(raw, "engram_vocab_size", where)
        cfg = read_config(
            cls, raw, where, layer_ids=layer_ids, num_embeddings=num_embeddings, vocab_size=vocab
        )
        S = cfg.max_ngram_size
        vocab = vocab * (S - 1) if len(vocab) == 1 else vocab
        require(
            len(vocab) == S - 1 and min(vocab) >= 2 and max(vocab) <= MAX_TABLE_VOCAB,
            where,
            "engram_vocab_size",
            raw.get("engram_vocab_size"),
            f"must be one integer in 2..2^40 or one per n-gram size ({S - 1})",
        )
        primes = len(layer_ids) * (S - 1) * cfg.n_heads
        require(
            primes <= MAX_PRIMES,
            where,
            "engram_n_heads",
            cfg.n_heads,
            f"{len(layer_ids)} Engram layers x {S - 1} n-gram sizes x {cfg.n_heads} heads = {primes} tables, "
            f"more than {MAX_PRIMES}",
        )
        vocab_size = raw.get("vocab_size")
        require(
            not isinstance(vocab_size, int) or cfg.pad_id < vocab_size,
            where,
            "engram_pad_id",
            cfg.pad_id,
            f"not a token id of the {vocab_size}-token vocabulary",
        )
        rows = table_rows(vocab, len(layer_ids), S, cfg.n_heads)
        require(
            rows == num_embeddings,
            where,
            "engram_num_embeddings",
            list(num_embeddings),
            f"the tables' primes (from engram_vocab_size {list(vocab)}, engram_max_ngram_size {S}, "
            f"engram_n_heads {cfg.n_heads}, {len(layer_ids)} layers) sum to {list(rows)}; the checkpoint's "
            f"tables would be addressed wrongly",
        )
        return dataclasses.replace(cfg, vocab_size=vocab)


# --------------------------------------------------------------------------------------------
# 1. Compressed token map
# --------------------------------------------------------------------------------------------

_SENTINEL = "\ue000"  # protects a token that is exactly one space from Strip()
_NORMALIZER = None


def _normalizer():
    """The release's key chain, as the `tokenizers` normaliser sequence it builds."""
    global _NORMALIZER
    if _NORMALIZER is None:
        from tokenizers import Regex
        from tokenizers import normalizers as N

        _NORMALIZER = N.Sequence(
            [
                N.NFKC(),
                N.NFD(),
                N.StripAccents(),
                N.Lowercase(),
                N.Replace(Regex(r"[ \t\r\n]+"), " "),
                N.Replace(Regex(r"^ $"), _SENTINEL),
                N.Strip(),
                N.Replace(_SENTINEL, " "),
            ]
        )
    return _NORMALIZER


def normalize_token(text: str) -> str:
    """NFKC -> NFD -> strip accents -> lowercase -> runs of [ \\t\\r\\n] to one space -> a lone
    space kept -> strip -> the class key (an empty result falls back to `text`, as the Engram
    release's `normalize_str(text) or text`)."""
    return _normalizer().normalize_str(text) or text


def _decoded_vocab(source) -> tuple[list[str], list[str]]:
    """(each id decoded alone, each id's raw token string) of a tokenizer or a vocab list."""
    tok = getattr(source, "tok", source)  # moesaic's HFTokenizer wraps a tokenizers.Tokenizer
    if hasattr(tok, "decode_batch") and hasattr(tok, "id_to_token"):  # tokenizers.Tokenizer
        n = tok.get_vocab_size(with_added_tokens=True)
        texts = tok.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
        return texts, [tok.id_to_token(i) or "" for i in range(n)]
    if hasattr(tok, "convert_ids_to_tokens") and hasattr(tok, "decode"):  # a transformers tokenizer
        n = len(tok)
        return (
            [tok.decode([i], skip_special_tokens=False) for i in range(n)],
            [tok.convert_ids_to_tokens(i) or "" for i in range(n)],
        )
    if isinstance(source, Sequence) and not isinstance(source, str):
        texts, raws = [], []
        for entry in source:
            if isinstance(entry, str):
                texts.append(entry)
                raws.append(entry)
            elif (
                isinstance(entry, (tuple, list))
                and len(entry) == 2
                and all(isinstance(e, str) for e in entry)
            ):
                texts.append(entry[0])
                raws.append(entry[1])
            else:
                raise TypeError(f"a vocab list holds strings or (decoded, raw token) pairs, not {entry!r}")
        return texts, raws
    raise TypeError(f"build_token_map needs a tokenizer or a vocab list, not {type(source).__name__}")


def build_token_map(source, expected: int | None = None) -> Tensor:
    """The compressed token map: int64 [V], id -> class, classes numbered by first appearance.

    source: a `tokenizers.Tokenizer` (or moesaic's HFTokenizer, or a transformers tokenizer), each
    id decoded alone; or a vocab list whose entries are each id's decoded text (then also its raw
    token) or (decoded text, raw token) pairs. Key = normalize_token(decoded), except that a decode
    holding U+FFFD (a partial UTF-8 byte sequence) keys on the raw token string instead.
    expected: `engram_compressed_vocab_size`; a different class count raises ConfigError."""
    texts, raws = _decoded_vocab(source)
    classes: dict[str, int] = {}
    ids = []
    for text, raw in zip(texts, raws):
        key = raw if "\ufffd" in text else normalize_token(text)
        ids.append(classes.setdefault(key, len(classes)))
    if expected is not None and len(classes) != expected:
        raise ConfigError(
            f"engram_compressed_vocab_size is {expected}, but the tokenizer's {len(texts)} ids fall into "
            f"{len(classes)} classes under the release's normalisation; this tokenizer is not the "
            f"checkpoint's (the release's has 129,280 ids in 99,092 classes)"
        )
    return torch.tensor(ids, dtype=torch.int64)


# --------------------------------------------------------------------------------------------
# 2. Primes: one prime-sized bucket range per (layer, n, head)
# --------------------------------------------------------------------------------------------


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin (exact for n < 3.3e24)."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    for p in small:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def layer_primes(
    vocab_size: Sequence[int], num_layers: int, max_ngram_size: int, n_heads: int
) -> list[list[list[int]]]:
    """primes[layer][n - 2][head], drawn as the release does: for each Engram layer in order, for
    n = 2..S, `current` restarts at vocab_size[n - 2] - 1, and each head takes the next prime above
    `current` that no table has taken yet, then `current` moves to it."""
    seen: set[int] = set()
    # every prime between a start and the last prime taken from it is taken, and stays so: a search that
    # restarts there can resume after that prime (the same primes, in linear rather than quadratic time)
    resume: dict[int, int] = {}
    out = []
    for _ in range(num_layers):
        per_layer = []
        for n in range(2, max_ngram_size + 1):
            start = vocab_size[n - 2] - 1
            current, heads = resume.get(start, start), []
            for _ in range(n_heads):
                current += 1
                while current in seen or not is_prime(current):
                    current += 1
                seen.add(current)
                heads.append(current)
            resume[start] = current
            per_layer.append(heads)
        out.append(per_layer)
    return out


def table_rows(
    vocab_size: Sequence[int], num_layers: int, max_ngram_size: int, n_heads: int
) -> tuple[int, ...]:
    """Rows of each layer's table: the sum of its primes. From the release's values
    (16000000 x 3, 2 layers, S = 4, 8 heads): (384006168, 384016682)."""
    return tuple(
        sum(sum(p) for p in layer) for layer in layer_primes(vocab_size, num_layers, max_ngram_size, n_heads)
    )


# --------------------------------------------------------------------------------------------
# 3. Multipliers: one odd int64 per shift and layer
# --------------------------------------------------------------------------------------------

# FROZEN_MULTIPLIERS[(compressed_vocab_size, layer_id, max_ngram_size)] = (m_0, .., m_{S-1}).
# Derivation (the release's `inference/engram.py`): rng = numpy.random.default_rng(10007 * layer_id);
#   m = rng.integers(0, bound, size=S, dtype=int64) * 2 + 1,  bound = max(1, (2^63 - 1) // cvs // 2),
# so that tok · m < 2^63 for every tok < cvs. numpy does not promise a stable stream, so the values
# are frozen here; `derive_multipliers` recomputes them without numpy (PCG64 + SeedSequence + Lemire,
# transcribed below) and the tests check both, and numpy 2.4.6, against these literals.
FROZEN_MULTIPLIERS: dict[tuple[int, int, int], tuple[int, ...]] = {
    # the release, bound = 46,539,438,283,891 (values < 2^47)
    (99092, 1, 4): (76632096046245, 4839876093313, 35959672319349, 73987337458391),
    (99092, 14, 4): (67716810739261, 51510806800915, 30921347202721, 82619226485591),
    # the tiny V4.1 fixture of tests/test_engram.py (identity map over 64 ids, Engram layers 1 and 4),
    # bound = 72,057,594,037,927,935
    (64, 1, 4): (118650432209603643, 7493640653728489, 55676810147952557, 114555519428547269),
    (64, 4, 4): (127364524771245009, 7800076361716407, 114038564133282483, 29348051253447937),
}

_M32, _M64, _M128 = (1 << 32) - 1, (1 << 64) - 1, (1 << 128) - 1
_PCG_MULT = (2549297995355413924 << 64) | 4865540595714422341  # PCG_DEFAULT_MULTIPLIER_128


def _seed_sequence_state(entropy: int, n64: int) -> list[int]:
    """numpy's SeedSequence(entropy).generate_state(n64, uint64): pool of 4 uint32 words."""
    words = []
    while True:
        words.append(entropy & _M32)
        entropy >>= 32
        if not entropy:
            break
    hash_const = [0x43B0D7E5]  # INIT_A

    def hashmix(v):
        v ^= hash_const[0]
        hash_const[0] = (hash_const[0] * 0x931E8875) & _M32  # MULT_A
        v = (v * hash_const[0]) & _M32
        return v ^ (v >> 16)

    def mix(x, y):
        r = (0xCA01F9DD * x - 0x4973F715 * y) & _M32  # MIX_MULT_L, MIX_MULT_R
        return r ^ (r >> 16)

    pool = [hashmix(words[i] if i < len(words) else 0) for i in range(4)]
    for src in range(4):
        for dst in range(4):
            if src != dst:
                pool[dst] = mix(pool[dst], hashmix(pool[src]))
    for src in range(4, len(words)):
        for dst in range(4):
            pool[dst] = mix(pool[dst], hashmix(words[src]))
    hb, out = 0x8B51F9DD, []  # INIT_B
    for i in range(2 * n64):
        v = pool[i % 4] ^ hb
        hb = (hb * 0x58F38DED) & _M32  # MULT_B
        v = (v * hb) & _M32
        out.append(v ^ (v >> 16))
    return [out[2 * i] | (out[2 * i + 1] << 32) for i in range(n64)]


class _PCG64:
    """numpy's PCG64 (XSL-RR 128/64) as seeded by default_rng(seed)."""

    def __init__(self, seed: int):
        s = _seed_sequence_state(seed, 4)
        self.inc = ((((s[2] << 64) | s[3]) << 1) | 1) & _M128
        self.state = 0
        self._step()
        self.state = (self.state + ((s[0] << 64) | s[1])) & _M128
        self._step()

    def _step(self):
        self.state = (self.state * _PCG_MULT + self.inc) & _M128

    def next_uint64(self) -> int:
        self._step()
        x = ((self.state >> 64) ^ self.state) & _M64
        rot = self.state >> 122
        return ((x >> rot) | (x << (64 - rot))) & _M64

    def below(self, bound: int) -> int:
        """Generator.integers(0, bound, dtype=int64) for bound > 2^32: Lemire's method, 64-bit path."""
        m = self.next_uint64() * bound
        if (m & _M64) < bound:
            threshold = ((1 << 64) - bound) % bound
            while (m & _M64) < threshold:
                m = self.next_uint64() * bound
        return m >> 64


def derive_multipliers(layer_id: int, compressed_vocab_size: int, max_ngram_size: int) -> tuple[int, ...]:
    """The release's derivation, reproduced without numpy (see FROZEN_MULTIPLIERS)."""
    bound = max(1, (2**63 - 1) // compressed_vocab_size // 2)
    if bound <= 2**32:
        raise ConfigError(
            f"engram_compressed_vocab_size {compressed_vocab_size} is too large for the "
            f"multiplier derivation transcribed here (needs < 2^30)"
        )
    rng = _PCG64(10007 * layer_id)
    return tuple(rng.below(bound) * 2 + 1 for _ in range(max_ngram_size))


def layer_multipliers(layer_id: int, compressed_vocab_size: int, max_ngram_size: int) -> tuple[int, ...]:
    """The frozen values where the release (or the tiny golden) has them, else derived."""
    key = (compressed_vocab_size, layer_id, max_ngram_size)
    return FROZEN_MULTIPLIERS.get(key) or derive_multipliers(layer_id, compressed_vocab_size, max_ngram_size)


@dataclass(frozen=True)
class EngramLayout:
    """One layer's addressing: primes [S-1, n_heads], offsets [(S-1)·n_heads] (exclusive cumulative
    sum of the primes, in (n, head) order), multipliers [S]; all int64."""

    layer_id: int
    primes: Tensor
    offsets: Tensor
    multipliers: Tensor

    @property
    def rows(self) -> int:
        return int(self.primes.sum())


def engram_layouts(cfg: EngramConfig) -> list[EngramLayout]:
    primes = layer_primes(cfg.vocab_size, len(cfg.layer_ids), cfg.max_ngram_size, cfg.n_heads)
    out = []
    for lid, p in zip(cfg.layer_ids, primes):
        pt = torch.tensor(p, dtype=torch.int64)
        flat = pt.reshape(-1)
        offsets = torch.cumsum(flat, 0) - flat
        m = torch.tensor(
            layer_multipliers(lid, cfg.compressed_vocab_size, cfg.max_ngram_size), dtype=torch.int64
        )
        out.append(EngramLayout(lid, pt, offsets, m))
    return out


# --------------------------------------------------------------------------------------------
# 4. The rolling XOR hash and the per-sequence lookback
# --------------------------------------------------------------------------------------------


def compress_ids(token_ids: Tensor, token_map: Tensor, image_mask: Tensor | None = None) -> Tensor:
    """Token ids [T] -> compressed ids [T] int64; BLOCKED (-1) for an id outside the map, an id the
    map leaves unmapped (negative entry) and an image position (image_mask True)."""
    ids = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1)
    inside = (ids >= 0) & (ids < token_map.numel())
    cids = torch.where(inside, token_map[ids.clamp(0, max(token_map.numel() - 1, 0))], BLOCKED)
    cids = cids.masked_fill(cids < 0, BLOCKED)
    if image_mask is not None:
        cids = cids.masked_fill(torch.as_tensor(image_mask, dtype=torch.bool).reshape(-1), BLOCKED)
    return cids


def _shifted_tokens(cids: Tensor, lookback: Tensor, pad_cid: int, S: int) -> Tensor:
    """tok[p, s] = cid[p - s] over lookback + cids, [T, S]; from the first blocked shift on
    (s = 0 included) every farther shift is blocked too, and blocked entries become pad_cid."""
    T = cids.numel()
    before = torch.full((S - 1,), BLOCKED, dtype=torch.int64)  # the sequence start blocks
    lb = lookback.to(torch.int64).reshape(-1)[-(S - 1) :]
    before[S - 1 - lb.numel() :] = lb
    ext = torch.cat([before, cids])
    tok = ext[torch.arange(T)[:, None] + (S - 1) - torch.arange(S)[None, :]]
    latched = torch.cummax((tok < 0).to(torch.int8), dim=1).values.bool()
    return tok.masked_fill(latched, pad_cid)


def _rows_from_tokens(tok: Tensor, layout: EngramLayout) -> Tensor:
    prod = tok * layout.multipliers  # < 2^63 by the choice of the multipliers' bound
    r = prod[:, 0]
    out = []
    for s in range(1, tok.shape[1]):
        r = torch.bitwise_xor(r, prod[:, s])
        out.append(torch.remainder(r[:, None], layout.primes[s - 1]))
    return torch.cat(out, dim=1) + layout.offsets


def ngram_rows(cids: Tensor, lookback: Tensor, layout: EngramLayout, pad_cid: int) -> Tensor:
    """Table rows of T new positions, [T, (S-1)·n_heads] int64 (offsets included; column (n-2)·H + h).
    cids: the new compressed ids [T]; lookback: the compressed ids before them (the last S - 1,
    BLOCKED where there were none), as `EngramState.lookback_ids()` gives."""
    tok = _shifted_tokens(cids.to(torch.int64).reshape(-1), lookback, pad_cid, layout.multipliers.numel())
    return _rows_from_tokens(tok, layout)


class EngramState(KeptInside):
    """One sequence's Engram state: the compressed ids of its last tokens (BLOCKED for image or
    unmapped ones), which the next tokens' n-grams look back at.

    Holds the last keep = lookback + window ids, oldest first (window = the speculative rollback
    window): rollback(n) is exact for n <= window, or when it forgets every token; like TailRows it
    refuses other n. Shared by all Engram layers of the model (the hash depends on tokens only)."""

    def __init__(self, lookback: int, window: int = 0):
        if lookback < 1 or window < 0:
            raise ValueError(f"EngramState needs lookback >= 1 and window >= 0, got {lookback}, {window}")
        self.need = lookback
        self.window = window
        self.keep = lookback + window
        self.length = 0  # tokens seen
        self.ids = torch.empty(0, dtype=torch.int64)  # the newest min(length, keep) ids
        self.want(())

    @classmethod
    def for_config(cls, cfg: EngramConfig, window: int = 0) -> EngramState:
        return cls(cfg.lookback, window)

    def lookback_ids(self) -> Tensor:
        """The last `lookback` compressed ids, BLOCKED-padded on the left before the sequence start."""
        held = self.ids[max(0, self.ids.numel() - self.need) :]
        if held.numel() < self.need:
            held = torch.cat([torch.full((self.need - held.numel(),), BLOCKED, dtype=torch.int64), held])
        return held

    def append(self, cids: Tensor) -> None:
        cids = torch.as_tensor(cids, dtype=torch.int64).reshape(-1)
        both = torch.cat([self.ids, cids])
        for t in self.wants:  # the ids held after each wanted token among these (cache/state.py's `want`)
            if 0 < t - self.length < cids.numel():
                self.mids[t] = (
                    t,
                    both[: both.numel() - (self.length + cids.numel() - t)][-self.keep :].clone(),
                )
        self.ids = both[-self.keep :]
        self.length += cids.numel()

    def can_rollback(self, n: int) -> bool:
        """n == all tokens, or n <= window while the ids left still cover the lookback."""
        if n == self.length:
            return True
        return 0 <= n <= min(self.window, self.length) and self.ids.numel() - n >= min(
            self.need, self.length - n
        )

    def rollback(self, n: int) -> None:
        if not self.can_rollback(n):
            raise ValueError(
                f"cannot roll back {n} of {self.length} tokens: the Engram lookback keeps "
                f"{self.window} ids beyond what it reads (its speculative window)"
            )
        self.length -= n
        self.ids = self.ids[: self.ids.numel() - n] if n < self.ids.numel() else self.ids[:0]

    def snapshot(self):
        return (self.length, self.ids.clone())

    def restore(self, snap) -> None:
        self.length, ids = snap
        self.ids = ids.clone()

    @property
    def nbytes(self) -> int:
        return self.ids.numel() * self.ids.element_size()

    @staticmethod
    def nbytes_for(cfg: EngramConfig, window: int = 0) -> int:
        """The most one sequence holds (int64 ids), for the state planner: (S - 1 + window) · 8."""
        return (cfg.lookback + window) * 8


class EngramHash:
    """The addressing of all Engram layers of a model: the token map, the pad class, the layouts."""

    def __init__(self, cfg: EngramConfig, token_map: Tensor):
        token_map = torch.as_tensor(token_map, dtype=torch.int64).reshape(-1)
        classes = int(token_map.max()) + 1 if token_map.numel() else 0
        if classes != cfg.compressed_vocab_size:
            raise ConfigError(
                f"engram_compressed_vocab_size is {cfg.compressed_vocab_size}, but the token "
                f"map has {classes} classes"
            )
        if not 0 <= cfg.pad_id < token_map.numel() or token_map[cfg.pad_id] < 0:
            raise ConfigError(
                f"engram_pad_id {cfg.pad_id} has no class in the {token_map.numel()}-id token map"
            )
        self.cfg = cfg
        self.token_map = token_map
        self.pad_cid = int(token_map[cfg.pad_id])
        self.layouts = engram_layouts(cfg)
        self.on_rows = None  # called with every rows() result (expert streaming's row prefetch)

    def compress(self, token_ids, image_mask=None) -> Tensor:
        return compress_ids(token_ids, self.token_map, image_mask)

    def rows(self, token_ids, state: EngramState, image_mask=None) -> Tensor:
        """Rows of the T new tokens of one sequence for every Engram layer, [T, n_layers, n_hash]
        int64 (layer j = cfg.layer_ids[j]); appends the tokens to `state`."""
        cids = self.compress(token_ids, image_mask)
        tok = _shifted_tokens(cids, state.lookback_ids(), self.pad_cid, self.cfg.max_ngram_size)
        state.append(cids)
        rows = torch.stack([_rows_from_tokens(tok, lay) for lay in self.layouts], dim=1)
        if self.on_rows is not None:  # streamed tables: start reading these rows before the first layer
            self.on_rows(rows)
        return rows


# --------------------------------------------------------------------------------------------
# 5. The table: fp8 rows + E8M0 scales, read row by row from the mapped file
# --------------------------------------------------------------------------------------------

_E8M0_LIKE = (torch.uint8, torch.int8, torch.float8_e8m0fnu)


def _e4m3(codes: Tensor) -> Tensor:
    """FP8 E4M3 codes (float8_e4m3fn or their bytes) -> float32, by torch's own conversion."""
    return codes.view(torch.float8_e4m3fn).float()


def _e8m0(exps: Tensor) -> Tensor:
    """E8M0 exponent bytes -> float32 2^(e - 127) (e = 255 -> NaN), by torch's own conversion."""
    return exps.view(torch.float8_e8m0fnu).float()


def _take(table, idx: Tensor) -> Tensor:
    """Rows `idx` of a table: a view of the file's map, or one read through expert streaming's row
    reader (`read_rows`, preadv with a row cache: weights/experts.py FileRows)."""
    return table.read_rows(idx) if hasattr(table, "read_rows") else table[idx]


class EngramTable:
    """One layer's table, [rows, head_dim]: fp8 E4M3 codes with one scale per `block` columns
    (E8M0 bytes as released, or float multipliers), or a plain float table (tiny tests).
    The tensors may be views of the checkpoint file's map: `gather` reads only the rows it is asked
    for."""

    def __init__(self, weight: Tensor, scale: Tensor | None = None, name: str = "engram.embed"):
        if weight.ndim != 2:
            raise CheckpointError(f"{name}.weight: expected [rows, head_dim], got {list(weight.shape)}")
        self.name = name
        self.weight = weight
        self.scale = scale
        self.fp8 = weight.dtype in (torch.float8_e4m3fn, torch.uint8)
        if self.fp8:
            if (
                scale is None
                or scale.ndim != 2
                or scale.shape[0] != weight.shape[0]
                or scale.shape[1] == 0
                or weight.shape[1] % scale.shape[1]
            ):
                raise CheckpointError(
                    f"{name}: fp8 rows {list(weight.shape)} need a scale [rows, head_dim / block], "
                    f"got {None if scale is None else list(scale.shape)}"
                )
            self.block = weight.shape[1] // scale.shape[1]
        elif not weight.is_floating_point() or scale is not None:
            raise CheckpointError(
                f"{name}: a table is fp8 codes + scale or a float tensor, got {weight.dtype}"
                f"{' with a scale' if scale is not None else ''}"
            )

    @property
    def rows(self) -> int:
        return self.weight.shape[0]

    @property
    def head_dim(self) -> int:
        return self.weight.shape[1]

    def gather(self, rows: Tensor) -> Tensor:
        """float32 [*rows.shape, head_dim]: each row dequantized (fp8 · 2^(e - 127)) in fp32."""
        rows = torch.as_tensor(rows, dtype=torch.int64)
        idx = rows.reshape(-1)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.rows):
            raise IndexError(
                f"{self.name}: row ids {int(idx.min())}..{int(idx.max())} outside its {self.rows} rows"
            )
        if not self.fp8:
            vals = _take(self.weight, idx).to(torch.float32)
        else:
            codes = _take(self.weight, idx).view(torch.uint8)  # touches only these rows' pages
            if self.scale.dtype in _E8M0_LIKE:
                s = _e8m0(_take(self.scale, idx).view(torch.uint8))
            else:
                s = _take(self.scale, idx).to(torch.float32)
            vals = (_e4m3(codes).view(-1, s.shape[1], self.block) * s[..., None]).view(-1, self.head_dim)
        return vals.view(*rows.shape, self.head_dim)


# --------------------------------------------------------------------------------------------
# 6. Projection (keys first) and the signed square-root gate per stream
# --------------------------------------------------------------------------------------------


@dataclass
class EngramWeights:
    """One Engram layer's weights (as the release stores them):
    table      fp8 E4M3 rows [rows, head_dim] + E8M0 scales [rows, head_dim / 32]
    wkv        [(hc + 1)·d, n_hash·head_dim] (fp8, 32x32 E8M0 blocks): a dense tensor or a packed one
               with its own matmul; rows c·d .. (c+1)·d - 1 are stream c's key, the last d the value
    q_weight   [hc, d] (BF16); k_weight [hc, d] (BF16); only their product is used"""

    table: EngramTable
    wkv: object
    q_weight: Tensor
    k_weight: Tensor


def engram_forward(
    h: Tensor, rows: Tensor, w: EngramWeights, cfg: EngramConfig, image_mask: Tensor | None = None
) -> Tensor:
    """One Engram layer on the packed tokens of a batch.

    h          [N, hc, d] hyper-connection streams (fp32 highway or the compute dtype)
    rows       [N, n_hash] int64 table rows of this layer (EngramHash.rows(...)[:, j])
    image_mask [N] bool, optional: the gate is 0 there (image spans pass through untouched)
    returns    [N, hc, d] in h's dtype: h_c + gate_c · value for each stream c.

    The gathered rows are cast to h's dtype for the projection (bf16 in a bf16 run, as the
    release's embedding output); the gate is computed in fp32."""
    N, hc, d = h.shape
    if hc != cfg.hc_mult or d != cfg.hidden_size:
        raise ValueError(
            f"engram_forward: streams {list(h.shape)} do not match hc_mult {cfg.hc_mult} x "
            f"hidden {cfg.hidden_size}"
        )
    if rows.shape != (N, cfg.n_hash):
        raise ValueError(f"engram_forward: rows {list(rows.shape)}, expected [{N}, {cfg.n_hash}]")
    cd = (
        h.dtype if h.dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64) else torch.float32
    )
    emb = w.table.gather(rows.to(w.table.weight.device))  # the table lives where its file is mapped
    emb = emb.reshape(N, cfg.n_hash * w.table.head_dim).to(cd)
    if emb.device != h.device:  # host rows to the GPU: a pinned, asynchronous copy (a pageable one waits)
        emb = emb.pin_memory().to(h.device, non_blocking=True)
    kv = linear(emb, w.wkv).float()  # [N, (hc + 1)·d]
    key = kv[:, : hc * d].view(N, hc, d)
    value = kv[:, hc * d :]
    x = h.float()
    weight = w.q_weight.float() * w.k_weight.float()  # [hc, d]
    rstd = torch.rsqrt(x.square().mean(-1) + cfg.norm_eps) * torch.rsqrt(key.square().mean(-1) + cfg.norm_eps)
    dot = (x * weight * key).sum(-1) * rstd * d**-0.5  # [N, hc]
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
    if image_mask is not None:
        gate = gate.masked_fill(torch.as_tensor(image_mask, dtype=torch.bool).reshape(N, 1), 0.0)
    return (x + gate[..., None] * value[:, None, :]).to(h.dtype)
