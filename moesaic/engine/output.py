"""What a request gives back: incremental detokenization with stop strings, and the output records."""

from __future__ import annotations

from dataclasses import dataclass, field


class Detokenizer:
    """Text of a sequence's generated tokens, one token at a time, and its stop strings.

    Each new token decodes a short window (vLLM's prefix/read offsets): the text of ids[prefix:] minus
    that of ids[prefix:read] is new, unless it ends in an incomplete UTF-8 sequence (U+FFFD), which waits
    for the next token. A stop string found in the text ends the request; the text is cut where it
    starts. While a stop string could still be completing, its possible beginning is held back from
    `visible()` (what a stream may show), so a stream never shows part of a stop string."""

    def __init__(self, tokenizer, stops: list[str] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = self.read = 0
        self.text = ""
        self.stops = list(stops)
        self.longest = max((len(s) for s in self.stops), default=0)

    def _decode(self, ids) -> str:
        if self.tokenizer is None:
            return ""
        if self.skip_special_tokens:
            return self.tokenizer.decode(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def feed(self, tok: int) -> None:
        self.ids.append(tok)
        before = self._decode(self.ids[self.prefix : self.read])
        now = self._decode(self.ids[self.prefix :])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.text += now[len(before) :]
            self.prefix, self.read = self.read, len(self.ids)

    def flush(self) -> None:
        """At the end: whatever the last tokens decode to, even an incomplete character."""
        if self.read < len(self.ids):
            before = self._decode(self.ids[self.prefix : self.read])
            now = self._decode(self.ids[self.prefix :])
            self.text += now[len(before) :] if now.startswith(before) else now
            self.prefix = self.read = len(self.ids)

    def find_stop(self, searched: int) -> str | None:
        """The stop string that now occurs in the text (the earliest; `searched`: text length already
        checked), cutting the text where it starts; None if none does."""
        if not self.stops:
            return None
        lo = max(0, searched - self.longest + 1)
        best = None
        for s in self.stops:
            at = self.text.find(s, lo)
            if at != -1 and (best is None or at < best[0]):
                best = (at, s)
        if best is None:
            return None
        self.text = self.text[: best[0]]
        return best[1]

    def visible_len(self, finished: bool) -> int:
        if finished or not self.longest:
            return len(self.text)
        return max(0, len(self.text) - (self.longest - 1))

    def visible(self, finished: bool) -> str:
        return self.text[: self.visible_len(finished)]


@dataclass
class CompletionOutput:
    """One sample of a request. In a stream's incremental outputs `token_ids` and `text` are what is new."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string matched (None for EOS)
    logprobs: list[dict[int, float]] | None = None  # per token {id: logprob}: top-k and the sampled one


@dataclass
class RequestOutput:
    """A request's result: one CompletionOutput per sample (vLLM's shape). `token_ids`, `text`,
    `finish_reason`, `stop_reason` and `logprobs` are the first sample's, for n == 1."""

    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    request_id: str | None = None
    num_cached_tokens: int = 0
    finished: bool = True
    usage: dict = field(default_factory=dict)  # prompt_tokens, completion_tokens, cached_tokens
    error: BaseException | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self):
        return self.outputs[0].stop_reason

    @property
    def logprobs(self):
        return self.outputs[0].logprobs
