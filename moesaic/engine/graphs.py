"""Decode steps as CUDA graphs: one captured forward per (batch bucket, table width), replayed with new inputs.

An eager decode step on CUDA is bound by the host: ~700-1100 kernel launches a step from Python, the GPU busy
4-13 % of it (docs/perf.md, "GPU"). A graph replays a whole step's launches in one call. What a graph needs
of the step, and what this file does about it (the design is vLLM's and SGLang's cuda-graph runners; the
details are docs/gpu.md's):

- Every input in a buffer that outlives the graph. A step's token ids, positions and the page of each new
  row (int64), its length and the padded block tables (int32, as the paged kernels read them) are written
  into two pinned host buffers and copied to their device twins before the replay: no host value is baked
  into the launches (`ForwardBatch.paged`, cache/batch.py).
- Fixed shapes. B rows (the smallest bucket >= the batch: padding rows decode token 0 at position 0 into a
  scratch block no sequence holds) and tables W blocks wide, W a power of two >= what the longest sequence
  needs, so the attention's splits fit the context instead of the model's whole window.
- No per-sequence state outside the pages. Only models whose whole state is paged rows qualify (a family
  says so with `graph_decode = True` on its model: Mistral Small 4's MLA); recurrent and windowed states
  are still fresh tensors a step (docs/gpu.md lists what they need).
- The host's bookkeeping outside the graph: capacity checked before, every paged layer's length and the
  token count advanced after.

On a CPU (or after a capture failed) the same static step runs eagerly, which is how the tests check it: the
forward a graph would hold, fed only by the buffers, gives the eager engine's tokens."""

from __future__ import annotations

import logging

import torch

from ..cache.batch import ForwardBatch, PagedStep
from ..cache.paged import BLOCK_SIZE, PagedRows, PagePool

log = logging.getLogger("moesaic")

MIN_WIDTH = 4  # blocks: the narrowest table a graph is captured for (256 tokens)


def buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes graphs are captured for: 1, 2, 4, 8, then steps of 8 up to 32 and of 32 past it, and
    max_num_seqs itself."""
    sizes = [1, 2, 4, 8, 16, 24, 32]
    while sizes[-1] < max_num_seqs:
        sizes.append(sizes[-1] + 32)
    return sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs})


def why_not(model, hybrid: bool) -> str | None:
    """Why this model's decode steps cannot be graphs (None: they can)."""
    if hybrid:
        return "its state is not all paged rows (recurrent or windowed layers are fresh tensors a step)"
    if not getattr(model, "graph_decode", False):
        return f"{type(model).__module__} does not read a static decode step (graph_decode)"
    return None


class StaticStep:
    """The buffers, the batch and (on CUDA) the graph of one shape: B rows, tables W blocks wide."""

    def __init__(self, model, pool: PagePool, B: int, W: int, scratch: int):
        device = torch.device(pool.device)
        self.model, self.B, self.W, self.scratch = model, B, W, scratch
        cuda = device.type == "cuda"
        # [ids | positions | blocks | offsets] int64 and [lengths | tables] int32 (what the paged kernels
        # read: no cast a layer), each a pinned host buffer and its device twin
        self.host = [
            torch.empty(n, dtype=t, pin_memory=cuda)
            for n, t in ((4 * B, torch.long), (B * (1 + W), torch.int32))
        ]
        self.buf = [torch.zeros_like(h, device=device) for h in self.host]
        self.wide, self.narrow = (h.numpy() for h in self.host)
        part = [self.buf[0][i * B : (i + 1) * B] for i in range(4)]
        arange = torch.arange(B + 1, dtype=torch.int32, device=device)
        step = PagedStep(
            pool, part[2], part[3], self.buf[1][B:].view(B, W), self.buf[1][:B], arange, arange[:B]
        )
        # max_position: the largest this shape can hold, so that a position-dependent branch of the
        # model (Mistral's llama-4 query scale) takes the same side for every step the graph replays
        self.batch = ForwardBatch(
            part[0], part[1], [], torch.arange(B, device=device), W * BLOCK_SIZE - 1, paged=step
        )
        self.graph = None
        self.out = None
        # the last upload: done before the host buffers are written again
        self.copied = torch.cuda.Event() if cuda else None
        self._pad()
        self._upload()

    def _pad(self) -> None:
        B, wide, narrow = self.B, self.wide, self.narrow
        wide[: 2 * B] = 0  # token 0 at position 0
        wide[2 * B : 3 * B] = self.scratch
        wide[3 * B :] = 0
        narrow[:B] = 1
        narrow[B:] = self.scratch

    def _upload(self) -> None:
        for h, d in zip(self.host, self.buf):
            d.copy_(h, non_blocking=True)
        if self.copied is not None:
            self.copied.record()

    def capture(self, pool_handle) -> None:
        """Warms the step up on a side stream (kernel builds, cuBLAS workspaces), then captures it. The buffers
        hold padding rows meanwhile: every write goes to the scratch block."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.model.forward(self.batch)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a CUDA call another thread makes meanwhile (a server's) does not spoil the capture
        with torch.cuda.graph(graph, pool=pool_handle, capture_error_mode="thread_local"):
            self.out = self.model.forward(self.batch)
        self.graph = graph

    def run(self, rows: list[tuple[int, int, list[int]]]) -> torch.Tensor:
        """rows: (token, position, block ids) per sequence, at most B. -> logits [len(rows), V] (a copy when
        they are the graph's output, which the next replay overwrites)."""
        B, W, wide, narrow = self.B, self.W, self.wide, self.narrow
        if self.copied is not None:
            self.copied.synchronize()
        self._pad()
        for i, (tok, pos, ids) in enumerate(rows):
            wide[i], wide[B + i] = tok, pos
            wide[2 * B + i], wide[3 * B + i] = ids[pos // BLOCK_SIZE], pos % BLOCK_SIZE
            narrow[i] = pos + 1
            at = B + i * W
            narrow[at : at + len(ids)] = ids
        self._upload()
        if self.graph is None:
            return self.model.forward(self.batch)[: len(rows)]
        self.graph.replay()
        return self.out[: len(rows)].clone()


class DecodeGraphs:
    """The engine's static decode steps: `forward(states, tokens)` runs a step of one new token per sequence
    through the smallest fitting shape, capturing its graph on first use where the pool is on CUDA."""

    def __init__(self, model, pool: PagePool, max_num_seqs: int, max_context: int, scratch: int):
        self.model, self.pool, self.scratch = model, pool, scratch
        self.buckets = buckets(max_num_seqs)
        self.max_width = -(-max_context // BLOCK_SIZE)
        self.capture = torch.device(pool.device).type == "cuda"  # False after a capture failed
        self.steps: dict[tuple[int, int], StaticStep] = {}
        self.pool_handle = torch.cuda.graph_pool_handle() if self.capture else None
        self.replays = 0  # steps run through a static shape (counted in stats)
        self.error = None  # why capturing failed, if it did (then the static steps run eagerly)

    def stats(self) -> dict:
        return dict(
            shapes=sorted(self.steps),
            steps=self.replays,
            captured=sum(s.graph is not None for s in self.steps.values()),
            error=self.error,
        )

    def width(self, blocks: int) -> int:
        w = MIN_WIDTH
        while w < blocks:
            w *= 2
        return min(w, self.max_width)

    def forward(self, states: list, tokens: list[int]) -> torch.Tensor | None:
        """Logits [len(states), V] of one new token per sequence, or None where no static shape fits (the
        caller runs the step eagerly)."""
        n = len(states)
        if n > self.buckets[-1]:
            return None
        rows, widest = [], 0
        for state, tok in zip(states, tokens):
            first = state.layers[0] if state.layers else None  # every layer's rows: the same table, length
            if type(first) is not PagedRows or first.fields is not self.pool.pools[self.pool.layers[0][0]]:
                return None  # not paged in this engine's pool
            pos = state.num_tokens
            first._check(pos + 1)  # capacity: the model's window, the blocks the scheduler gave
            rows.append((tok, pos, first.table.ids))
            widest = max(widest, -(-(pos + 1) // BLOCK_SIZE))
        if widest > self.max_width:
            return None
        B = next(b for b in self.buckets if b >= n)
        key = (B, self.width(widest))
        step = self.steps.get(key)
        if step is None:
            step = StaticStep(self.model, self.pool, *key, self.scratch)
            if self.capture:
                try:
                    step.capture(self.pool_handle)
                except Exception as e:  # the static step still runs, eagerly; the reason is kept for stats
                    self.capture, self.error = False, f"{type(e).__name__}: {e}"[:500]
                    log.warning(
                        "moesaic: capturing a CUDA graph failed (%s); decode steps run eager", self.error
                    )
                else:
                    log.info(
                        "moesaic: captured a CUDA graph of decode steps: %d rows, tables %d blocks wide", *key
                    )
            self.steps[key] = step
        logits = step.run(rows)
        for state in states:  # what the pages' writes did, on the host's side
            end = state.num_tokens + 1
            for layer in state.layers:
                layer.length = end
            state.num_tokens = end
        self.replays += 1
        return logits
