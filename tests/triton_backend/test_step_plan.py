"""The Triton builder's step plan (attnbackends/triton/step_plan.py) and its runner (runner.py), on the CPU.

Which launches, on which streams, with which cache write, a batch gets: decode-only, fresh prefills and chunked
prefills on a faked sm_90 device (the builder plans; nothing launches), decodes mixed with prefills, a forward
without keys; which of the plan's programs the forward's tensors pick; and the order in which the runner issues a
program's launches and stream forks/joins (launchers and streams replaced by recorders). Outputs against the oracle
for the same paths: test_prefill_kernel.py (interpreted) and test_prefill_hopper.py (GPU).
"""

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from attnbackends import AttentionSpec, build_common_metadata  # noqa: E402
from attnbackends.triton import launch, prefill_hopper, runner  # noqa: E402
from attnbackends.triton.backend import TritonAttentionBackend  # noqa: E402
from attnbackends.triton.choices import PagedPrefill  # noqa: E402
from attnbackends.triton.launch import SplitKVWorkspace, plan_attention  # noqa: E402
from attnbackends.triton.prefill_launch import PrefillPlan, plan_prefill_new_kv  # noqa: E402
from attnbackends.triton.runner import CacheViews, LayerArgs, TritonStepRunner  # noqa: E402
from attnbackends.triton.step_plan import (  # noqa: E402
    Launch,
    LaunchKind,
    StreamRole,
    WritePolicy,
    kernel_write_fits,
    make_step_plan,
)

K = LaunchKind
SPEC = AttentionSpec(num_heads=32, num_kv_heads=8, head_size=128, dtype="bfloat16", block_size=16)
needs_gluon = pytest.mark.skipif(not prefill_hopper.gluon_available(), reason="needs triton.experimental.gluon")


def _common(shapes, spec=SPEC):
    """Metadata of a batch of (query_len, context_len) requests on consecutive pages."""
    tables, at = [], 0
    for q, c in shapes:
        n = -(-(q + c) // spec.block_size)
        tables.append(list(range(at, at + n)))
        at += n
    return build_common_metadata([q for q, _ in shapes], [c for _, c in shapes], tables, spec.block_size, "cpu")


def _builder(spec=SPEC, **kw):
    return TritonAttentionBackend.get_builder_cls()(spec, "cpu", **{"max_num_tokens": 32768, **kw})


def _tokens(n, heads, spec=SPEC):
    return torch.randn(n, heads, spec.head_size).to(spec.torch_dtype)


def _forward_tensors(common, spec=SPEC, num_blocks=64):
    """query, key, value, output, kv_cache for ``common`` in the row layout the prefill kernels take."""
    n = common.num_actual_tokens
    cache = torch.randn(num_blocks, 2, spec.block_size, spec.num_kv_heads, spec.head_size).to(spec.torch_dtype)
    return (_tokens(n, spec.num_heads), _tokens(n, spec.num_kv_heads), _tokens(n, spec.num_kv_heads),
            _tokens(n, spec.num_heads), cache)


def _kinds_and_streams(program):
    return [(launch.kind, launch.stream) for launch in program.launches]


# ------------------------------------------------------------------------------------------ what a batch gets


def test_decode_only_batch_runs_the_unified_kernel_in_every_program():
    meta = _builder(prefill_kernel=True).build(_common([(1, 40), (1, 7), (1, 300)]))
    step = meta.step
    assert step.new_kv_rows is None and step.new_kv_rows_other_cache is None and meta.prefill_split is None
    assert step.new_kv.kinds() == (K.CACHE_WRITE, K.ATTENTION) and step.new_kv.write is WritePolicy.FIRST
    assert step.no_new_kv.kinds() == (K.ATTENTION,) and step.no_new_kv.write is WritePolicy.NONE
    assert step.no_cache.kinds() == (K.ATTENTION_NO_CACHE,)
    for program in (step.new_kv, step.no_new_kv, step.no_cache):
        assert program.launches[-1].plan is meta.plan and all(x.stream is StreamRole.MAIN for x in program.launches)
    assert meta.plan.num_decodes == 3 and step.write_todo is None and step.cache_write_sms == 0


@needs_gluon
def test_fresh_prefills_on_sm90_run_the_gluon_kernel_that_writes_the_cache(fake_h100):
    builder = _builder()
    common = _common([(300, 0), (2, 0), (129, 0)])
    step = builder.build(common).step
    split = step.new_kv_rows
    assert split.kinds() == (K.GLUON_PREFILL, K.FINISH_CACHE_WRITE) and split.write is WritePolicy.KERNEL
    gluon = split.launches[0].plan
    assert gluon.writes_cache and gluon.first_seq == 0 and gluon.grid == (132,)
    assert split.launches[1].plan is gluon and step.kernel_write_tokens == common.num_actual_tokens
    assert step.write_todo is not None and step.write_todo.shape == (builder.max_num_tokens,)
    # the same launch without the kernel's write, after the write kernel, for a cache the kernel cannot address
    other = step.new_kv_rows_other_cache
    assert other.kinds() == (K.CACHE_WRITE, K.GLUON_PREFILL) and other.write is WritePolicy.FIRST
    unwritten = other.launches[1].plan
    assert not unwritten.writes_cache and unwritten.grid == gluon.grid and unwritten.num_tokens == gluon.num_tokens
    assert step.decode_plan is None and step.prefill.plan is gluon and not step.overlapped


@needs_gluon
def test_fresh_prefills_on_sm90_with_the_write_beside_or_first(fake_h100):
    long_batch = _common([(1024, 0)] * 16)
    step = _builder(hopper_cache_write=False).build(long_batch).step
    k = step.cache_write_sms
    assert k > 0 and step.new_kv_rows.write is WritePolicy.BESIDE and step.new_kv_rows_other_cache is None
    assert _kinds_and_streams(step.new_kv_rows) == [
        (K.FORK, StreamRole.PRIORITY), (K.GLUON_PREFILL, StreamRole.PRIORITY), (K.CACHE_WRITE, StreamRole.MAIN),
        (K.JOIN, StreamRole.PRIORITY)]
    assert step.prefill.plan.grid == (132 - k,) and not step.prefill.plan.writes_cache
    first = _builder(hopper_cache_write=False, cache_write_sms=0).build(long_batch).step
    assert first.new_kv_rows.kinds() == (K.CACHE_WRITE, K.GLUON_PREFILL) and first.cache_write_sms == 0
    assert first.new_kv_rows.write is WritePolicy.FIRST and first.prefill.plan.grid == (132,)


@needs_gluon
def test_decodes_before_fresh_prefills_on_sm90(fake_h100):
    step = _builder().build(_common([(1, 40), (1, 0), (1, 7), (200, 0), (64, 0)])).step
    assert step.new_kv_rows.kinds() == (K.CACHE_WRITE, K.ATTENTION, K.GLUON_PREFILL)
    assert step.new_kv_rows.write is WritePolicy.FIRST and step.new_kv_rows_other_cache is None
    decode, gluon = step.new_kv_rows.launches[1].plan, step.new_kv_rows.launches[2].plan
    assert decode is step.decode_plan and decode.num_decodes == decode.num_seqs == 3
    assert gluon.first_seq == 3 and not gluon.writes_cache and step.write_todo is None


@needs_gluon
def test_chunked_prefills_on_sm90_run_the_triton_prefill_kernel(fake_h100):
    """Prefills with cached context (new-token work dominating) take the Triton prefill kernel after the decodes;
    context-heavy ones stay on the unified kernel (with the paged Gluon prefill off; on, it serves both)."""
    step = _builder(hopper_paged_prefill=False).build(_common([(1, 40), (200, 0), (100, 64), (129, 0)])).step
    assert step.new_kv_rows.kinds() == (K.CACHE_WRITE, K.ATTENTION, K.TRITON_PREFILL)
    prefill = step.new_kv_rows.launches[2].plan
    assert isinstance(prefill, PrefillPlan) and prefill.first_seq == 1 and step.decode_plan.num_decodes == 1
    assert _builder(hopper_paged_prefill=False).build(_common([(1, 40), (16, 2000)])).step.new_kv_rows is None


def test_mixed_batch_on_the_interpreter_splits_when_asked():
    """The real (CPU) device with prefill_kernel=True: decodes on the unified kernel's decode tiles, the chunked
    and fresh prefills on the Triton prefill kernel, the write first, one stream."""
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=32, dtype="float16", block_size=16)
    meta = _builder(spec, prefill_kernel=True).build(_common([(1, 20), (1, 3), (40, 23), (33, 0)], spec))
    step = meta.step
    assert step.new_kv_rows.kinds() == (K.CACHE_WRITE, K.ATTENTION, K.TRITON_PREFILL)
    assert step.decode_plan.num_decodes == 2 and step.prefill.plan.first_seq == 2
    assert step.new_kv.kinds() == (K.CACHE_WRITE, K.ATTENTION) and step.new_kv.launches[1].plan is meta.plan
    assert meta.plan.num_decodes == 2 and meta.prefill_split == (step.decode_plan, step.prefill.plan)


def _split_builder(**kw):
    """A CPU builder given an H100's SM count and a split-KV workspace (a CUDA builder allocates one)."""
    builder = _builder(**kw)
    builder.num_sms = 132
    builder.workspace = SplitKVWorkspace.allocate(64, SPEC.num_heads, SPEC.head_size, device="cpu")
    return builder


def test_split_decodes_merge_their_segments_in_their_launch():
    """A decode-only batch whose keys are split plans no reduction launch: the attention launch merges (the last
    segment program of each decode and KV head); a batch with prefill programs keeps the reduction launch."""
    meta = _split_builder().build(_common([(1, 3000), (1, 900)]))
    plan = meta.plan
    assert plan.num_kv_splits > 1 and plan.fused_reduce and plan.reduce_grid is None
    assert plan.constexprs[launch.UNIFIED_CONSTEXPRS.index("FUSED_REDUCE")]
    kw = dict(num_heads=SPEC.num_heads, num_kv_heads=SPEC.num_kv_heads, head_size=SPEC.head_size, block_size=16,
              kv_fp8=False, causal=True, workspace=meta.workspace, num_kv_splits=4)
    with_prefill = plan_attention(num_tokens=41, num_seqs=2, max_query_len=40, max_seq_len=3001, num_decodes=1, **kw)
    assert with_prefill.num_kv_splits == 4 and not with_prefill.fused_reduce
    assert with_prefill.reduce_grid == (41, SPEC.num_heads, 1)


def test_a_fused_split_plan_issues_one_launch(monkeypatch):
    """launch_attention issues the attention kernel alone for a fused plan, and the reduction after it otherwise."""
    issued = []
    monkeypatch.setattr(launch, "_attention_launcher", lambda key, grid, *a: issued.append(("attention", grid)))
    monkeypatch.setattr(launch, "_reduce_launcher", lambda key, grid, *a: issued.append(("reduce", grid)))
    common = _common([(1, 3000), (1, 900)])
    plan = _split_builder().build(common).plan
    q, _, _, o, cache = _forward_tensors(common)
    args = (q, cache[:, 0], cache[:, 1], o, common.query_start_loc, common.seq_lens, common.block_table, 0.1)
    launch.launch_attention(plan, *args)
    assert issued == [("attention", plan.grid)]
    issued.clear()
    no_counters = SplitKVWorkspace(plan.workspace.partial_out, plan.workspace.partial_lse)
    two_launches = plan_attention(
        num_tokens=2, num_heads=SPEC.num_heads, num_kv_heads=SPEC.num_kv_heads, head_size=SPEC.head_size,
        block_size=16, num_seqs=2, max_query_len=1, max_seq_len=3001, kv_fp8=False, causal=True,
        num_kv_splits=plan.num_kv_splits, workspace=no_counters)
    assert not two_launches.fused_reduce
    launch.launch_attention(two_launches, *args)
    assert issued == [("attention", two_launches.grid), ("reduce", (2, SPEC.num_heads, 1))]


def test_tree_verify_batches_never_split():
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=32, dtype="float16", block_size=16,
                         num_speculative_tokens=2)
    common = _common([(3, 20), (3, 9)], spec)
    mask = torch.ones(2 * 9, dtype=torch.bool)
    indptr = torch.tensor([0, 9, 18], dtype=torch.int32)
    common = dataclasses.replace(common, spec_tree_mask=mask, spec_tree_mask_indptr=indptr,
                                 spec_tree_mask_indptr_cpu=indptr)
    step = _builder(spec, prefill_kernel=True).build(common).step
    assert step.new_kv_rows is None and step.tree_mask.dtype == torch.uint8
    assert step.tree_mask.data_ptr() == mask.data_ptr()


# ------------------------------------------------------------------------------------ which program runs


@needs_gluon
def test_program_for_picks_by_the_forward_tensors(fake_h100):
    common = _common([(300, 0), (2, 0), (129, 0)])
    step = _builder(hopper_paged_prefill=False).build(common).step
    q, k, v, o, cache = _forward_tensors(common)
    slots = common.slot_mapping
    assert step.program_for(q, None, None, o, cache, slots) is step.no_new_kv  # key=None: the cache holds them
    assert step.program_for(q, k, v, o, None, slots) is step.no_cache
    assert step.program_for(q, k, v, o, cache, slots) is step.new_kv_rows
    fused = torch.stack([k, v], dim=2)  # [tokens, kv_heads, 2, head]: heads not contiguous rows
    assert step.program_for(q, fused[:, :, 0], fused[:, :, 1], o, cache, slots) is step.new_kv
    strided_cache = torch.empty(64, 2, 2 * SPEC.block_size, SPEC.num_kv_heads, SPEC.head_size,
                                dtype=cache.dtype)[:, :, ::2]
    assert not kernel_write_fits(strided_cache, slots, step.kernel_write_tokens)
    assert step.program_for(q, k, v, o, strided_cache, slots) is step.new_kv_rows_other_cache
    assert step.program_for(q, k, v, o, cache, slots[:10]) is step.new_kv_rows_other_cache
    assert kernel_write_fits(cache, slots, step.kernel_write_tokens)


def test_program_for_without_a_split():
    common = _common([(1, 40), (5, 9)])
    step = _builder().build(common).step
    q, k, v, o, cache = _forward_tensors(common)
    assert step.program_for(q, k, v, o, cache, common.slot_mapping) is step.new_kv
    assert step.program_for(q, None, None, o, cache, common.slot_mapping) is step.no_new_kv


# ----------------------------------------------------------------------------------------- make_step_plan


def _plans():
    kw = dict(num_heads=4, num_kv_heads=2, head_size=32, kv_fp8=False, causal=True, block_size=16)
    attention = plan_attention(num_tokens=42, num_seqs=4, max_query_len=33, max_seq_len=63, num_decodes=2,
                               num_kv_splits=1, **kw)
    decode = plan_attention(num_tokens=2, num_seqs=2, max_query_len=1, max_seq_len=63, num_decodes=2,
                            num_kv_splits=1, **kw)
    prefill = plan_prefill_new_kv(num_heads=4, num_kv_heads=2, head_size=32, block_size=16, num_seqs=4,
                                  first_seq=2, max_query_len=33)
    return attention, decode, Launch(K.TRITON_PREFILL, prefill)


def test_overlapped_split_forks_after_the_write_and_joins_after_the_decodes():
    attention, decode, prefill = _plans()
    step = make_step_plan(attention, decode=decode, prefill=prefill, overlap=True)
    assert _kinds_and_streams(step.new_kv_rows) == [
        (K.CACHE_WRITE, StreamRole.MAIN), (K.FORK, StreamRole.SIDE), (K.TRITON_PREFILL, StreamRole.SIDE),
        (K.ATTENTION, StreamRole.MAIN), (K.JOIN, StreamRole.SIDE)]
    assert step.overlapped and step.decode_plan is decode and step.prefill.plan is prefill.plan
    alone = make_step_plan(attention, prefill=prefill, overlap=True)  # no decodes: nothing to overlap
    assert alone.new_kv_rows.kinds() == (K.CACHE_WRITE, K.TRITON_PREFILL) and not alone.overlapped


def test_make_step_plan_rejects_inconsistent_choices():
    attention, decode, prefill = _plans()
    with pytest.raises(ValueError, match="split"):
        make_step_plan(attention, decode=decode)
    with pytest.raises(ValueError, match="prefill kind"):
        make_step_plan(attention, prefill=Launch(K.ATTENTION, attention))
    with pytest.raises(ValueError, match="without decodes"):
        make_step_plan(attention, decode=decode, prefill=prefill, write=WritePolicy.BESIDE, cache_write_sms=4)
    with pytest.raises(ValueError, match="cache_write_sms"):
        make_step_plan(attention, prefill=prefill, write=WritePolicy.BESIDE)
    with pytest.raises(ValueError, match="KERNEL"):
        make_step_plan(attention, prefill=prefill, write=WritePolicy.KERNEL)
    with pytest.raises(ValueError, match="tree mask"):
        make_step_plan(attention, prefill=prefill, tree_mask=torch.ones(4, dtype=torch.uint8))


# --------------------------------------------------------------------------------------------- the runner


class _Recorder:
    """Stands in for the launchers and CUDA streams: records (event, stream) in issue order."""

    def __init__(self, monkeypatch):
        self.events, self.current = [], "main"
        rec = self

        class Stream:
            def __init__(self, name):
                self.name = name

            def wait_stream(self, other):
                rec.events.append(("wait", self.name, other.name))

        class StreamContext:
            def __init__(self, stream):
                self.stream = stream

            def __enter__(self):
                self.before, rec.current = rec.current, self.stream.name

            def __exit__(self, *exc):
                rec.current = self.before

        monkeypatch.setattr(TritonStepRunner, "stream", lambda self, device, role: Stream(role.value))
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream(rec.current))
        monkeypatch.setattr(torch.cuda, "stream", StreamContext)
        for name in ("reshape_and_cache", "launch_attention", "launch_prefill_new_kv", "launch_hopper_prefill",
                     "finish_cache_write"):
            monkeypatch.setattr(runner, name, self._launcher(name))

    def _launcher(self, name):
        def launch(*args, **kwargs):
            self.events.append((name, self.current, args, kwargs))
        return launch

    def names(self):
        return [(e[0], e[1]) if e[0] != "wait" else e for e in self.events]


def _run(step, common, kv_cache=True, key=True):
    q, k, v, o, cache = _forward_tensors(common)
    layer = LayerArgs(0.1, 0.0, None, None, 1.0, 1.0)
    kv = cache if kv_cache else None
    TritonStepRunner().run(step, q, k if key else None, v if key else None, kv, o, common, layer,
                           CacheViews.of(cache) if kv_cache else None)
    return q, k, v, o, cache


def test_runner_issues_the_overlapped_split_in_order(monkeypatch):
    rec = _Recorder(monkeypatch)
    attention, decode, prefill = _plans()
    common = _common([(1, 20), (1, 3), (40, 23), (33, 0)])
    _run(make_step_plan(attention, decode=decode, prefill=prefill, overlap=True), common)
    assert rec.names() == [("reshape_and_cache", "main"), ("wait", "side", "main"),
                           ("launch_prefill_new_kv", "side"), ("launch_attention", "main"),
                           ("wait", "main", "side")]
    decode_call = rec.events[3]
    assert decode_call[2][0] is decode and decode_call[3]["tree_mask"] is None


@needs_gluon
def test_runner_issues_the_gluon_programs(monkeypatch, fake_h100):
    rec = _Recorder(monkeypatch)
    common = _common([(300, 0), (2, 0), (129, 0)])
    step = _builder().build(common).step
    q, k, v, o, cache = _run(step, common)
    assert rec.names() == [("launch_hopper_prefill", "main"), ("finish_cache_write", "main")]
    prefill_args, finish_args = rec.events[0][2], rec.events[1][2]
    assert prefill_args[7] is cache and prefill_args[8] is common.slot_mapping and prefill_args[9] is step.write_todo
    assert finish_args[4] is step.write_todo and finish_args[5] == common.num_actual_tokens
    rec.events.clear()
    beside = _builder(hopper_cache_write=False).build(_common([(1024, 0)] * 16)).step
    _run(beside, _common([(1024, 0)] * 16))
    assert rec.names() == [("wait", "priority", "main"), ("launch_hopper_prefill", "priority"),
                           ("reshape_and_cache", "main"), ("wait", "main", "priority")]
    assert len(rec.events[1][2]) == 7  # the prefill alone: no cache, slots or to-do flags


def test_runner_without_keys_or_cache(monkeypatch):
    rec = _Recorder(monkeypatch)
    common = _common([(1, 40), (5, 9)])
    meta = _builder().build(common)
    _, _, _, _, cache = _run(meta.step, common, key=False)
    assert rec.names() == [("launch_attention", "main")]
    args = rec.events[0][2]
    assert args[0] is meta.plan and args[2].data_ptr() == cache[:, 0].data_ptr() and args[6] is common.seq_lens
    rec.events.clear()
    q, k, v, _, _ = _run(meta.step, common, kv_cache=False)
    assert rec.names() == [("launch_attention", "main")]
    args = rec.events[0][2]
    assert args[2] is not None and args[6] is None and args[7] is None  # keys from key/value, no pages


def test_every_launching_kind_has_a_runner_case():
    """Adding a prefill kernel kind is one LaunchKind member and one runner case: this names a missing case."""
    launching = set(LaunchKind) - {K.FORK, K.JOIN}
    assert set(runner._CASES) == launching, f"kinds without a runner case: {launching - set(runner._CASES)}"


@needs_gluon
def test_the_paged_gluon_prefill_serves_chunks_on_context_and_steps_without_keys(fake_h100):
    """Decodes and a chunk on cached context with the paged kernel on: the decodes on the unified kernel, the chunk on
    the paged kernel, after the write where keys come and without it where they do not; a cache its TMA views cannot
    take falls back to the unified programs; fresh prompts with keys keep the fresh-prompt kernel."""
    builder = _builder(hopper_paged_prefill=True)
    assert builder.choices.paged_prefill.kernel is PagedPrefill.GLUON_HOPPER_PAGED
    common = _common([(1, 40), (1, 70), (512, 1536)])
    meta = builder.build(common)
    step = meta.step
    decode_plan, paged_plan = meta.paged_prefill
    assert decode_plan.num_decodes == 2 and paged_plan.first_seq == 2
    query, key, value, output, cache = _forward_tensors(common, num_blocks=128)
    without_keys = step.program_for(query, None, None, output, cache, common.slot_mapping)
    assert without_keys is step.paged_no_new_kv and without_keys.kinds() == (K.ATTENTION, K.GLUON_PAGED_PREFILL)
    with_keys = step.program_for(query, key, value, output, cache, common.slot_mapping)
    assert with_keys is step.paged_new_kv
    assert with_keys.kinds() == (K.CACHE_WRITE, K.ATTENTION, K.GLUON_PAGED_PREFILL)
    strided = torch.randn(128, 2, 16, 8, 256).to(SPEC.torch_dtype)[..., :128]
    assert step.program_for(query, None, None, output, strided, common.slot_mapping) is step.no_new_kv
    fresh = builder.build(_common([(300, 0), (129, 0)])).step
    q2, k2, v2, o2, c2 = _forward_tensors(_common([(300, 0), (129, 0)]), num_blocks=128)
    assert fresh.program_for(q2, k2, v2, o2, c2, _common([(300, 0), (129, 0)]).slot_mapping).kinds()[0] is K.GLUON_PREFILL
    off = _builder(hopper_paged_prefill=False)
    assert "hopper_paged_prefill" in off.choices.paged_prefill.reason and off.build(common).paged_prefill is None
