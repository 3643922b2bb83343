"""Tokenizers: the demo model's byte-level one, and a checkpoint's own `tokenizer.json`."""

from __future__ import annotations

import codecs
import contextvars
import json
import os
import re
import string
from pathlib import Path

from .errors import CheckpointError, ConfigError, RequestError

BYTE_OFFSET = 3  # ids 0, 1, 2 are <pad>, <s>, </s>; byte b is id b + 3


def utf8(text: str) -> bytes:
    """`text` as UTF-8; a RequestError for a string Unicode cannot encode (a lone surrogate, e.g. what
    Python makes of command-line bytes that were not UTF-8)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(
            f"the prompt is not valid Unicode: it holds a lone surrogate ({text[e.start : e.end]!r} at index "
            f"{e.start}); was the input UTF-8?"
        ) from None


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
                ids.extend(b + BYTE_OFFSET for b in utf8(part))
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
    (special tokens, BOS handling, and the Jinja chat template). Everything is read and checked here,
    at load: a file that cannot work is the checkpoint's error (CheckpointError / ConfigError), and
    only what a request's messages make the template do is the request's (RequestError)."""

    def __init__(self, folder: Path, eos_ids: tuple[int, ...] = ()):
        from tokenizers import Tokenizer

        path = folder / "tokenizer.json"
        _check_file(path, CheckpointError)
        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers package raises a bare Exception for a file it cannot parse
            raise CheckpointError(f"{path}: not a tokenizer the tokenizers package can read ({e})") from None
        where = str(folder / "tokenizer_config.json")
        tc = _read_json(folder / "tokenizer_config.json") if os.path.lexists(where) else {}
        self.chat_template = _chat_template(tc.get("chat_template"), where)
        jinja = folder / "chat_template.jinja"
        if self.chat_template is None and os.path.lexists(jinja):
            _check_file(jinja, ConfigError)
            try:
                self.chat_template = jinja.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise ConfigError(f"{jinja}: cannot be read as text ({e})") from None
            where = str(jinja)
        self.template = None if self.chat_template is None else _compile(self.chat_template, where)
        tc_where = str(folder / "tokenizer_config.json")
        self.special = {
            k: _token_str(tc.get(k), tc_where, k)
            for k in ("bos_token", "eos_token", "pad_token", "unk_token")
        }
        self.bos_id = self._id(self.special["bos_token"])
        eos = self._id(self.special["eos_token"])
        self.eos_ids = tuple(eos_ids) or ((eos,) if eos is not None else ())
        add_bos = tc.get("add_bos_token", False)
        if add_bos is not None and not isinstance(add_bos, bool):
            raise ConfigError(f"{tc_where}: field 'add_bos_token' must be true or false, got {add_bos!r}")
        self.add_bos = bool(add_bos)
        self.vocab_size = self.tok.get_vocab_size()

    def _id(self, token: str | None):
        return None if token is None else self.tok.token_to_id(token)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        utf8(text)  # a lone surrogate cannot be tokenized: say so
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
        if self.template is None:
            raise RequestError("this checkpoint's tokenizer has no chat template; drop --chat")
        import jinja2

        token = _budget.set([RENDER_BUDGET])
        try:
            return self.template.render(
                messages=messages, add_generation_prompt=True, **{k: v or "" for k, v in self.special.items()}
            )
        except RequestError:
            raise
        except (
            jinja2.TemplateError,
            TypeError,
            ValueError,
            LookupError,
            AttributeError,
            ArithmeticError,
        ) as e:
            # the template is the checkpoint's code: what it trips over on these messages is this request's
            raise RequestError(
                f"the chat template failed on these messages ({type(e).__name__}: {e})"
            ) from None
        finally:
            _budget.reset(token)


def _raise_exception(msg):
    raise RequestError(f"chat template: {msg}")


# What one render may build: range items over all its loops, and the length of a repeated string or list.
# jinja2's sandbox bounds one range (100,000 items) but not nested ones, nor "x" * 10**9.
RENDER_BUDGET = 1_000_000
_budget: contextvars.ContextVar[list[int]] = contextvars.ContextVar("chat_template_budget")


def _spend(n: int) -> None:
    left = _budget.get([RENDER_BUDGET])
    left[0] -= n
    if left[0] < 0:
        raise RequestError(
            f"the chat template builds more than {RENDER_BUDGET:,} loop items or characters in one render"
        )


def _range(*args):
    r = range(*args)
    _spend(len(r))
    return r


def _spend_widths(fmt) -> None:
    """The field widths of a format string ("{:>9}", "%9s") count against the budget: "{:>1000000000}"
    would build a gigabyte of spaces."""
    if not isinstance(fmt, str):
        return
    widths = re.findall(r"%[-+ #0]*(\d+)|%[-+ #0]*\d*\.(\d+)", fmt)
    try:
        widths += [
            (w, "")
            for _, _, spec, _ in string.Formatter().parse(fmt)
            if spec
            for w in re.findall(r"\d+", spec)
        ]
    except ValueError:
        pass  # not a valid str.format string: str.format will say so
    for a, b in widths:
        _spend(int(a or b or 0))


def _budgeted(filter_, name: str):
    """A width-taking filter (center, indent) or `format` whose widths count against the render budget."""

    def run(value, *args, **kwargs):
        if name == "format":
            _spend_widths(value)
        else:
            width = kwargs.get("width", args[0] if args else 0)
            if isinstance(width, int):
                _spend(max(width, 0) * (str(value).count("\n") + 1))
        return filter_(value, *args, **kwargs)

    return run


def _compile(template: str, where: str):
    """The chat template compiled once, at load, in jinja2's sandbox, as transformers renders it (the
    template is the checkpoint's code and must not reach Python's internals), with a budget on what one
    render may build. A syntax error is the checkpoint's ConfigError, not every request's."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Sandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "%"})

        def call_binop(self, context, operator, left, right):
            if operator == "**" and isinstance(right, int) and abs(right) > 64:
                raise RequestError(f"the chat template raises to the power {right}")
            if operator == "%":
                _spend_widths(left)
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                        _spend(len(seq) * max(n, 0))
            return super().call_binop(context, operator, left, right)

        def wrap_str_format(self, value):
            wrapped = super().wrap_str_format(value)
            if wrapped is not None:
                _spend_widths(value.__self__)
            return wrapped

    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise_exception
    env.globals["range"] = _range
    for name in ("center", "indent", "format"):
        env.filters[name] = _budgeted(env.filters[name], name)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(
            f"{where}: the chat template has a syntax error at line {e.lineno}: {e.message}"
        ) from None


def _chat_template(v, where: str) -> str | None:
    """tokenizer_config.json's chat_template: text, or transformers' list of named templates (the one
    named "default" is used)."""
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, list) and all(isinstance(t, dict) and isinstance(t.get("template"), str) for t in v):
        named = {t.get("name"): t["template"] for t in v}
        if "default" in named:
            return named["default"]
    raise ConfigError(
        f"{where}: field 'chat_template' must be a template string or a list of {{name, template}} "
        f"holding a 'default', got {type(v).__name__}"
    )


def _token_str(v, where: str, key: str):
    if isinstance(v, dict):  # {"content": "<s>", ...}
        v = v.get("content")
    if v is not None and not isinstance(v, str):
        raise ConfigError(f"{where}: field {key!r} must be a token string, got {v!r:.100}")
    return v


def _check_file(path: Path, error) -> None:
    """A regular file (not a folder, a broken link, a link loop or a device), else `error` saying so."""
    if not path.is_file():
        if os.path.islink(path) and not path.exists():
            why = "a broken symlink or a symlink loop"
        else:
            why = "a folder" if path.is_dir() else "not a regular file"
        raise error(f"{path}: cannot be read ({why})")


def _read_json(path: Path) -> dict:
    _check_file(path, ConfigError)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # ValueError: bad JSON or bad UTF-8
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def load_tokenizer(folder: Path, raw_config: dict, eos_ids: tuple[int, ...]):
    if (
        raw_config.get("moesaic_tokenizer") == "bytes"
    ):  # a demo: its chat markers are `moesaic_special_tokens`
        return ByteTokenizer(raw_config.get("moesaic_special_tokens") or ())
    if os.path.lexists(folder / "tokenizer.json"):  # lexists: a broken link is an error, not "no tokenizer"
        return HFTokenizer(folder, eos_ids)
    if os.path.lexists(folder / "tekken.json"):
        raise ConfigError(
            f"{folder}: Mistral's tekken.json tokenizer is not supported yet; pass token ids instead of text"
        )
    return None
