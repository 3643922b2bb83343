"""Structured output: `response_format` (json_object, json_schema) and forced tool calls as xgrammar token
masks, through the engine's per-sample `logits_processor` hook (engine/sampler.py).

The vocabulary is given to xgrammar as each id's bytes: the byte tokenizer's ids are single bytes; a
`tokenizer.json` vocabulary is read through xgrammar's own detection of its encoding (byte-level BPE,
byte fallback, raw). Special tokens are given as empty strings, which xgrammar never allows inside a
grammar: their text is not in the output (it is decoded without them), so a grammar must not count on
it. Output is compact (no free whitespace between JSON tokens: a model cannot loop on spaces), with the
separators ", " and ": ", so no token holding a control character (bytes 0x00-0x1f) is ever needed: JSON
forbids them raw inside strings, and xgrammar's string rule lets them through, so they are masked too.
Logprobs stay those of the model's own distribution.
"""

from __future__ import annotations

import json
import threading

import torch

from moesaic.errors import RequestError
from moesaic.tokenizer import BYTE_OFFSET, ByteTokenizer


def tokenizer_info(tokenizer, vocab_size: int, eos_ids):
    """xgrammar's TokenizerInfo of a moesaic tokenizer, padded with empty (never allowed) entries to the
    model's vocab_size."""
    import xgrammar as xgr

    if isinstance(tokenizer, ByteTokenizer):
        vocab = [b""] * BYTE_OFFSET + [bytes([b]) for b in range(256)]
        vocab += [b""] * (vocab_size - len(vocab))
        return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=eos_ids)
    tok = tokenizer.tok  # HFTokenizer's tokenizers.Tokenizer
    vocab = [""] * vocab_size
    for token, i in tok.get_vocab(with_added_tokens=True).items():
        if i < vocab_size:
            vocab[i] = token
    for i, added in tok.get_added_tokens_decoder().items():
        if added.special and i < vocab_size:
            vocab[i] = ""
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(tok.to_str())
    return xgr.TokenizerInfo(
        vocab,
        meta["vocab_type"],
        vocab_size=vocab_size,
        stop_token_ids=eos_ids,
        add_prefix_space=meta["add_prefix_space"],
    )


class Grammars:
    """Compiles grammars for one tokenizer (xgrammar's compiler caches them) and makes the per-sample
    processors. Built on first use: a server that is never asked for structured output never loads
    xgrammar."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, sorted(eos_ids)
        self._compiler = None
        self.control = None  # ids of the tokens that hold a control character
        self._lock = threading.Lock()

    def compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = tokenizer_info(self.tokenizer, self.vocab_size, self.eos_ids)
                ids = [i for i, b in enumerate(info.decoded_vocab) if any(c < 0x20 for c in b)]
                self.control = torch.tensor(ids, dtype=torch.long)
                self._compiler = xgr.GrammarCompiler(info, max_threads=2)
            return self._compiler

    def json_schema(self, schema, param: str = "response_format"):
        """The compiled grammar of a JSON schema (a dict); RequestError naming `param` when it cannot compile."""
        if not isinstance(schema, dict):
            raise RequestError(f"{param}: the JSON schema must be an object, got {type(schema).__name__}")
        try:
            text = json.dumps(schema)
        except (TypeError, ValueError) as e:
            raise RequestError(f"{param}: the JSON schema is not JSON ({e})") from None
        try:
            return self.compiler().compile_json_schema(text, any_whitespace=False, strict_mode=True)
        except RuntimeError as e:  # xgrammar's schema converter
            raise RequestError(
                f"{param}: the JSON schema cannot be compiled to a grammar: {_reason(e)}"
            ) from None

    def processor(self, compiled):
        """The engine's logits_processor factory for a compiled grammar."""
        return lambda: GrammarProcessor(compiled, self.vocab_size, self.control)


def _reason(e: Exception) -> str:
    # xgrammar prefixes its messages with "[time] /path/file.cc:line: "
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return msg.split(": ", 1)[1] if msg.startswith("[") and ": " in msg else msg


class GrammarProcessor:
    """One sample's grammar state: masks the logits to what the grammar allows next, and follows the
    sampled tokens."""

    def __init__(self, compiled, vocab_size: int, control=None):
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self.vocab_size = vocab_size
        self.control = control

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        import xgrammar as xgr

        x = logits.float().clone()
        if self.matcher.is_terminated():
            return x
        self.matcher.fill_next_token_bitmask(self.bitmask)
        rows = x.view(1, -1)
        xgr.apply_token_bitmask_inplace(rows, self.bitmask.to(x.device), vocab_size=self.vocab_size)
        if self.control is not None and len(self.control):
            x[self.control.to(x.device)] = float("-inf")
        return x

    def accept(self, token: int) -> None:
        if not self.matcher.is_terminated() and not self.matcher.accept_token(int(token)):
            raise RequestError(f"token {token} does not continue the requested grammar (response_format)")
