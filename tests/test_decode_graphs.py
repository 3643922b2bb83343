"""Static decode steps, the forward CUDA graphs capture (moesaic/engine/graphs.py).

A static step reads nothing but its buffers: token ids, positions, each row's page and the padded block
tables. On a CPU it runs eagerly, so these tests check what a graph would replay: the same logits and
tokens as the eager engine, the same rows in the pages, padding rows kept out of every sequence's pages,
and (through Triton's interpreter, in a child process) the CUDA code path's kernels with no host read. The
capture itself needs a GPU: the last test, skipped here."""

import logging
import os

import pytest
import torch
from helpers import demo_model, random_ids, run_cases_in_child

import moesaic
from moesaic.cache.batch import ForwardBatch
from moesaic.cache.paged import BLOCK_SIZE, BlockTable, PagePool
from moesaic.demo import ensure_demo
from moesaic.engine.graphs import DecodeGraphs, buckets
from moesaic.engine.sampler import SamplingParams

CHILD = os.environ.get("MOESAIC_GRAPH_CASES") == "1"
DEMO = "demo-mistral4"  # the family whose state is paged rows only


def test_buckets_cover_every_batch_size():
    for m in (1, 3, 8, 31, 32, 33, 100):
        b = buckets(m)
        assert b == sorted(set(b)) and b[-1] == m and all(0 < x <= m for x in b)
        assert all(next(x for x in b if x >= n) - n < max(8, n) for n in range(1, m + 1))


def _prefilled(model, vocab: int, blocks: list[list[int]], lengths: list[int], num_blocks: int):
    """States over one pool's pages (tables `blocks`), prefilled with `lengths` tokens each on the references."""
    pool = PagePool(model.new_state(), num_blocks=num_blocks)
    for fields in pool.pools.values():  # rows nobody wrote are NaN: a read of one shows in the logits
        for t in fields.values():
            t.fill_(float("nan"))
    states = [pool.page(model.new_state(), BlockTable(b)) for b in blocks]
    items = [(s, random_ids(n, vocab, seed=10 + i)) for i, (s, n) in enumerate(zip(states, lengths))]
    model.forward(ForwardBatch.build(items, logits="last"))
    return pool, states


def _static_vs_eager(steps: int = 2):
    """Three sequences (70, 5 and 64 tokens: across a page, short, a full page) over two pools, one decoded by
    the eager forward, one by static steps of 4 rows (one padding row, scratch block 0). -> (eager logits,
    static logits, the eager states, the static states, the DecodeGraphs)."""
    ck, model = demo_model(DEMO, "float32")
    V = ck.cfg.vocab_size
    blocks, lengths = [[3, 5], [1], [2, 4]], [70, 5, 64]
    with torch.no_grad():
        pool_a, eager = _prefilled(model, V, blocks, lengths, 6)
        pool_b, static = _prefilled(model, V, blocks, lengths, 6)
        graphs = DecodeGraphs(model, pool_b, max_num_seqs=4, max_context=4096, scratch=0)
        ref, got = [], []
        for step in range(steps):
            toks = [7 + step, 8 + step, 9 + step]
            ref.append(model.forward(ForwardBatch.build([(s, [t]) for s, t in zip(eager, toks)])))
            got.append(graphs.forward(static, toks))
    return torch.cat(ref), torch.cat(got), eager, static, graphs


def test_static_step_gives_the_eager_logits_and_rows():
    ref, got, eager, states, graphs = _static_vs_eager()
    assert got.shape == ref.shape
    assert float((got - ref).abs().max()) <= 1e-5 * float(ref.abs().max())
    assert [s.num_tokens for s in states] == [72, 7, 66]
    assert all(r.length == s.num_tokens for s in states for r in s.layers)
    assert sorted(graphs.steps) == [(4, 4)] and graphs.replays == 2
    for a, b in zip(eager, states):  # every sequence's rows in every layer, the decoded ones included
        for ra, rb in zip(a.layers, b.layers):
            for k, rows in ra.rows().items():
                assert torch.allclose(rows, rb.rows()[k], atol=2e-5, rtol=1e-5), k
    pool = states[0].layers[0].fields["latent"]
    assert not pool[0, :, 0].isnan().any()  # block 0, the scratch page: the padding row wrote its row 0


def test_engine_tokens_with_static_steps_equal_eager():
    """Greedy tokens of three requests of different prompt and output lengths (the batch shrinks through the
    4, 2 and 1 row shapes; the longest needs tables 8 blocks wide) equal the eager engine's."""
    path = str(ensure_demo(DEMO))
    prompts = [random_ids(n, 200, seed=n) for n in (5, 70, 300)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (12, 30, 45)]
    out, stats = {}, {}
    for graphs in (False, True):
        llm = moesaic.LLM(path, dtype="float32", max_num_seqs=4, cuda_graphs=graphs)
        out[graphs] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        stats[graphs] = llm.engine.stats()["decode_graphs"]
    assert out[True] == out[False] and [len(t) for t in out[True]] == [12, 30, 45]
    assert stats[False] is None
    rows, widths = zip(*stats[True]["shapes"])
    assert set(rows) == {4, 2, 1} and max(widths) == 8
    assert stats[True]["steps"] >= 44 and stats[True]["captured"] == 0


def test_a_model_with_recurrent_state_runs_eager(caplog):
    """Kimi Linear's KDA state is not paged: graphs are refused with the reason, and decoding runs eagerly."""
    with caplog.at_level(logging.WARNING, logger="moesaic"):
        llm = moesaic.LLM(str(ensure_demo("demo-kimi-linear")), dtype="float32", cuda_graphs=True)
    assert llm.engine.graphs is None and "not all paged rows" in caplog.text
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_a_step_past_the_window_is_refused():
    """A sequence whose next row has no block fails before anything runs: nothing written, no length moved."""
    ck, model = demo_model(DEMO, "float32")
    with torch.no_grad():
        pool, states = _prefilled(model, ck.cfg.vocab_size, [[1]], [BLOCK_SIZE], 3)
        graphs = DecodeGraphs(model, pool, max_num_seqs=2, max_context=4096, scratch=0)
        with pytest.raises(RuntimeError, match="blocks"):
            graphs.forward(states, [3])
    assert states[0].num_tokens == BLOCK_SIZE and graphs.replays == 0


# ------------------------------------------------------------------- the CUDA code path, in a child process


def case_static_step_through_the_kernels(monkeypatch):
    """The static step with every layer on its Triton kernel (the paged MLA launch over the block tables)
    equals the eager references, and reads nothing on the host."""
    from test_no_host_sync import HostReads

    from moesaic.kernels import triton as kt

    monkeypatch.setenv("MOESAIC_TRITON", "off")
    ck, model = demo_model(DEMO, "float32")
    with torch.no_grad():
        pool_a, eager = _prefilled(model, ck.cfg.vocab_size, [[3, 5], [1]], [70, 5], 6)
        pool_b, static = _prefilled(model, ck.cfg.vocab_size, [[3, 5], [1]], [70, 5], 6)
        ref = model.forward(ForwardBatch.build([(s, [t]) for s, t in zip(eager, [7, 8])]))
        graphs = DecodeGraphs(model, pool_b, max_num_seqs=4, max_context=4096, scratch=0)
        monkeypatch.setenv("MOESAIC_TRITON", "interpret")
        monkeypatch.setattr(kt, "_modules", {})
        reads, forward = HostReads(), model.forward

        def traced(batch):  # the forward a graph would hold, not the host buffers' filling around it
            with reads:
                return forward(batch)

        monkeypatch.setattr(model, "forward", traced)
        got = graphs.forward(static, [7, 8])
    assert {"mla", "router", "quant"} <= set(kt._modules), kt._modules
    assert not reads.seen, dict(reads.seen)
    assert float((got - ref).abs().max()) <= 2e-5 * float(ref.abs().max())


@pytest.fixture(scope="module")
def interpreted_run(tmp_path_factory):
    pytest.importorskip("triton", reason="triton is not installed: the CUDA code path cannot run here")
    pytest.importorskip("numpy", reason="Triton's interpreter needs numpy")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(MOESAIC_GRAPH_CASES="1", MOESAIC_TRITON="interpret", OMP_NUM_THREADS="1")
    return run_cases_in_child(__file__, tmp_path_factory.mktemp("graphs"), env)


@pytest.mark.skipif(CHILD, reason="the child runs the case itself")
def test_static_step_on_the_cuda_code_path(interpreted_run):
    outcomes, output = interpreted_run
    name = "case_static_step_through_the_kernels"
    assert outcomes.get(name) == "passed", f"{name}: {outcomes.get(name)}\n{output}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: capturing a graph needs one")
def test_graph_decode_on_cuda_equals_cpu():
    path = str(ensure_demo(DEMO))
    prompts = [random_ids(n, 200, seed=n) for n in (5, 70, 300)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (12, 30, 45)]
    cpu = moesaic.LLM(path, dtype="float32", max_num_seqs=4)
    gpu = moesaic.LLM(path, dtype="float32", device="cuda", max_num_seqs=4, cuda_graphs=True)
    want = [o.outputs[0].token_ids for o in cpu.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in gpu.generate(prompts, params)]
    stats = gpu.engine.stats()["decode_graphs"]
    assert stats["captured"] == len(stats["shapes"]) and stats["steps"] >= 44, stats
    assert got == want


@pytest.mark.parametrize("flags, want", [([], None), (["--enforce-eager"], False)])
def test_generate_asks_for_graphs_unless_eager(flags, want, monkeypatch):
    """`generate` (and `serve`) leave graphs to LLM's default (on CUDA where the family allows); --enforce-eager
    turns them off."""
    from moesaic import cli, llm

    seen = {}

    def fake(*args, **kwargs):
        seen.update(kwargs)
        raise SystemExit(3)

    monkeypatch.setattr(llm, "LLM", fake)
    with pytest.raises(SystemExit):
        cli.main(["generate", "--model", DEMO, *flags])
    assert seen["cuda_graphs"] is want


def test_static_steps_under_prefix_hits_forks_and_preemption():
    """Static steps among the engine's other machinery give the eager engine's tokens: a prompt whose first
    two blocks come from the prefix cache, two seeded samples of one prompt (their blocks forked, then
    copied on write), and preemption by recompute in a cache too small for all of them at once."""
    path = str(ensure_demo(DEMO))
    base = random_ids(130, 200, seed=5)
    first = [base + [7, 8]]
    rest = [base + [9], random_ids(90, 200, seed=6), random_ids(100, 200, seed=7)]
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    params = [SamplingParams(max_tokens=25, temperature=1.0, seed=4, n=2, ignore_eos=True), greedy, greedy]
    out, stats = {}, {}
    for graphs in (False, True):
        roomy = moesaic.LLM(path, dtype="float32", max_num_seqs=4, cuda_graphs=graphs)
        eng = roomy.engine
        block = BLOCK_SIZE * (eng.pool.bytes_per_token + eng.rest_per_token)
        llm = moesaic.LLM(
            path, dtype="float32", max_num_seqs=4, cuda_graphs=graphs, max_cache_bytes=6 * block
        )
        got = [o.token_ids for o in llm.generate(first, greedy)[0].outputs]
        got += [c.token_ids for o in llm.generate(rest, params) for c in o.outputs]
        out[graphs], stats[graphs] = got, llm.stats()
    assert out[True] == out[False] and len(out[True]) == 5
    s = stats[True]
    assert s["cached_prompt_tokens"] >= 128 and s["preemptions"] > 0 and s["decode_graphs"]["steps"] > 0


def test_streamed_experts_run_eager(caplog):
    """With experts streamed from disk the host picks each step's reads: no graphs, and the reason logged."""
    with caplog.at_level(logging.WARNING, logger="moesaic"):
        llm = moesaic.LLM(str(ensure_demo(DEMO)), dtype="float32", cuda_graphs=True, expert_cache="50%")
    assert llm.engine.graphs is None and "streamed experts" in caplog.text
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
