"""The serving-trace benchmark on the CPU: the seeded request model (determinism, decodes first, budgets, block
tables consistent with context lengths over one page pool, prefix sharing in the chat trace, 2048-token chunks in the
document trace) and a tiny replay through the reference backend checked against the float64 oracle."""

import dataclasses
import itertools
import json
import statistics
from collections import Counter

import pytest
import torch

from attnbackends import AttentionConfig, decode_first_order
from benchmarks.serving_trace import (
    FULL_LIMITS,
    TINY_MODELS,
    TRACE_KINDS,
    BackendReplay,
    check_step_against_oracle,
    generate_trace,
    main,
    replay_layer_specs,
    write_plot,
)

FULL = {kind: generate_trace(kind) for kind in TRACE_KINDS}


def _first_seen(trace):
    """rid -> (step index, request) of each request's first step."""
    seen = {}
    for t, step in enumerate(trace.steps):
        for r in step.requests:
            seen.setdefault(r.rid, (t, r))
    return seen


@pytest.mark.parametrize("kind", TRACE_KINDS)
def test_a_seed_fixes_the_trace(kind):
    assert generate_trace(kind, seed=0) == FULL[kind]
    assert generate_trace(kind, seed=1) != FULL[kind]
    assert len(generate_trace(kind, scale=0.5).steps) < len(FULL[kind].steps)
    assert 10 <= len(FULL[kind].steps) <= 64


@pytest.mark.parametrize("kind", TRACE_KINDS)
def test_steps_are_decode_first_and_within_the_scheduler_budget(kind):
    for step in FULL[kind].steps:
        q = step.query_lens
        assert decode_first_order(q) == list(range(len(q)))
        assert q[: step.num_decodes] == [1] * step.num_decodes
        assert 0 < step.num_tokens <= FULL_LIMITS.max_num_tokens
        assert max(q) <= FULL_LIMITS.max_chunk
        assert len(q) <= FULL_LIMITS.max_num_reqs
        assert len({r.rid for r in step.requests}) == len(q)


@pytest.mark.parametrize("kind", TRACE_KINDS)
def test_block_tables_match_context_lengths_over_one_pool(kind):
    trace = FULL[kind]
    bs = trace.limits.block_size
    last = {}
    for step in trace.steps:
        readers = Counter(itertools.chain.from_iterable(r.block_table for r in step.requests))
        assert 0 <= min(readers) and max(readers) < trace.num_blocks
        for r in step.requests:
            assert len(r.block_table) == -(-(r.context_len + r.query_len) // bs)
            assert len(set(r.block_table)) == len(r.block_table)
            # a page shared by requests is a whole page of cached context for each: the pages past a request's
            # whole context pages (those the step writes, or partly filled) are its alone
            assert all(readers[page] == 1 for page in r.block_table[r.context_len // bs :]), (kind, r.rid)
            if r.rid in last:  # the same request one step later: its pages stay, its context grew by its query
                before = last[r.rid]
                assert r.context_len == before.context_len + before.query_len
                assert r.block_table[: len(before.block_table)] == before.block_table
            last[r.rid] = r
        common = step.common("cpu")
        slots = common.slot_mapping.tolist()
        assert len(set(slots)) == len(slots) == step.num_tokens
        assert common.common_prefix_len == step.common_prefix_len
        assert common.context_lens_cpu.tolist() == step.context_lens


def test_chat_shares_the_system_prompt_and_earlier_turns():
    trace = FULL["chat"]
    bs = trace.limits.block_size
    system_pages = 1000 // bs
    assert all(step.common_prefix_len == system_pages * bs for step in trace.steps)
    seen = _first_seen(trace)
    tables_before = {}  # step -> tables of requests seen before it
    arrivals = [(t, r) for t, r in seen.values() if r.query_len > 1]
    assert arrivals and all(r.context_len >= system_pages * bs for _, r in arrivals)
    follow_ups = 0
    for t, r in arrivals:
        earlier = tables_before.setdefault(t, [x.block_table for s in trace.steps[:t] for x in s.requests])
        if any(len(e) > system_pages + 1 and r.block_table[: len(e) - 1] == e[: len(e) - 1] for e in earlier):
            follow_ups += 1  # a later turn reads every whole page of the conversation's earlier turn
    assert follow_ups >= 5
    chunks = [r for s in trace.steps for r in s.requests if r.query_len > 1]
    assert statistics.median(r.query_len for r in chunks) < 512
    assert statistics.median(r.context_len for r in chunks) > 2000
    assert trace.cached_prompt_tokens > 10 * trace.stats()["prefill_tokens"]


def test_documents_are_chunked_at_2048_on_long_context_beside_decodes():
    trace = FULL["docs"]
    chunks = [r for s in trace.steps for r in s.requests if r.query_len > 1]
    assert max(r.query_len for r in chunks) == 2048
    assert max(r.context_len for r in chunks) > 24000
    assert max(r.context_len + r.query_len for r in chunks) <= 32768
    assert all(0 < s.num_decodes < len(s.requests) for s in trace.steps)


def test_short_prompts_are_fresh_and_the_decode_trace_is_mostly_decodes():
    short = FULL["short"]
    for t, r in _first_seen(short).values():
        if r.query_len > 1:
            assert r.context_len == 0 and r.query_len <= 512
    assert short.stats()["prefill_tokens"] > 10 * short.stats()["decode_tokens"]
    decode = FULL["decode"]
    assert all(s.num_decodes >= 200 for s in decode.steps)
    assert 0 < sum(s.num_decodes < len(s.requests) for s in decode.steps) < len(decode.steps) / 2


@pytest.mark.parametrize("kind", TRACE_KINDS)
def test_one_step_of_each_trace_against_the_oracle(kind):
    trace = generate_trace(kind, tiny=True)
    specs, _ = replay_layer_specs(TINY_MODELS["gpt-oss-20b"], 1)
    replay = BackendReplay(specs, AttentionConfig(backend="reference"), torch.device("cpu"),
                           num_blocks=trace.num_blocks, max_num_tokens=trace.limits.max_num_tokens,
                           max_num_reqs=trace.max_num_reqs)
    assert [g.name for g in replay.groups.groups] == ["sliding_16", "full"]
    assert all(bool((c != 0).all()) for c in replay.caches)  # random, never zeros
    t = max(range(len(trace.steps)), key=lambda i: len(trace.steps[i].requests))
    checked = check_step_against_oracle(replay, trace.steps[t], trace.steps[t].common("cpu"))
    assert checked == list(range(min(8, len(trace.steps[t].requests))))


def test_the_oracle_check_fails_on_a_wrong_block_table():
    trace = generate_trace("chat", tiny=True)
    specs, _ = replay_layer_specs(TINY_MODELS["llama-3-8b"], 1)
    replay = BackendReplay(specs, AttentionConfig(backend="reference"), torch.device("cpu"),
                           num_blocks=trace.num_blocks, max_num_tokens=trace.limits.max_num_tokens,
                           max_num_reqs=trace.max_num_reqs)
    step = trace.steps[-1]
    common = step.common("cpu")
    swapped = common.block_table.flip(0)  # every request reads another request's pages
    wrong = dataclasses.replace(common, block_table=swapped, block_table_cpu=swapped.clone())
    # build() refuses the slots that disagree with the swapped tables; past it, the oracle check names the layer
    with pytest.raises((AssertionError, ValueError),
                       match="layer 0 \\(group full, backend reference\\)|disagrees with the block table"):
        check_step_against_oracle(replay, step, wrong)
    check_step_against_oracle(replay, step, common)  # the same step with its own tables passes


def test_tiny_cpu_run_writes_rows_and_a_plot(tmp_path):
    out = tmp_path / "st.json"
    argv = ["--device", "cpu", "--backends", "reference", "--tiny", "--check", "--repeats", "1",
            "--models", "gpt-oss-20b,gemma-3-12b", "--out", str(out)]
    assert main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    models = ("gpt-oss-20b", "gemma-3-12b")
    assert {(r["trace"], r["model"]) for r in rows} == {(k, m) for k in TRACE_KINDS for m in models}
    for r in rows:
        assert r["case"] == "serving_trace" and r["backend"] == "reference" and r["peer"] is None
        assert r["oracle_checked"] is True and "error" not in r
        assert r["us"] > 0 and r["steps"] == len(generate_trace(r["trace"], tiny=True).steps)
        assert r["tokens"] == generate_trace(r["trace"], tiny=True).num_tokens
        assert r["layers"] == 4 and set(r["groups"].values()) == {"reference"}
        # the model's 24 / 48 layers from the 2 replayed per group: more time than the replayed layers took
        assert r["model_us"] > r["forward_us"]
    assert (tmp_path / "st.png").stat().st_size > 0


@pytest.mark.parametrize("drop", [False, True])
def test_no_common_prefix_hides_the_shared_prefix_from_the_builders(tmp_path, monkeypatch, drop):
    """Chat steps carry their common prefix to build() (FlashInfer may serve them with cascade attention); with
    --no-common-prefix every step reaches the builders with none. The result file names the GPU and versions."""
    import benchmarks.serving_trace as st

    seen = []
    step = st.BackendReplay.step

    def recording_step(self, common, marks=None):
        seen.append(common.common_prefix_len)
        return step(self, common, marks)

    monkeypatch.setattr(st.BackendReplay, "step", recording_step)
    out = tmp_path / "st.json"
    argv = ["--device", "cpu", "--backends", "reference", "--tiny", "--repeats", "1", "--models", "llama-3-8b",
            "--traces", "chat", "--out", str(out)] + (["--no-common-prefix"] if drop else [])
    assert main(argv) == 0
    assert seen and (max(seen) == 0) == drop
    header = json.loads(out.read_text())
    assert {"gpu", "torch", "triton", "flashinfer", "date", "command"} <= set(header)


def test_a_backend_that_cannot_serve_is_reported_with_its_reasons(tmp_path):
    out = tmp_path / "st.json"
    argv = ["--device", "cpu", "--backends", "reference,flashinfer", "--tiny", "--repeats", "1",
            "--models", "gpt-oss-20b", "--traces", "short", "--out", str(out), "--plot", str(tmp_path / "p.png")]
    assert main(argv) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["backend"] == "reference" and row["peer"] == "flashinfer"
    assert row["us"] > 0 and row["peer_us"] is None and row["ratio"] is None
    assert "sliding_16:" in row["peer_unsupported"] and "full:" in row["peer_unsupported"]
    with pytest.raises(SystemExit):
        main(["--device", "cpu", "--backends", "no_such_backend", "--out", str(out)])


def test_the_plot_draws_ratios_and_marks_missing_ones(tmp_path):
    rows = [{"case": "serving_trace", "trace": k, "model": m, "backend": b, "peer": "flashinfer",
             "ratio": None if m == "gpt-oss-20b" else 0.9 + 0.1 * i}
            for k in ("chat", "docs") for i, m in enumerate(("llama-3-8b", "gpt-oss-20b")) for b in ("triton", "auto")]
    assert write_plot(rows, tmp_path / "r.png")
    assert (tmp_path / "r.png").stat().st_size > 0
    assert not write_plot([], tmp_path / "none.png")
