"""The async engine: one background thread steps the engine core; requests come in from an asyncio event
loop and get an async iterator of incremental outputs.

The event loop never waits for a step: new requests and aborts are queued for the stepping thread, which
takes them between steps (so an abort frees the request's blocks before the next step at the latest), and
outputs come back through `loop.call_soon_threadsafe`. torch releases the GIL inside its kernels, so the
event loop keeps serving while a forward runs.

Each item an iterator yields is a RequestOutput whose CompletionOutputs carry only what is new since the
previous item (token ids, text, logprobs) for the samples that changed, with `usage` cumulative; the last
item has `finished=True` and every sample's finish_reason. A request whose processing fails (a bad value,
a detokenizer error, a forward that raises for it) ends its iterator with that exception; the loop and
the other requests go on.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

from ..errors import RequestError
from .engine import Engine
from .output import CompletionOutput, RequestOutput
from .sampler import SamplingParams
from .sequence import Sequence

log = logging.getLogger("moesaic")


@dataclass(eq=False)
class _Request:
    seq: Sequence
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    sent: dict = field(default_factory=dict)  # sample index -> (tokens, chars, logprobs, finished) sent
    done: bool = False


class AsyncEngine:
    def __init__(self, engine: Engine, idle_wait_s: float = 0.05):
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self.requests: dict[str, _Request] = {}
        self._new: deque[_Request] = deque()
        self._aborts: deque[str] = deque()
        self._wake = threading.Event()
        self._stop = False
        self.accepting = True
        self.loop_errors = 0
        self.thread = threading.Thread(target=self._run, name="moesaic-engine", daemon=True)
        self.thread.start()

    # ---- the event loop's side
    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None):
        """Checks and queues a request; returns the async iterator of its outputs. RequestError /
        CapacityError at once for one that is malformed or can never fit."""
        if not self.accepting:
            raise RequestError("the engine is shutting down; no new requests")
        if request_id is None:
            request_id = uuid.uuid4().hex
        if not isinstance(request_id, str) or not request_id:
            raise RequestError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self.requests:
            raise RequestError(f"request_id {request_id!r} is already running")
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise RequestError("add_request is called from a running asyncio event loop") from None
        seq = Sequence(list(prompt_ids), params, request_id=request_id)
        self.engine.check(seq)
        req = _Request(seq, loop, asyncio.Queue())
        self.requests[request_id] = req
        self._new.append(req)
        self._wake.set()
        return self._stream(req)

    async def _stream(self, req: _Request):
        try:
            while True:
                item = await req.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if not req.done:  # the consumer went away (break, cancel, garbage): free its blocks
                self.abort(req.seq.request_id)

    def abort(self, request_id: str) -> bool:
        """Ends a request; its blocks are freed before the next step. False if it is not running."""
        if request_id not in self.requests:
            return False
        self._aborts.append(request_id)
        self._wake.set()
        return True

    def stats(self) -> dict:
        s = self.engine.stats()
        s["async"] = dict(active_requests=len(self.requests), loop_errors=self.loop_errors)
        return s

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stops taking requests, lets those in flight finish for up to `timeout` seconds, aborts the rest
        and stops the thread. (From a coroutine: `await asyncio.to_thread(engine.shutdown)`.)"""
        self.accepting = False
        deadline = time.monotonic() + timeout
        while self.requests and time.monotonic() < deadline and self.thread.is_alive():
            time.sleep(0.01)
        for rid in list(self.requests):
            self.abort(rid)
        while self.requests and self.thread.is_alive() and time.monotonic() < deadline + 5:
            time.sleep(0.01)
        self._stop = True
        self._wake.set()
        self.thread.join(timeout=10)

    # ---- the stepping thread
    def _run(self) -> None:
        while not self._stop:
            self._take_new()
            self._take_aborts()
            if not self.engine.has_work():
                self._wake.wait(self.idle_wait_s)
                self._wake.clear()
                continue
            try:
                self.engine.step()
            except Exception as e:  # an engine bug: end what is in flight with it, keep the loop
                self.loop_errors += 1
                log.exception("moesaic: engine step failed; failing the requests in flight")
                for req in list(self.requests.values()):
                    self.engine.abort(req.seq)
                    self._forget(req)
                    self._send(req, e)
            self._publish()

    def _take_new(self) -> None:
        while self._new:
            req = self._new.popleft()
            try:
                self.engine.add(req.seq)
            except Exception as e:
                self._forget(req)
                self._send(req, e)

    def _take_aborts(self) -> None:
        while self._aborts:
            req = self.requests.get(self._aborts.popleft())
            if req is not None:
                self.engine.abort(req.seq)
        self._publish()

    def _forget(self, req: _Request) -> None:
        req.done = True
        self.requests.pop(req.seq.request_id, None)

    def _send(self, req: _Request, item) -> None:
        try:
            req.loop.call_soon_threadsafe(req.queue.put_nowait, item)
        except RuntimeError:  # its event loop is closed: nobody is listening
            self.engine.abort(req.seq)
            self._forget(req)

    def _publish(self) -> None:
        for req in list(self.requests.values()):
            if req.seq.arrival == 0:
                continue  # not taken in yet
            with self.engine.lock:
                item = self._delta(req)
            if item is None:
                continue
            if isinstance(item, BaseException) or item.finished:  # forgotten first: the consumer may look
                self._forget(req)
            self._send(req, item)

    def _delta(self, req: _Request) -> RequestOutput | BaseException | None:
        """What is new for the request since the last item (None: nothing), or the exception that ended it."""
        first, group = req.seq, req.seq.group
        error = next((s.error for s in group if s.error is not None), None)
        if error is not None:
            return error
        changed = []
        for s in group:
            t, c, lp, fin = req.sent.get(s.index, (0, 0, 0, False))
            vis = s.detok.visible_len(s.finished)
            nlp = 0 if s.logprobs is None else len(s.logprobs)
            if len(s.output_ids) == t and vis == c and not (s.finished and not fin):
                continue
            changed.append(
                CompletionOutput(
                    s.index,
                    s.output_ids[t:],
                    s.detok.text[c:vis],
                    s.finish_reason,
                    s.stop_reason,
                    None if s.logprobs is None else s.logprobs[lp:],
                )
            )
            req.sent[s.index] = (len(s.output_ids), vis, nlp, s.finished)
        finished = all(s.finished for s in group)
        if finished:  # samples a request ended before forking them
            changed += [
                CompletionOutput(i, [], "", first.finish_reason) for i in range(len(group), first.params.n)
            ]
        if not changed and not finished:
            return None
        return RequestOutput(
            first.prompt_ids,
            changed,
            first.request_id,
            first.num_cached_tokens or 0,
            finished,
            usage=self.engine.usage(first),
        )
