"""Weights in huge pages (kernels/memory.py): where the memory lies, that it holds the same values, that it is
unmapped with its last view, and that the loader, the row stacks and the expert cache put weights there."""

from __future__ import annotations

import gc

import pytest
import torch
from test_cpu_perf import ODD, bf16_checkpoint
from test_quant_models import release_tensors, write

import moesaic
from moesaic.kernels import memory
from moesaic.layers.linear import stack_rows
from moesaic.models import Checkpoint, mistral4
from moesaic.weights.contract import load_tensors
from moesaic.weights.precision import PrecisionSchedule
from moesaic.weights.quant import ConcatRows, QuantizedTensor

needs_thp = pytest.mark.skipif(
    memory.thp_mode() not in ("always", "madvise"), reason="this system lends no transparent huge pages"
)


def mapping(addr: int) -> dict | None:
    """The /proc/self/smaps entry of the mapping holding addr: its fields, VmFlags as a set; None if unmapped."""
    entry = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                if entry is not None:
                    return entry
                lo, hi = (int(x, 16) for x in head.split("-"))
                entry = {} if lo <= addr < hi else None
            elif entry is not None:
                key, _, value = line.partition(":")
                entry[key] = set(value.split()) if key == "VmFlags" else value.strip()
    return entry


def advised(t: torch.Tensor) -> bool:
    return "hg" in mapping(t.data_ptr())["VmFlags"]  # smaps' flag for MADV_HUGEPAGE


@needs_thp
def test_empty_is_aligned_and_advised_up_to_its_last_whole_huge_page():
    t = memory.empty((1024, 1536), torch.bfloat16)  # 3 MiB: one whole huge page and a half
    assert t.shape == (1024, 1536) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % memory.HUGE == 0
    assert advised(t)
    assert "hg" not in mapping(t.data_ptr() + memory.HUGE)["VmFlags"]  # the tail stays in small pages
    t.fill_(3)  # the memory is usable to its last byte
    assert int(t.view(-1)[-1]) == 3 and int(t.view(-1)[0]) == 3


def test_small_tensors_other_devices_and_the_switch_get_torchs_memory(monkeypatch):
    assert not memory.applies(memory.SMALL - 1)
    assert not memory.applies(memory.HUGE, "meta")
    small = memory.empty((16, 16), torch.float32)
    assert mapping(small.data_ptr()) is None or "hg" not in mapping(small.data_ptr())["VmFlags"]
    monkeypatch.setenv("MOESAIC_HUGE_PAGES", "0")
    assert not memory.enabled()
    big = memory.empty((1 << 20,), torch.float32)
    assert "hg" not in mapping(big.data_ptr())["VmFlags"]
    assert memory.empty((4, 1 << 20), torch.float32, "meta").device.type == "meta"


@needs_thp
def test_tensors_under_a_huge_page_are_carved_from_shared_advised_regions():
    """From SMALL bytes up to a huge page, tensors are page-aligned slices of one advised region, one after
    another, each its own bytes; a tensor that does not fit the rest of the region starts a new one."""
    a = memory.empty((512, 256), torch.bfloat16)  # 256 KB
    b = memory.empty((100, 1000), torch.float32)  # 400 KB, not a whole number of pages
    c = memory.empty((memory.SMALL,), torch.uint8)
    for t in (a, b, c):
        assert advised(t) and t.data_ptr() % memory.PAGE == 0 and t.is_contiguous()
    assert mapping(a.data_ptr()) == mapping(c.data_ptr())  # one region
    assert b.data_ptr() - a.data_ptr() == a.numel() * 2 and c.data_ptr() - b.data_ptr() >= b.numel() * 4
    a.fill_(1), b.fill_(2), c.fill_(3)
    assert int(a.sum()) == a.numel() and int(b.sum()) == 2 * b.numel() and int(c.sum()) == 3 * c.numel()
    fillers = []
    while True:  # the region filled to within a huge page of its end
        region, used = memory._state["arena"]
        rest = region.numel() - -(-used // memory.PAGE) * memory.PAGE
        if rest < memory.HUGE - memory.PAGE:
            break
        fillers.append(memory.empty((memory.HUGE - memory.PAGE,), torch.uint8))
    d = memory.empty((max(memory.SMALL, rest + 1),), torch.uint8)  # past the region's end: a new region
    assert advised(d) and mapping(d.data_ptr()) != mapping(a.data_ptr())
    assert d.data_ptr() % memory.HUGE == 0  # a new region's first bytes


@needs_thp
def test_a_refused_map_or_advice_falls_back_to_small_pages(monkeypatch):
    """No address space (mmap raises) gives torch's memory; a kernel refusing MADV_HUGEPAGE keeps the map in
    small pages: the same usable tensor either way, no error."""
    real = memory.mmap.mmap

    class Refused:
        def __init__(self, *a, **k):
            raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(memory.mmap, "mmap", Refused)
    t = memory.empty((1024, 1536), torch.bfloat16)
    assert t.shape == (1024, 1536) and not advised_or_none(t)

    class NoAdvice(real):
        def madvise(self, *a):
            raise OSError(22, "Invalid argument")

    monkeypatch.setattr(memory.mmap, "mmap", NoAdvice)
    t = memory.empty((1024, 1536), torch.bfloat16).fill_(2)
    assert t.data_ptr() % memory.HUGE == 0 and not advised(t) and int(t.view(-1)[-1]) == 2


def advised_or_none(t: torch.Tensor) -> bool:
    m = mapping(t.data_ptr())
    return m is not None and "hg" in m["VmFlags"]


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float32])
def test_copy_of_holds_the_values_it_was_given(dtype):
    src = torch.randn(1024, 2048)[:, ::2]  # strided: 4 MiB of fp32 read through a view
    got = memory.copy_of(src, dtype)
    want = src.to(dtype or src.dtype)
    assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
    assert torch.equal(got, want)
    assert got.data_ptr() != src.data_ptr()
    small = torch.arange(10)
    assert torch.equal(memory.copy_of(small), small) and memory.copy_of(small).data_ptr() != small.data_ptr()
    assert memory.resident(small) is small  # nothing to move


@needs_thp
def test_the_map_goes_with_the_last_view():
    t = memory.empty((3 << 20,), torch.uint8)
    start = t.data_ptr()
    view = t[10:20]
    del t
    gc.collect()
    assert mapping(start) is not None  # the view still holds it
    del view
    gc.collect()
    assert mapping(start) is None


def codes(t) -> list[torch.Tensor]:
    if isinstance(t, ConcatRows):
        return [c for p in t.parts for c in codes(p)]
    return [t.codes] if isinstance(t, QuantizedTensor) else [t]


# a vocabulary and expert stacks of a few MiB: the embedding, the head and the stacked experts pass 2 MiB
BIG = dict(ODD, vocab_size=20000, n_routed_experts=32, moe_intermediate_size=1024)


@needs_thp
@pytest.mark.parametrize("precision", [None, "*=mxfp4"])
def test_loaded_weights_lie_in_huge_pages(tmp_path, monkeypatch, precision):
    ckpt = Checkpoint.open(bf16_checkpoint(tmp_path, BIG))
    schedule = PrecisionSchedule.parse(precision)
    loaded = load_tensors(ckpt.plan(), ckpt.store, torch.bfloat16, "cpu", schedule)
    big = {n: c for n, t in loaded.items() for c in codes(t) if c.numel() * c.element_size() >= memory.HUGE}
    # a single part copied (the embedding) and stacks combined at load (the experts), packed at load or not
    assert any("embed" in n for n in big) and any("experts" in n for n in big), sorted(big)
    assert all(c.data_ptr() % memory.HUGE == 0 and advised(c) for c in big.values())
    monkeypatch.setenv("MOESAIC_HUGE_PAGES", "0")
    plain = load_tensors(ckpt.plan(), ckpt.store, torch.bfloat16, "cpu", schedule)
    for n, c in big.items():
        (p,) = [p for p in codes(plain[n]) if p.shape == c.shape]
        assert torch.equal(p, c) and not advised(p)


@needs_thp
def test_the_same_tokens_with_and_without_huge_pages(tmp_path, monkeypatch):
    path = bf16_checkpoint(tmp_path, BIG)
    sp = moesaic.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[3, 4, 5, 6], [7, 8]]
    huge = [o.token_ids for o in moesaic.LLM(str(path), dtype="bfloat16").generate(prompts, sp)]
    monkeypatch.setenv("MOESAIC_HUGE_PAGES", "0")
    plain = [o.token_ids for o in moesaic.LLM(str(path), dtype="bfloat16").generate(prompts, sp)]
    assert huge == plain and all(len(t) == 6 for t in huge)


@needs_thp
def test_row_stacks_lie_in_huge_pages():
    ws = [torch.randn(n, 1024).to(torch.bfloat16) for n in (512, 700, 300)]  # 3 MiB together
    (stack,) = stack_rows(ws)
    assert stack.weight.data_ptr() % memory.HUGE == 0 and advised(stack.weight)
    assert torch.equal(stack.weight, torch.cat(ws))
    assert all(torch.equal(p, w) for p, w in zip(stack.parts, ws))


@needs_thp
def test_the_expert_caches_slots_lie_in_huge_pages(tmp_path):
    path = bf16_checkpoint(tmp_path, BIG)
    sp = moesaic.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm = moesaic.LLM(str(path), dtype="bfloat16", expert_cache="50%")
    arena = llm.expert_cache.arena
    assert arena.numel() >= memory.HUGE and arena.data_ptr() % memory.HUGE == 0 and advised(arena)
    want = moesaic.LLM(str(path), dtype="bfloat16").generate([[3, 4, 5]], sp)[0].token_ids
    assert llm.generate([[3, 4, 5]], sp)[0].token_ids == want


@pytest.mark.parametrize("dtype", [None, torch.float32])
def test_stack_is_torchs_stack_converted_in_its_one_copy(dtype):
    """memory.stack: torch.stack of views (a strided one too), each item possibly a gate | up pair
    concatenated along rows first, converted to `dtype`; in huge pages where they apply."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(256, 1024, generator=g).to(torch.bfloat16) for _ in range(4)]  # 2 MiB, 4 MiB in fp32
    xs[1] = torch.randn(256, 2048, generator=g).to(torch.bfloat16)[:, ::2]
    got = memory.stack(xs, dtype)
    want = torch.stack(xs).to(dtype or torch.bfloat16)
    assert got.dtype == want.dtype and torch.equal(got, want) and got.is_contiguous()
    if memory.thp_mode() in ("always", "madvise"):
        assert got.data_ptr() % memory.HUGE == 0 and advised(got)
    pairs = memory.stack([xs[i : i + 2] for i in (0, 2)], dtype)
    assert torch.equal(pairs, torch.stack([torch.cat(xs[0:2]), torch.cat(xs[2:4])]).to(want.dtype))
    assert torch.equal(memory.stack([torch.tensor(1.5), torch.tensor(2.0)]), torch.tensor([1.5, 2.0]))
    with pytest.raises(ValueError, match="one shape"):
        memory.stack([xs[0], xs[0][:10]])
    with pytest.raises(ValueError, match="past it"):
        memory.stack([[xs[0], xs[0][:, :10]]])
    with pytest.raises(ValueError, match="empty"):
        memory.stack([])


@pytest.mark.parametrize("precision", [None, "*=fp8"])
def test_stacked_experts_are_copied_once_at_load(tmp_path, monkeypatch, precision):
    """The loader stacks per-expert checkpoint tensors straight out of the file mapping into their kept
    memory: no stack built first and then copied into huge pages (a whole layer's experts copied twice, and
    held twice at once); packed at load, the stack's codes are not copied again either. The same tensors.
    Mistral's native layout: one tensor per expert (w1 | w3 pairs and w2)."""
    dense = {k: v.to(torch.bfloat16) for k, v in release_tensors(mistral4, BIG, "native").items()}
    ckpt = Checkpoint.open(write(tmp_path, BIG, "native", dense))
    schedule = PrecisionSchedule.parse(precision)
    want = load_tensors(ckpt.plan(), ckpt.store, torch.bfloat16, "cpu", schedule)
    moved = []
    real = memory.copy_of
    monkeypatch.setattr(
        memory, "copy_of", lambda t, *a, **k: moved.append(tuple(t.shape)) or real(t, *a, **k)
    )
    got = load_tensors(ckpt.plan(), ckpt.store, torch.bfloat16, "cpu", schedule)
    stacks = [n for n, t in got.items() if "experts" in n and any(c.dim() == 3 for c in codes(t))]
    assert len(stacks) >= 4, sorted(got)
    assert not [s for s in moved if len(s) == 3], moved  # no [E, N, K] stack copied after it was made
    for n in stacks:
        assert all(torch.equal(a, b) for a, b in zip(codes(got[n]), codes(want[n]))), n


class _Libc:
    """A stand-in for glibc that records mallopt's calls (the process's own malloc is left alone)."""

    def __init__(self, answer: int = 1):
        self.calls, self.answer = [], answer

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return self.answer


def _keep_freed(monkeypatch, libc: _Libc, **env) -> bool:
    import ctypes

    monkeypatch.setattr(memory, "_state", {})
    monkeypatch.setattr(ctypes, "CDLL", lambda name: libc)
    for k in [k for k in __import__("os").environ if k.startswith("MALLOC_")]:
        monkeypatch.delenv(k)
    monkeypatch.delenv("MOESAIC_KEEP_FREED", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return memory.keep_freed_memory()


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="glibc's malloc: Linux")
def test_keep_freed_memory_sets_mallocs_thresholds_once_unless_told_not_to(monkeypatch):
    """memory.keep_freed_memory sets glibc's mmap threshold (HEAP_BLOCKS) and trim threshold (KEEP_FREED) once a
    process; not with MOESAIC_KEEP_FREED=0 or where the user tunes malloc by its own MALLOC_*_ variables; a
    refused mallopt reads False; the engine calls it for a CPU model."""
    libc = _Libc()
    assert _keep_freed(monkeypatch, libc)
    assert libc.calls == [(-3, memory.HEAP_BLOCKS), (-1, memory.KEEP_FREED)]
    assert memory.keep_freed_memory() and len(libc.calls) == 2  # once
    for env in ({"MOESAIC_KEEP_FREED": "0"}, {"MALLOC_TOP_PAD_": "1048576"}):
        libc = _Libc()
        assert not _keep_freed(monkeypatch, libc, **env) and libc.calls == [], env
    assert not _keep_freed(monkeypatch, _Libc(answer=0))
    libc = _Libc()
    _keep_freed(monkeypatch, libc)
    monkeypatch.setattr(memory, "_state", {})
    libc.calls.clear()
    moesaic.LLM(str(moesaic.demo.trained_demo_path()), dtype="float32")
    assert libc.calls == [(-3, memory.HEAP_BLOCKS), (-1, memory.KEEP_FREED)]
