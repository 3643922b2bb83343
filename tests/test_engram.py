"""DeepSeek-V4.1 Engram memory (moesaic/layers/engram.py) without an oracle: published constants,
small independent references written here from the description of the release's
`inference/engram.py` (docs/families/deepseek_v41.md), and broken twins that each check must reject."""

from __future__ import annotations

import json
import math
import re
import struct
import unicodedata

import pytest
import torch

from moesaic.errors import ConfigError
from moesaic.layers.engram import (
    BLOCKED,
    FROZEN_MULTIPLIERS,
    EngramConfig,
    EngramHash,
    EngramState,
    EngramTable,
    EngramWeights,
    build_token_map,
    derive_multipliers,
    engram_forward,
    engram_layouts,
    layer_primes,
    ngram_rows,
    table_rows,
)
from moesaic.models.deepseek_v41 import RELEASE_TEXT_CONFIG as RELEASE
from moesaic.models.deepseek_v41 import engram_bytes, engram_table, engram_tensor_shapes
from moesaic.weights.quant import QuantizedTensor, quantize_fp8_block
from moesaic.weights.store import WeightStore, save_safetensors

# a tiny V4.1 fixture: Engram layers (1, 4), 2 heads, 64-id identity map
TINY = {
    "engram_layer_ids": [1, 4],
    "engram_num_embeddings": [462, 630],
    "engram_max_ngram_size": 4,
    "engram_n_heads": 2,
    "engram_head_dim": 32,
    "engram_vocab_size": 64,
    "engram_compressed_vocab_size": 64,
    "engram_pad_id": 2,
    "hidden_size": 64,
    "hc_mult": 4,
    "num_hidden_layers": 6,
    "vocab_size": 64,
    "rms_norm_eps": 1e-6,
}


# ---------------------------------------------------------------------------------------------
# primes and table sizes
# ---------------------------------------------------------------------------------------------


def _is_prime_trial(n: int) -> bool:
    return n > 1 and all(n % k for k in range(2, math.isqrt(n) + 1))


def _twin_primes(start: int, layers: int, sizes: int, heads: int, exclude_used=True, per_layer_used=False):
    """The release's prime procedure (and its broken variants), by trial division."""
    used, out = set(), []
    for _ in range(layers):
        layer = []
        if per_layer_used:
            used = set()
        for _ in range(sizes):
            current = start - 1
            for _ in range(heads):
                current += 1
                while not _is_prime_trial(current) or (exclude_used and current in used):
                    current += 1
                used.add(current)
                layer.append(current)
        out.append(layer)
    return out


def test_primes_reproduce_the_published_table_sizes():
    rel = RELEASE
    rows = table_rows([rel["engram_vocab_size"]] * 3, 2, rel["engram_max_ngram_size"], rel["engram_n_heads"])
    assert rows == (384_006_168, 384_016_682)
    primes = layer_primes([16_000_000] * 3, 2, 4, 8)
    assert primes[0][0][:3] == [16000057, 16000079, 16000081] and primes[0][2][-1] == 16000463
    assert primes[1][0][0] == 16000477 and primes[1][2][-1] == 16000889
    # an independent trial-division transcription agrees; its broken variants miss the published sums
    twin = _twin_primes(16_000_000, 2, 3, 8)
    assert [sum(t) for t in twin] == [384_006_168, 384_016_682]
    assert [sum(t) for t in _twin_primes(16_000_000, 2, 3, 8, exclude_used=False)][0] != 384_006_168
    assert [sum(t) for t in _twin_primes(16_000_000, 2, 3, 8, per_layer_used=True)][1] != 384_016_682
    # the tiny golden fixture's tables (462, 630) come from the same procedure over 64 ids
    assert table_rows([64] * 3, 2, 4, 2) == (462, 630)
    # offsets: exclusive cumulative sums of the 24 primes in (n, head) order
    lay = engram_layouts(EngramConfig.from_config(RELEASE))
    flat = [p for row in primes[0] for p in row]
    assert lay[0].offsets.tolist() == [sum(flat[:i]) for i in range(24)] and lay[0].rows == 384_006_168


@pytest.mark.parametrize(
    "vocab,layers,S,heads",
    [([100, 50, 100], 3, 4, 5), ([7, 7, 7], 4, 4, 6), ([2], 5, 2, 9), ([1000, 10, 500, 10, 3], 3, 6, 4)]
    + [([30, 20, 10, 5], 6, 5, 7), ([2, 3], 4, 3, 16)],
)
def test_the_prime_search_resumes_where_each_start_left_off_with_the_same_primes(vocab, layers, S, heads):
    # layer_primes resumes a search after the last prime taken from the same start (linear time); the
    # release's procedure restarts at vocab_size - 1 each time and skips every prime taken: the same
    used, want = set(), []
    for _ in range(layers):
        per_layer = []
        for n in range(2, S + 1):
            current, got = vocab[n - 2] - 1, []
            for _ in range(heads):
                current += 1
                while not _is_prime_trial(current) or current in used:
                    current += 1
                used.add(current)
                got.append(current)
            per_layer.append(got)
        want.append(per_layer)
    assert layer_primes(vocab, layers, S, heads) == want


def test_config_checks_the_table_rows_and_names_fields():
    cfg = EngramConfig.from_config({"model_type": "deepseek_v41", "text_config": RELEASE})
    assert cfg.layer_ids == (1, 14) and cfg.n_hash == 24 and cfg.lookback == 3 and cfg.pad_id == 2
    assert EngramConfig.from_config(TINY).num_embeddings == (462, 630)
    assert EngramConfig.from_config({"hidden_size": 8}) is None  # no Engram layers
    with pytest.raises(ConfigError, match="engram_num_embeddings"):
        EngramConfig.from_config({**RELEASE, "engram_num_embeddings": [384006168, 384016683]})
    with pytest.raises(ConfigError, match="engram_num_embeddings"):
        EngramConfig.from_config({**TINY, "engram_n_heads": 3})  # other primes, same declared rows
    with pytest.raises(ConfigError, match="engram_num_embeddings"):
        EngramConfig.from_config({**TINY, "engram_num_embeddings": [462]})
    with pytest.raises(ConfigError, match="engram_pad_id"):
        EngramConfig.from_config({k: v for k, v in TINY.items() if k != "engram_pad_id"})
    with pytest.raises(ConfigError, match="engram_max_ngram_size"):
        EngramConfig.from_config({**TINY, "engram_max_ngram_size": 1})
    with pytest.raises(ConfigError, match="engram_layer_ids"):
        EngramConfig.from_config({**TINY, "engram_layer_ids": [1, 6]})


def test_engram_bytes_and_shapes_of_the_release():
    cfg = EngramConfig.from_config(RELEASE)
    b = engram_bytes(cfg)
    assert [t["rows"] for t in b] == [384_006_168, 384_016_682]
    assert all(t["row_bytes"] == 264 for t in b)  # 256 fp8 + 8 E8M0
    assert b[0]["table_bytes"] == 384_006_168 * 264 and round(b[0]["table_bytes"] / 2**30, 1) == 94.4
    assert round(sum(t["table_bytes"] for t in b) / 2**30, 1) == 188.8
    shapes = engram_tensor_shapes(cfg)
    assert shapes["layers.14.engram.embed.scale"] == ((384_016_682, 8), "F8_E8M0")
    assert shapes["layers.1.engram.wkv.weight"] == ((25600, 6144), "F8_E4M3")
    assert shapes["layers.1.engram.wkv.scale"] == ((800, 192), "F8_E8M0")
    assert shapes["layers.1.engram.q_weight"] == ((4, 5120), "BF16")


# ---------------------------------------------------------------------------------------------
# multipliers
# ---------------------------------------------------------------------------------------------

PUBLISHED_MULTIPLIERS = {  # the release's derivation run with numpy 2.4.6
    1: (76632096046245, 4839876093313, 35959672319349, 73987337458391),
    14: (67716810739261, 51510806800915, 30921347202721, 82619226485591),
}


def test_multipliers_are_frozen_and_rederived():
    bound = max(1, (2**63 - 1) // 99092 // 2)
    assert bound == 46_539_438_283_891
    for lid, vals in PUBLISHED_MULTIPLIERS.items():
        assert FROZEN_MULTIPLIERS[(99092, lid, 4)] == vals
        assert derive_multipliers(lid, 99092, 4) == vals  # the module's numpy-free PCG64 transcription
        assert all(v % 2 == 1 and v < 2 * bound and v < 2**47 and 99091 * v < 2**63 for v in vals)
    for (cvs, lid, s), vals in FROZEN_MULTIPLIERS.items():
        assert derive_multipliers(lid, cvs, s) == vals
    assert derive_multipliers(2, 99092, 4) != derive_multipliers(1, 99092, 4)
    np = pytest.importorskip("numpy")
    for (cvs, lid, s), vals in FROZEN_MULTIPLIERS.items():
        b = max(1, (np.iinfo(np.int64).max // cvs) // 2)
        got = np.random.default_rng(10007 * lid).integers(0, b, size=s, dtype=np.int64) * 2 + 1
        assert tuple(int(x) for x in got) == vals
    for lid in (0, 3, 27, 2**40 + 5):  # the transcription beyond the frozen keys, multi-word seeds too
        b = max(1, (np.iinfo(np.int64).max // 1000) // 2)
        got = np.random.default_rng(10007 * lid).integers(0, b, size=4, dtype=np.int64) * 2 + 1
        assert derive_multipliers(lid, 1000, 4) == tuple(int(x) for x in got)


# ---------------------------------------------------------------------------------------------
# compressed token map
# ---------------------------------------------------------------------------------------------


def _twin_key(text: str) -> str:
    """The release's key chain written with unicodedata + re (independent of `tokenizers`)."""
    t = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    t = "".join(c for c in t if unicodedata.category(c) != "Mn").lower()
    t = re.sub(r"[ \t\r\n]+", " ", t)
    t = "\ue000" if t == " " else t
    t = t.strip().replace("\ue000", " ")
    return t or text


def _twin_map(texts, raws):
    classes, out = {}, []
    for text, raw in zip(texts, raws):
        key = raw if "\ufffd" in text else _twin_key(text)
        out.append(classes.setdefault(key, len(classes)))
    return out


def test_token_map_on_a_vocab_list():
    vocab = [
        "<s>",
        "Hello",
        " hello",
        "HELLO",
        "Café",
        "cafe",
        "  ",
        "\n",
        "é\ufffd",
        "É\ufffd",
        ("\ufffd", "Ã"),
        ("\ufffd", "Ä"),
        ("\ufffd", "Ã"),
        "ﬁ",
        "fi",
        "´",
    ]
    expected = [0, 1, 1, 1, 2, 2, 3, 3, 4, 5, 6, 7, 6, 8, 8, 3]
    assert build_token_map(vocab, expected=9).tolist() == expected
    # broken twin: normalising U+FFFD decodes too would merge "é\ufffd" and "É\ufffd"
    assert _twin_key("é\ufffd") == _twin_key("É\ufffd")
    with pytest.raises(ConfigError, match="engram_compressed_vocab_size"):
        build_token_map(vocab, expected=10)


def _bytes_to_unicode() -> dict[int, str]:
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def test_token_map_on_a_byte_level_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models

    b2u = _bytes_to_unicode()
    piece = lambda bs: "".join(b2u[b] for b in bs)  # noqa: E731
    words = [
        b" The",
        b"the",
        b"THE",
        b" the",
        "é".encode(),
        "É".encode(),
        "ﬁ".encode(),
        b"fi",
        b"  ",
        b"\n\n",
        "è".encode() + b"\xc3",
        "È".encode() + b"\xc3",
        " Ａpple".encode(),
        b"apple",
        b"\t apple \n",
        "\u0301".encode(),
        "´".encode(),
    ]
    vocab = {piece([b]): b for b in range(256)}
    for w in words:
        vocab[piece(w)] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<｜end▁of▁sentence｜>", special=True)])
    cmap = build_token_map(tok)
    n = tok.get_vocab_size(with_added_tokens=True)
    assert cmap.numel() == n == 256 + len(words) + 1
    # documented behaviour, counted by hand: 128 lone high bytes decode to U+FFFD (raw keys, all
    # distinct); of the 128 ASCII bytes, A-Z merge into a-z and \t \n \r into " " (99 classes); then
    # "the", "fi", two U+FFFD pieces, "apple", the lone combining accent (normalises to "", keeps its
    # text) and the special token are new, while é É -> "e", "  " "\n\n" "´" -> " " merge.
    assert int(cmap.max()) + 1 == 128 + 99 + 7 == 234
    texts = tok.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
    assert cmap.tolist() == _twin_map(texts, [tok.id_to_token(i) for i in range(n)])
    ids = {w: vocab[piece(w)] for w in words}
    assert cmap[ids[b" The"]] == cmap[ids[b"THE"]] == cmap[ids[b"the"]]
    assert cmap[ids["é".encode()]] == cmap[ids["É".encode()]] == cmap[ord("e")] == cmap[ord("E")]
    assert cmap[ids["´".encode()]] == cmap[ord(" ")] == cmap[ids[b"\n\n"]] == cmap[ord("\t")]
    assert cmap[ids["è".encode() + b"\xc3"]] != cmap[ids["È".encode() + b"\xc3"]]
    assert cmap[0xC3] != cmap[0xC4]  # lone bytes key on their raw pieces
    # classes by first appearance: ids 0..9 are new, "\n" (10) reuses "\t"'s, "a" (97) reuses "A"'s (65)
    assert cmap[:10].tolist() == list(range(10)) and cmap[10] == 9 and cmap[11] == 10
    assert cmap[ord("a")] == cmap[ord("A")] == 65 - 3  # \n \r " " merged before it
    prev = torch.cummax(cmap, 0).values
    assert bool(((cmap <= prev) & (torch.diff(prev, prepend=torch.tensor([-1])) <= 1)).all())
    with pytest.raises(ConfigError, match="engram_compressed_vocab_size is 99092"):
        build_token_map(tok, expected=99092)
    # the same tokenizer behind transformers (what the release builds its map with) gives the same map
    transformers = pytest.importorskip("transformers")
    assert torch.equal(build_token_map(transformers.PreTrainedTokenizerFast(tokenizer_object=tok)), cmap)


# ---------------------------------------------------------------------------------------------
# the rolling XOR hash
# ---------------------------------------------------------------------------------------------


def _twin_rows(seq, primes, mults, pad, latch=True, start=0):
    """Rows of positions start.. of a whole sequence of compressed ids (-1 = blocked), per the
    release's description, position by position in Python ints."""
    S, H = len(mults), len(primes[0])
    flat = [p for row in primes for p in row]
    offsets = [sum(flat[:i]) for i in range(len(flat))]
    out = []
    for p in range(start, len(seq)):
        toks, blocked = [], False
        for s in range(S):
            gone = p - s < 0 or seq[p - s] < 0
            blocked = (blocked or gone) if latch else gone
            toks.append(pad if blocked else seq[p - s])
        r, row = toks[0] * mults[0], []
        for s in range(1, S):
            r ^= toks[s] * mults[s]
            row += [r % primes[s - 1][h] + offsets[(s - 1) * H + h] for h in range(H)]
        out.append(row)
    return out


# written down from the description for compressed ids [17, 4242, 99091], pad class 2, release layer 1:
# tok(p) = [17, 2, 2, 2], [4242, 17, 2, 2], [99091, 4242, 17, 2]; r_s after each XOR (s = 1, 2, 3)
R_WRITTEN = [
    (1310732291149303, 1382582761641757, 1248936418243251),
    (325014165964774283, 325085732977869153, 324937938970256591),
    (7577665848997174445, 7578270703795591272, 7578409839111667142),
]
ROWS_P2 = [
    10758324,
    24779415,
    42020388,
    60472324,
    68565841,
    94841369,
    109399929,
    115298951,
    130326290,
    146788273,
    172607272,
    188893333,
    199373781,
    217401913,
    228428379,
    253821629,
    267157200,
    284499348,
    288064305,
    317044365,
    321548078,
    338079951,
    353605500,
    374770659,
]


def test_hash_of_a_known_sequence_matches_written_values():
    cfg = EngramConfig.from_config(RELEASE)
    lay = engram_layouts(cfg)[0]
    m = PUBLISHED_MULTIPLIERS[1]
    primes = layer_primes([16_000_000] * 3, 2, 4, 8)[0]
    assert 4242 * m[0] ^ 17 * m[1] == R_WRITTEN[1][0]  # the n = 2 hash at position 1, by hand
    assert (4242 * m[0] ^ 17 * m[1] ^ 2 * m[2]) == R_WRITTEN[1][1]
    rows = ngram_rows(torch.tensor([17, 4242, 99091]), torch.full((3,), BLOCKED), lay, pad_cid=2)
    assert rows.shape == (3, 24) and rows.dtype == torch.int64
    flat = [p for r in primes for p in r]
    for p, rs in enumerate(R_WRITTEN):
        want = [rs[i // 8] % flat[i] + sum(flat[:i]) for i in range(24)]
        assert rows[p].tolist() == want
    assert rows[2].tolist() == ROWS_P2
    assert rows.tolist() == _twin_rows([17, 4242, 99091], primes, m, 2)
    # the multiplier of each shift matters: swapping m_1 and m_2 changes every n >= 2 row at position 2
    assert _twin_rows([17, 4242, 99091], primes, (m[0], m[2], m[1], m[3]), 2)[2] != ROWS_P2


def test_latching_pad_rule_against_a_broken_twin():
    cfg = EngramConfig.from_config(TINY)
    hasher = EngramHash(cfg, torch.arange(64))
    lay = hasher.layouts[1]
    primes, mults = lay.primes.tolist(), lay.multipliers.tolist()
    ids = torch.tensor([5, 9, 63, 7, 11, 13, 200])  # 63 is in an image span; 200 is unmapped
    image = torch.tensor([0, 0, 1, 0, 0, 0, 0], dtype=torch.bool)
    cids = hasher.compress(ids, image)
    assert cids.tolist() == [5, 9, BLOCKED, 7, 11, 13, BLOCKED]
    rows = hasher.rows(ids, EngramState.for_config(cfg), image)[:, 1]
    good = _twin_rows(cids.tolist(), primes, mults, pad=2)
    broken = _twin_rows(cids.tolist(), primes, mults, pad=2, latch=False)
    assert rows.tolist() == good
    assert rows.tolist() != broken
    # where they part: behind the image token, shifts beyond it are pad only with the latch
    diff = [[a != b for a, b in zip(r, q)] for r, q in zip(good, broken)]
    assert not any(diff[0] + diff[1] + diff[5])
    assert diff[3][2:] == [True] * 4 and diff[4][4:] == [True] * 2 and not any(diff[4][:4])
    assert any(diff[6])  # a blocked token blocks its own n-grams (one column collides mod 79)
    # a blocked token itself hashes as all-pad (its gate is 0 at image positions anyway)
    assert good[2] == _twin_rows([2, 2, 2, 2], primes, mults, pad=2, start=3)[0]


def test_chunked_hashing_rollback_and_snapshot_equal_all_at_once():
    cfg = EngramConfig.from_config(TINY)
    hasher = EngramHash(cfg, torch.arange(64).flip(0))  # a non-identity map
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (40,), generator=g)
    image = torch.zeros(40, dtype=torch.bool)
    image[17:20] = True
    full = hasher.rows(ids, EngramState.for_config(cfg), image)
    assert full.shape == (40, 2, 6)

    st = EngramState.for_config(cfg, window=4)
    parts, pos = [], 0
    for n in (7, 1, 1, 13, 2, 16):
        parts.append(hasher.rows(ids[pos : pos + n], st, image[pos : pos + n]))
        pos += n
    assert torch.equal(torch.cat(parts), full)
    assert st.length == 40 and st.nbytes == (3 + 4) * 8 == EngramState.nbytes_for(cfg, 4)

    # speculative decoding: 4 drafts appended, 3 rejected, the right tokens appended after
    st2 = EngramState.for_config(cfg, window=4)
    hasher.rows(ids[:30], st2, image[:30])
    hasher.rows(torch.tensor([1, 2, 3, 4]), st2)
    st2.rollback(4)
    hasher.rows(ids[30:31], st2)
    st2.rollback(1)
    assert torch.equal(hasher.rows(ids[30:], st2), full[30:])
    with pytest.raises(ValueError, match="speculative window"):
        st2.rollback(5)
    st2.rollback(40)  # forgetting everything is always exact
    assert torch.equal(hasher.rows(ids[:5], st2), full[:5])

    # snapshot after a shared prefix, continue, restore, continue differently
    st3 = EngramState.for_config(cfg)
    hasher.rows(ids[:25], st3, image[:25])
    snap = st3.snapshot()
    hasher.rows(torch.tensor([9, 9, 9]), st3)
    st3.restore(snap)
    assert torch.equal(hasher.rows(ids[25:], st3), full[25:])

    # broken twin: a chunk hashed without the lookback differs from the whole
    assert not torch.equal(hasher.rows(ids[25:], EngramState.for_config(cfg)), full[25:])


# ---------------------------------------------------------------------------------------------
# row gather from fp8 rows + E8M0 scales on disk
# ---------------------------------------------------------------------------------------------


def _fp8_rows(rows: int, head_dim: int, gen, exps=(110, 140)) -> tuple[torch.Tensor, torch.Tensor]:
    codes = torch.randint(0, 256, (rows, head_dim), dtype=torch.uint8, generator=gen)
    codes[(codes & 0x7F) == 0x7F] = 0x10  # no NaN codes
    exps = torch.randint(*exps, (rows, head_dim // 32), dtype=torch.uint8, generator=gen)
    return codes.view(torch.float8_e4m3fn), exps.view(torch.float8_e8m0fnu)


def _dense_reference(codes, exps):
    """value = fp8 · 2^(e - 127), one exponent per 32 columns, decoded here without moesaic."""
    scale = torch.pow(2.0, exps.view(torch.uint8).double() - 127).repeat_interleave(32, dim=1)
    return (codes.to(torch.float64) * scale).float()


def test_gather_from_an_mmapped_fp8_table(tmp_path):
    g = torch.Generator().manual_seed(1)
    codes, exps = _fp8_rows(777, 64, g)
    (tmp_path / "config.json").write_text("{}")
    save_safetensors(
        {
            "layers.1.engram.embed.weight": codes,
            "layers.1.engram.embed.scale": exps,
            "dense": torch.randn(5, 64),
        },
        tmp_path / "model.safetensors",
    )
    store = WeightStore(tmp_path)
    dense = _dense_reference(codes, exps)
    rows = torch.tensor([[0, 776, 5], [5, 123, 400]])
    via_get = EngramTable(store.get("layers.1.engram.embed.weight"), store.get("layers.1.engram.embed.scale"))
    # the one way a model maps a table: the load hands a mapped spec over as a view of the file's map
    # (store.get(count=False)), which the V4.1 binder turns into the table
    via_map = engram_table(
        store.get("layers.1.engram.embed.weight", count=False),
        store.get("layers.1.engram.embed.scale", count=False),
        "layers.1.engram.embed",
    )
    for table in (via_get, via_map):
        out = table.gather(rows)
        assert out.shape == (2, 3, 64) and out.dtype == torch.float32
        assert torch.equal(out, dense[rows])
    with pytest.raises(IndexError):
        via_map.gather(torch.tensor([777]))
    # the bf16/fp32 path for tiny tables, and a broken twin that interleaves the two scales by column
    bf = EngramTable(dense.to(torch.bfloat16))
    assert torch.equal(bf.gather(rows), dense.to(torch.bfloat16).float()[rows])
    wrong = codes.float() * torch.pow(2.0, exps.view(torch.uint8).float() - 127)[:, torch.arange(64) % 2]
    assert not torch.equal(via_map.gather(rows), wrong[rows])


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _write_sparse_table(path, rows: int, head_dim: int, known: dict[int, tuple[bytes, bytes]]):
    """A safetensors file holding embed.weight [rows, head_dim] F8_E4M3 + embed.scale [rows, head_dim/32]
    F8_E8M0 where only the `known` rows are written: the rest is a hole (zeros) in a sparse file."""
    nscale = head_dim // 32
    header = {
        "embed.weight": {"dtype": "F8_E4M3", "shape": [rows, head_dim], "data_offsets": [0, rows * head_dim]},
        "embed.scale": {
            "dtype": "F8_E8M0",
            "shape": [rows, nscale],
            "data_offsets": [rows * head_dim, rows * (head_dim + nscale)],
        },
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    base = 8 + len(raw)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(base + rows * (head_dim + nscale))
        for r, (c, s) in known.items():
            f.seek(base + r * head_dim)
            f.write(c)
            f.seek(base + rows * head_dim + r * nscale)
            f.write(s)


@pytest.fixture
def sparse_dir(tmp_path):
    yield tmp_path
    for f in tmp_path.glob("*/model.safetensors"):  # 100 GB apparent size: leave nothing for a copier
        f.unlink()


def test_gather_reads_only_the_touched_rows(sparse_dir):
    """A 4 GiB table through WeightStore.get (dequantized it would be 16 GiB) and a table of the
    release's 384,006,168 rows (101 GB, 94.4 GiB) addressed by a real hash: both sparse files."""
    tmp_path = sparse_dir
    g = torch.Generator().manual_seed(2)
    codes, exps = _fp8_rows(8, 256, g)
    dense = _dense_reference(codes, exps)

    rows_small = 1 << 24
    picks = [0, 12345, rows_small - 1]
    folder = tmp_path / "small"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    _write_sparse_table(
        folder / "model.safetensors",
        rows_small,
        256,
        {
            r: (codes[i].view(torch.uint8).numpy().tobytes(), exps[i].view(torch.uint8).numpy().tobytes())
            for i, r in enumerate(picks)
        },
    )
    store = WeightStore(folder)
    before = _rss()
    table = EngramTable(store.get("embed.weight"), store.get("embed.scale"))
    out = table.gather(torch.tensor([rows_small - 1, 0, 12345, 777]))
    assert _rss() - before < 64 * 2**20
    assert torch.equal(out[:3], dense[[2, 0, 1]]) and not out[3].any()

    # the release's table size, rows from the release layout's hash of a short prompt
    cfg = EngramConfig.from_config(RELEASE)
    lay = engram_layouts(cfg)[0]
    rows = ngram_rows(torch.tensor([17, 4242, 99091]), torch.full((3,), BLOCKED), lay, pad_cid=2)
    want = rows.reshape(-1)[:8].tolist()
    folder = tmp_path / "release"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    _write_sparse_table(
        folder / "model.safetensors",
        lay.rows,
        256,
        {
            r: (codes[i].view(torch.uint8).numpy().tobytes(), exps[i].view(torch.uint8).numpy().tobytes())
            for i, r in enumerate(want)
        },
    )
    store = WeightStore(folder)
    before = _rss()
    table = engram_table(
        store.get("embed.weight", count=False), store.get("embed.scale", count=False), "embed"
    )
    assert table.rows == 384_006_168 and table.block == 32
    out = table.gather(rows)  # [3, 24, 256]
    assert _rss() - before < 64 * 2**20
    assert torch.equal(out.reshape(-1, 256)[:8], dense)
    assert not out.reshape(-1, 256)[8:].any()


# ---------------------------------------------------------------------------------------------
# gather + keys-first projection + signed square-root gate, against a reference written here
# ---------------------------------------------------------------------------------------------


def _reference_engram(
    h,
    rows,
    table,
    wkv,
    q_weight,
    k_weight,
    eps,
    image=None,
    keys_first=True,
    signed_sqrt=True,
    per_stream=True,
):
    """Gather, keys-first projection and per-stream gate (the module docstring's last three lines)
    token by token, stream by stream, in float64."""
    N, hc, d = h.shape
    out = h.double().clone()
    for t in range(N):
        e = torch.cat([table[r].double() for r in rows[t].tolist()])
        kv = wkv.double() @ e
        keys, value = (kv[: hc * d].view(hc, d), kv[hc * d :]) if keys_first else (kv[d:].view(hc, d), kv[:d])
        for c in range(hc):
            x, k = h[t, c].double(), keys[c]
            w = q_weight[c].double() * k_weight[c].double()
            if per_stream:
                rstd = 1 / math.sqrt(float((x * x).mean()) + eps) / math.sqrt(float((k * k).mean()) + eps)
            else:
                hx, kk = h[t].double(), keys
                rstd = 1 / math.sqrt(float((hx * hx).mean()) + eps) / math.sqrt(float((kk * kk).mean()) + eps)
            dot = float((x * w * k).sum()) * rstd / math.sqrt(d)
            z = math.copysign(math.sqrt(max(abs(dot), 1e-6)), dot) if signed_sqrt else dot
            gate = 0.0 if (image is not None and image[t]) else 1 / (1 + math.exp(-z))
            out[t, c] = x + gate * value
    return out


def _tiny_layer(gen, fp8_wkv: bool):
    cfg = EngramConfig.from_config(TINY)
    d, hc, k = cfg.hidden_size, cfg.hc_mult, cfg.n_hash * cfg.head_dim
    codes, exps = _fp8_rows(cfg.num_embeddings[1], cfg.head_dim, gen, exps=(118, 124))  # |values| < 14
    table = EngramTable(codes, exps)
    w = torch.randn((hc + 1) * d, k, generator=gen) * k**-0.5
    if fp8_wkv:
        q = quantize_fp8_block(w, (32, 32), scale_fmt="ue8m0", naming="deepseek")
        wkv = QuantizedTensor("fp8_block", q["weight"], q["scale"], block=(32, 32), name="engram.wkv")
        w = wkv.dequantize()
    else:
        wkv = w
    qw = (1 + 0.3 * torch.randn(hc, d, generator=gen)).to(torch.bfloat16)
    kw = (1 + 0.3 * torch.randn(hc, d, generator=gen)).to(torch.bfloat16)
    return cfg, EngramWeights(table, wkv, qw, kw), _dense_reference(codes, exps), w


def test_engram_forward_against_an_independent_reference():
    g = torch.Generator().manual_seed(3)
    cfg, weights, dense_table, w = _tiny_layer(g, fp8_wkv=True)
    hasher = EngramHash(cfg, torch.arange(64))
    ids = torch.randint(0, 64, (9,), generator=g)
    image = torch.zeros(9, dtype=torch.bool)
    image[4] = True
    rows = hasher.rows(ids, EngramState.for_config(cfg), image)[:, 1]
    h = torch.randn(9, cfg.hc_mult, cfg.hidden_size, generator=g)
    out = engram_forward(h, rows, weights, cfg, image)
    ref = _reference_engram(h, rows, dense_table, w, weights.q_weight, weights.k_weight, cfg.norm_eps, image)
    err = (out.double() - ref).abs().max().item() / ref.abs().max().item()
    assert err < 1e-6, err
    assert torch.equal(out[4], h[4])  # image positions pass through untouched
    assert (out - h).abs().amax(dim=(1, 2))[[0, 1, 2, 3, 5, 6, 7, 8]].min() > 1e-3  # Engram is not a no-op
    # broken twins: value first, a plain sigmoid, one RMS over all streams, no image mask
    for kw in ({"keys_first": False}, {"signed_sqrt": False}, {"per_stream": False}):
        twin = _reference_engram(
            h, rows, dense_table, w, weights.q_weight, weights.k_weight, cfg.norm_eps, image, **kw
        )
        assert (out.double() - twin).abs().max().item() > 1e-3, kw
    assert (engram_forward(h, rows, weights, cfg) - out).abs().max() > 1e-3
    # rows of another layer's hash (or shifted rows) give another result
    other = hasher.rows(ids, EngramState.for_config(cfg), image)[:, 0]
    assert (engram_forward(h, other + 100, weights, cfg, image) - out).abs().max() > 1e-3


def test_engram_forward_dense_and_bf16_streams():
    g = torch.Generator().manual_seed(4)
    cfg, weights, dense_table, w = _tiny_layer(g, fp8_wkv=False)
    rows = torch.randint(0, cfg.num_embeddings[1], (5, cfg.n_hash), generator=g)
    h = torch.randn(5, cfg.hc_mult, cfg.hidden_size, generator=g)
    ref = _reference_engram(h, rows, dense_table, w, weights.q_weight, weights.k_weight, cfg.norm_eps)
    err = (engram_forward(h, rows, weights, cfg).double() - ref).abs().max().item() / ref.abs().max().item()
    assert err < 1e-6, err
    out16 = engram_forward(h.to(torch.bfloat16), rows, weights, cfg)
    assert out16.dtype == torch.bfloat16
    assert (out16.double() - ref).abs().max().item() < 0.05 * ref.abs().max().item()
    with pytest.raises(ValueError, match="rows"):
        engram_forward(h, rows[:, :5], weights, cfg)
