"""No host syncs inside a decode forward (issue 19 item 1): a decode step of every family's demo reads no
device value back on the host, so that a GPU never waits for the host in the middle of a step (and the
step can be captured as a CUDA graph).

A tracing TorchFunctionMode records, inside `model.forward`, every call that would copy a device value to
the host on a GPU: Tensor.item / tolist / cpu / numpy, bool() / int() / float() / index use of a tensor,
torch.equal / allclose, and the data-dependent shapes (nonzero, where(cond), unique, masked_select,
boolean-mask indexing, bincount without minlength), when the code calling it is moesaic's. Here every
tensor is on the CPU, so the tracer stands in for `torch.cuda.set_sync_debug_mode("error")`, which the GPU
test at the end uses instead.

Two code paths: the torch references (this process), where the sites in CPU_ONLY read on the host by
design, and the CUDA code path (the Triton kernels, forced onto CPU tensors by MOESAIC_TRITON=interpret in
a child process, which must set the switch before triton is first imported), where nothing may.
"""

import os
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers import demo_model, random_ids, run_cases_in_child
from torch.overrides import TorchFunctionMode

import moesaic
from moesaic.cache.batch import ForwardBatch
from moesaic.cache.paged import BlockTable, PagePool

PKG = str(Path(moesaic.__file__).parent) + os.sep
CHILD = os.environ.get("MOESAIC_NO_SYNC_CASES") == "1"

DEMOS = [
    "demo-deepseek-v4",
    "demo-deepseek-v41",
    "demo-glm5-next-nvfp4",
    "demo-kimi-k3",
    "demo-kimi-linear",
    "demo-mistral4",
    "demo-nemotron-h",
]
READS = {
    "item",
    "tolist",
    "cpu",
    "numpy",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "equal",
    "allclose",
}
SHAPES = {"nonzero", "argwhere", "unique", "unique_consecutive", "masked_select"}
# (file in moesaic/, function) -> why it reads on the host on the torch path, and what the CUDA path does
CPU_ONLY = {
    ("layers/moe.py", "run_experts"): "the per-expert loop over packed stacks reads the expert counts; "
    "on CUDA run_experts takes the Triton grouped GEMM (no sync), checked by the child cases below",
    ("kernels/cpu.py", "rows_fit"): "the CPU grouped expert kernels check each expert's row count (a host "
    "read of CPU tensors is free); on CUDA run_experts takes the Triton grouped GEMM",
    ("layers/engram.py", "gather"): "host tensors: Engram's hash and its mapped tables live on the host "
    "(the row ids come from ForwardBatch.host_token_ids), only the gathered rows go to the device",
}


class HostReads(TorchFunctionMode):
    """Records {(call, 'file:line function')} of the host reads moesaic code makes while active."""

    def __init__(self):
        super().__init__()
        self.seen: Counter = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        hit = name in READS or name in SHAPES
        if name == "__getitem__" and len(args) > 1:
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            hit = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
            name = "boolean-mask indexing"
        elif name == "where":
            hit = len(args) + len(kwargs) == 1
        elif name == "bincount":
            hit = not kwargs.get("minlength") and not (len(args) > 2 and args[2])
        if hit:
            caller = sys._getframe(1)
            path = caller.f_code.co_filename
            if path.startswith(PKG):
                where = f"{path[len(PKG) :]}:{caller.f_lineno} {caller.f_code.co_name}"
                self.seen[(name, where)] += 1
        return func(*args, **kwargs)


def _site(where: str) -> tuple[str, str]:
    file_line, function = where.split(" ")
    return file_line.split(":")[0], function


def paged_states(model):
    """Two fresh states whose token rows are the engine's pages (as the engine runs them), blocks 2 and 0."""
    pool = PagePool(model.new_state(), num_blocks=3)
    return [pool.page(model.new_state(), BlockTable([b])) for b in (2, 0)]


def decode_reads(demo: str) -> Counter:
    """The host reads of one decode step (two sequences, 9 and 5 tokens cached) of `demo` in fp32."""
    ck, model = demo_model(demo, "float32")
    ids = random_ids(9, ck.cfg.vocab_size, seed=3)
    sa, sb = paged_states(model)
    with torch.no_grad():
        model.forward(ForwardBatch.build([(sa, ids), (sb, ids[:5])], logits="last"))
        batch = ForwardBatch.build([(sa, [7]), (sb, [8])], logits="last")  # the host builds it: outside
        with HostReads() as reads:
            logits = model.forward(batch)
    assert logits.shape == (2, ck.cfg.vocab_size)
    return reads.seen


def test_the_tracer_sees_host_reads():
    """It records moesaic's reads (run_experts' per-expert loop: float64 stacks take it) and not others'."""
    from moesaic.layers import moe

    x = torch.arange(6)
    weights, ids = torch.ones(3, 1), torch.tensor([[0], [2], [2]])
    w_in, w_out = torch.randn(3, 8, 4, dtype=torch.float64), torch.randn(3, 4, 4, dtype=torch.float64)
    with HostReads() as reads:
        moe.run_experts(torch.randn(3, 4, dtype=torch.float64), weights, ids, w_in, w_out)  # the loop path
        int(x[1])  # this file is not moesaic's: not recorded
    assert {_site(w) for _, w in reads.seen} == {("layers/moe.py", "run_experts")}


@pytest.mark.parametrize("demo", DEMOS)
def test_decode_step_reads_nothing_on_the_host_torch_path(demo):
    seen = decode_reads(demo)
    bad = {k: v for k, v in seen.items() if _site(k[1]) not in CPU_ONLY}
    assert not bad, f"{demo}: host reads in a decode forward: {bad}"


# ------------------------------------------------------------------------------------------ the CUDA path

CUDA_PATH_DEMOS = ["demo-glm5-next-nvfp4", "demo-nemotron-h"]  # packed MoE, paged DSA, mHC, KDA; Mamba-2


@pytest.mark.parametrize("demo", CUDA_PATH_DEMOS)
def case_decode_step_through_the_kernels_reads_nothing_on_the_host(demo, monkeypatch):
    monkeypatch.setenv("MOESAIC_TRITON", "off")  # the prefill on the references (the interpreter is slow)
    ck, model = demo_model(demo, "float32")
    ids = random_ids(9, ck.cfg.vocab_size, seed=3)
    sa, sb = paged_states(model)
    with torch.no_grad():
        model.forward(ForwardBatch.build([(sa, ids), (sb, ids[:5])], logits="last"))
        batch = ForwardBatch.build([(sa, [7]), (sb, [8])], logits="last")
        monkeypatch.setenv("MOESAIC_TRITON", "interpret")
        from moesaic.kernels import triton as kt

        monkeypatch.setattr(kt, "_modules", {})
        with HostReads() as reads:
            model.forward(batch)
    assert {"router", "quant"} <= set(kt._modules), kt._modules  # the experts ran on the Triton GEMM
    assert not reads.seen, f"{demo}: host reads on the CUDA code path: {dict(reads.seen)}"


@pytest.fixture(scope="module")
def interpreted_run(tmp_path_factory):
    pytest.importorskip("triton", reason="triton is not installed: the CUDA code path cannot run here")
    pytest.importorskip("numpy", reason="Triton's interpreter needs numpy")
    folder = tmp_path_factory.mktemp("no_sync")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(MOESAIC_NO_SYNC_CASES="1", MOESAIC_TRITON="interpret", OMP_NUM_THREADS="1")
    return run_cases_in_child(__file__, folder, env)


@pytest.mark.parametrize("demo", CUDA_PATH_DEMOS)
def test_decode_step_on_the_cuda_code_path(demo, interpreted_run):
    outcomes, output = interpreted_run
    name = f"case_decode_step_through_the_kernels_reads_nothing_on_the_host[{demo}]"
    assert outcomes.get(name) == "passed", f"{name}: {outcomes.get(name)}\n{output}"


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device here: set_sync_debug_mode needs one"
)
@pytest.mark.parametrize("demo", DEMOS)
def test_decode_step_on_cuda_never_syncs(demo):
    ck, _ = demo_model(demo, "float32")
    model = ck.build("float32", "cuda")
    ids = random_ids(9, ck.cfg.vocab_size, seed=3)
    sa, sb = paged_states(model)
    with torch.no_grad():
        model.forward(ForwardBatch.build([(sa, ids), (sb, ids[:5])], device="cuda"))
        batch = ForwardBatch.build([(sa, [7]), (sb, [8])], device="cuda")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            logits = model.forward(batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert logits.is_cuda and logits.shape == (2, ck.cfg.vocab_size)
