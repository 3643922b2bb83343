"""Tokenizers: the demo model's byte-level one, and a checkpoint's own `tokenizer.json`."""

from __future__ import annotations

import codecs
import json
import re
from pathlib import Path

from .errors import ConfigError, RequestError

BYTE_OFFSET = 3  # ids 0, 1, 2 are <pad>, <s>, </s>; byte b is id b + 3


class ByteTokenizer:
    """Every UTF-8 byte is a token. Used by the built-in demo models.

    `special_tokens`: marker strings that are single tokens (a chat format's `<think>`, `[INST]`, ...),
    matched in the text before the bytes, as a tokenizer's added special tokens are. "<pad>", "<s>" and
    "</s>" are ids 0, 1, 2; any other gets the next id after the bytes (259, 260, ...), in list order.
    Without any, "<s>" in a text is its bytes. `decode` leaves the special tokens out unless
    `skip_special_tokens=False`."""

    pad_id, bos_id, eos_ids = 0, 1, (2,)
    chat_template = None
    BASE = ("<pad>", "<s>", "</s>")

    def __init__(self, special_tokens=()):
        special_tokens = tuple(special_tokens)
        self.special = {name: i for i, name in enumerate(self.BASE)}
        for t in special_tokens:
            if not isinstance(t, str) or not t:
                raise ConfigError(f"a special token is a non-empty string, got {t!r}")
            self.special.setdefault(t, 256 + BYTE_OFFSET + len(self.special) - len(self.BASE))
        self.added = [t for t in self.special if t not in self.BASE]
        self.names = {i: t for t, i in self.special.items()}
        self.vocab_size = 256 + BYTE_OFFSET + len(self.added)
        # the longest marker first, so that "<|im_end|>" is not read as a shorter marker it starts with
        by_length = sorted(self.special, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, by_length)) + ")") if special_tokens else None

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = [self.bos_id] if add_bos else []
        parts = self._split.split(text) if self._split else [text]
        for k, part in enumerate(parts):
            if k % 2:  # a special token (the split's captured groups)
                ids.append(self.special[part])
            else:
                ids.extend(b + BYTE_OFFSET for b in part.encode("utf-8"))
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        out, run = [], bytearray()
        for i in ids:
            if BYTE_OFFSET <= i < 256 + BYTE_OFFSET:
                run.append(i - BYTE_OFFSET)
            elif i in self.names and not skip_special_tokens:
                out.append(run.decode("utf-8", "replace"))
                run = bytearray()
                out.append(self.names[i])
        out.append(run.decode("utf-8", "replace"))
        return "".join(out)

    def stream_decoder(self):
        dec = codecs.getincrementaldecoder("utf-8")("replace")

        def feed(token_id: int) -> str:
            if BYTE_OFFSET <= token_id < 256 + BYTE_OFFSET:
                return dec.decode(bytes([token_id - BYTE_OFFSET]))
            return ""

        return feed

    def apply_chat_template(self, messages: list[dict]) -> str:
        # The demo has no template: a plain transcript.
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


class HFTokenizer:
    """A checkpoint's `tokenizer.json` (via the `tokenizers` package) and its `tokenizer_config.json`
    (special tokens, BOS handling, and the Jinja chat template)."""

    def __init__(self, folder: Path, eos_ids: tuple[int, ...] = ()):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        tc = {}
        if (folder / "tokenizer_config.json").exists():
            tc = json.loads((folder / "tokenizer_config.json").read_text())
        self.chat_template = tc.get("chat_template")
        if self.chat_template is None and (folder / "chat_template.jinja").exists():
            self.chat_template = (folder / "chat_template.jinja").read_text()
        self.special = {
            k: _token_str(tc.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")
        }
        self.bos_id = self._id(self.special["bos_token"])
        eos = self._id(self.special["eos_token"])
        self.eos_ids = tuple(eos_ids) or ((eos,) if eos is not None else ())
        self.add_bos = bool(tc.get("add_bos_token", False))
        self.vocab_size = self.tok.get_vocab_size()

    def _id(self, token: str | None):
        return None if token is None else self.tok.token_to_id(token)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if add_bos and self.add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def stream_decoder(self):
        ids: list[int] = []
        emitted = [""]

        def feed(token_id: int) -> str:
            ids.append(token_id)
            text = self.decode(ids)
            if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
                return ""
            new = text[len(emitted[0]) :] if text.startswith(emitted[0]) else text
            emitted[0] = text
            return new

        return feed

    def apply_chat_template(self, messages: list[dict]) -> str:
        if not self.chat_template:
            raise RequestError("this checkpoint's tokenizer has no chat template; drop --chat")
        import jinja2

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])

        def raise_exception(msg):
            raise RequestError(f"chat template: {msg}")

        env.globals["raise_exception"] = raise_exception
        tmpl = env.from_string(self.chat_template)
        return tmpl.render(
            messages=messages, add_generation_prompt=True, **{k: v or "" for k, v in self.special.items()}
        )


def _token_str(v):
    if isinstance(v, dict):  # {"content": "<s>", ...}
        return v.get("content")
    return v


def load_tokenizer(folder: Path, raw_config: dict, eos_ids: tuple[int, ...]):
    if (
        raw_config.get("moesaic_tokenizer") == "bytes"
    ):  # a demo: its chat markers are `moesaic_special_tokens`
        return ByteTokenizer(raw_config.get("moesaic_special_tokens") or ())
    if (folder / "tokenizer.json").exists():
        return HFTokenizer(folder, eos_ids)
    if (folder / "tekken.json").exists():
        raise ConfigError(
            f"{folder}: Mistral's tekken.json tokenizer is not supported yet; pass token ids instead of text"
        )
    return None
