"""The Gluon Hopper prefill kernel (attnbackends/triton/prefill_hopper.py) in the Triton backend.

CPU: the reason function, the builder's choice per batch (with a faked compute capability 9.0 device: plans
only, nothing launches: the kernel's own cache write, or the write beside it), ``explain``'s kernel note, and
offline sm_90 compiles of the backend's configs (no spill in the consumers, shared memory within a block's limit,
wgmma not serialised). GPU (sm_90): the public API (``builder.build`` once,
``impl.forward`` with the step's keys and values, output poisoned with NaN, padding rows NaN that must neither be
read nor written; the whole cache compared bitwise with the torch write) against the float64 oracle, for fresh
prefills, decodes before fresh prefills, batches that must fall back (cached context, the kernel turned off,
layouts its descriptors cannot take), fused-projection views, shuffled and bad slots, the three ways to write the
cache (the kernel itself on pages of 16-128 tokens, the write kernel first, beside the kernel), the kernel's own
write alone (whole pages stored, the rest flagged), repeated launches and a CUDA-graph replay.
"""

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from attnbackends import AttentionSpec, build_common_metadata  # noqa: E402
from attnbackends.ops.kv_cache_write import reshape_and_cache_torch  # noqa: E402
from attnbackends.ops.page_guard import PageTableError, raise_pending_faults  # noqa: E402
from attnbackends.platform import DeviceInfo  # noqa: E402
from attnbackends.testing import SequenceShape as S  # noqa: E402
from attnbackends.testing import (  # noqa: E402
    assert_close_to_oracle,
    make_random_batch,
    oracle_attention,
    tolerance_for,
)
from attnbackends.triton import prefill_hopper  # noqa: E402
from attnbackends.triton.backend import TritonAttentionBackend  # noqa: E402
from attnbackends.triton.choices import (  # noqa: E402
    FreshPrefillCacheWrite, FreshPrefillKernel, KernelChoice, PrefillSplit,
)
from attnbackends.triton.prefill_hopper import (  # noqa: E402
    HopperPrefillConfig,
    HopperPrefillPlan,
    fresh_prefills,
    hopper_prefill_reason,
    plan_hopper_prefill,
)
from attnbackends.triton.prefill_launch import PrefillPlan, tma_compatible  # noqa: E402

ON_GPU = torch.cuda.is_available()
HOPPER = ON_GPU and torch.cuda.get_device_capability() == (9, 0)
SPEC = AttentionSpec(num_heads=32, num_kv_heads=8, head_size=128, dtype="bfloat16", block_size=16)
H100 = (9, 0)
needs_gluon = pytest.mark.skipif(not prefill_hopper.gluon_available(), reason="needs triton.experimental.gluon")


# ----------------------------------------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("change, reason", [
    (dict(head_size=64), "head_size 64"),
    (dict(head_size=256), "head_size 256"),
    (dict(head_size_v=64), "value head size 64"),
    (dict(dtype="float32"), "dtype float32"),
    (dict(kv_cache_dtype="fp8_e4m3"), "fp8"),
    (dict(kv_cache_dtype="fp8_e5m2"), "fp8"),
    (dict(sliding_window=256), "sliding window"),
    (dict(logits_soft_cap=30.0), "soft-cap"),
    (dict(alibi_slopes=tuple(2.0 ** -i for i in range(1, 33))), "ALiBi"),
    (dict(has_sinks=True), "sinks"),
    (dict(attn_type="encoder_only"), "encoder_only attention"),
    (dict(attn_type="encoder_decoder"), "encoder_decoder attention"),
])
def test_reason_names_what_the_kernel_does_not_take(change, reason):
    assert reason in hopper_prefill_reason(AttentionSpec(**{**SPEC.model_dump(), **change}), H100)


@needs_gluon
def test_reason_device_and_mode():
    assert hopper_prefill_reason(SPEC, H100) == ""
    assert hopper_prefill_reason(SPEC.model_copy(update=dict(dtype="float16")), H100) == ""
    assert hopper_prefill_reason(AttentionSpec(num_heads=8, num_kv_heads=8, head_size=128), H100) == ""
    for cc in ((8, 0), (8, 9), (10, 0), (12, 0), None):
        assert "compute capability" in hopper_prefill_reason(SPEC, cc)
    assert "interpreter" in hopper_prefill_reason(SPEC, H100, interpreted=True)
    assert "deterministic" in hopper_prefill_reason(SPEC, H100, deterministic=True)


def test_reason_without_gluon(monkeypatch):
    monkeypatch.setattr(prefill_hopper, "gluon_available", lambda: False)
    assert "gluon" in hopper_prefill_reason(SPEC, H100)


def test_fresh_prefills_looks_only_past_the_decodes():
    q = torch.tensor([1, 1, 300, 2], dtype=torch.int32)
    assert fresh_prefills(q, torch.tensor([40, 1, 300, 2], dtype=torch.int32), 2)
    assert fresh_prefills(q, torch.tensor([40, 1, 300, 2], dtype=torch.int32), 1)
    assert not fresh_prefills(q, torch.tensor([40, 1, 300, 2], dtype=torch.int32), 0)
    assert not fresh_prefills(q, torch.tensor([40, 1, 301, 2], dtype=torch.int32), 2)


def test_plan_grid_and_config():
    kw = dict(num_heads=32, num_kv_heads=8, head_size=128, num_seqs=5, first_seq=2, max_query_len=300,
              num_tokens=700, num_sms=132)
    plan = plan_hopper_prefill(**kw)
    items = 32 * 3 * 3  # heads x planned sequences x 128-row blocks of the longest
    assert (plan.grid, plan.first_seq, plan.num_seqs, plan.num_q_blocks) == ((132,), 2, 3, 3)
    assert plan.config == HopperPrefillConfig() and plan.config.epi_tma and plan.config.persistent
    assert plan_hopper_prefill(**dict(kw, num_sms=1000)).grid == (items,)
    assert plan_hopper_prefill(**kw, config=HopperPrefillConfig(persistent=False)).grid == (items,)
    with pytest.raises(ValueError, match="head_size"):
        plan_hopper_prefill(**dict(kw, head_size=64))
    with pytest.raises(ValueError, match="regs"):
        HopperPrefillConfig(regs=(240, 20))
    with pytest.raises(ValueError, match="block_n"):
        HopperPrefillConfig(block_n=32)


def _common(shapes, device="cpu", block_size=SPEC.block_size):
    """Metadata of a batch of (query_len, context_len) requests on consecutive pages of ``block_size`` tokens."""
    tables, at = [], 0
    for q, c in shapes:
        n = -(-(q + c) // block_size)
        tables.append(list(range(at, at + n)))
        at += n
    return build_common_metadata([q for q, _ in shapes], [c for _, c in shapes], tables, block_size, device)


def _builder(spec=SPEC, **kw):
    return TritonAttentionBackend.get_builder_cls()(spec, "cpu", **{"max_num_tokens": 32768, **kw})


@needs_gluon
@pytest.mark.parametrize("shapes, decodes", [
    ([(300, 0), (2, 0), (129, 0)], 0),  # only fresh prefills
    ([(1, 40), (1, 0), (1, 7), (200, 0), (64, 0)], 3),  # decodes (one without context) before fresh prefills
])
def test_builder_puts_fresh_prefills_on_the_gluon_kernel(fake_h100, shapes, decodes):
    builder = _builder()
    assert builder.choices.prefill_split.kernel is PrefillSplit.WHERE_IT_PAYS
    assert builder.choices.fresh_prefill.kernel is FreshPrefillKernel.GLUON_HOPPER
    common = _common(shapes)
    meta = builder.build(common)
    decode_plan, plan = meta.prefill_split
    assert isinstance(plan, HopperPrefillPlan)
    assert (decode_plan is not None) == bool(decodes) and plan.first_seq == decodes
    assert plan.num_seqs == len(shapes) - decodes and plan.num_tokens == common.num_actual_tokens
    assert plan.num_q_blocks == -(-max(q for q, _ in shapes) // 128)
    assert plan.grid == (min(132, SPEC.num_heads * plan.num_seqs * plan.num_q_blocks),)


@needs_gluon
def test_builder_keeps_the_other_paths(fake_h100):
    """With the paged Gluon prefill off (on, it takes the prefills these paths would serve: test_step_plan.py)."""
    fresh = _common([(1, 40), (300, 0), (129, 0)])
    with_context = _common([(1, 40), (200, 0), (100, 64), (129, 0)])  # new-token work dominates: Triton kernel
    context_heavy = _common([(1, 40), (16, 2000)])  # the unified kernel (prefill_kernel_pays)
    builder = _builder(hopper_paged_prefill=False)
    assert isinstance(builder.build(with_context).prefill_split[1], PrefillPlan)
    assert builder.build(context_heavy).prefill_split is None
    off = _builder(hopper_prefill=False, hopper_paged_prefill=False)
    assert off.choices.fresh_prefill == KernelChoice(FreshPrefillKernel.AS_OTHER_PREFILLS, "turned off (hopper_prefill=False)")
    assert isinstance(off.build(fresh).prefill_split[1], PrefillPlan)
    assert _builder(prefill_kernel=False).build(fresh).prefill_split is None
    deterministic = _builder(deterministic=True)
    assert "deterministic" in deterministic.choices.fresh_prefill.reason
    assert deterministic.build(fresh).prefill_split is None
    window = _builder(SPEC.model_copy(update=dict(sliding_window=256)), hopper_paged_prefill=False)
    assert window.choices.fresh_prefill.kernel is FreshPrefillKernel.AS_OTHER_PREFILLS
    assert "sliding window" in window.choices.fresh_prefill.reason
    assert isinstance(window.build(fresh).prefill_split[1], PrefillPlan)


@needs_gluon
def test_builder_lets_the_kernel_write_the_cache(fake_h100):
    """A batch of fresh prefills only: the Gluon kernel writes the cache itself (to-do flags from the builder,
    every SM for the kernel); with decodes before the prefills, 64-key tiles' configs, pages that do not divide a
    128-key tile, or hopper_cache_write=False it does not."""
    fresh = _common([(300, 0), (2, 0), (129, 0)])
    builder = _builder()
    assert builder.choices.fresh_cache_write.kernel is FreshPrefillCacheWrite.IN_KERNEL
    meta = builder.build(fresh)
    plan = meta.prefill_split[1]
    assert plan.writes_cache and plan.block_size == 16 and meta.cache_write_sms == 0
    assert meta.write_todo is not None and meta.write_todo.shape == (builder.max_num_tokens,)
    assert meta.write_todo.dtype == torch.int8 and builder.build(fresh).write_todo is meta.write_todo
    with_decodes = builder.build(_common([(1, 40), (300, 0)]))
    assert not with_decodes.prefill_split[1].writes_cache and with_decodes.write_todo is None
    off = _builder(hopper_cache_write=False)
    assert off.choices.fresh_cache_write == KernelChoice(FreshPrefillCacheWrite.WRITE_KERNEL, "turned off (hopper_cache_write=False)")
    assert not off.build(fresh).prefill_split[1].writes_cache
    odd_pages = _builder(SPEC.model_copy(update=dict(block_size=48)))
    assert odd_pages.choices.fresh_cache_write.kernel is FreshPrefillCacheWrite.WRITE_KERNEL
    assert "block_size 48" in odd_pages.choices.fresh_cache_write.reason
    assert not odd_pages.build(_common([(300, 0), (2, 0), (129, 0)], block_size=48)).prefill_split[1].writes_cache
    assert prefill_hopper.cache_write_reason(HopperPrefillConfig(block_n=64), 16).startswith("key tiles of 64")
    with pytest.raises(ValueError, match="cannot write this cache"):
        plan_hopper_prefill(num_heads=32, num_kv_heads=8, head_size=128, num_seqs=1, first_seq=0, max_query_len=9,
                            num_tokens=9, num_sms=132, config=HopperPrefillConfig(block_n=64), writes_cache=True)


@needs_gluon
def test_builder_leaves_sms_to_the_cache_write(fake_h100):
    """Where the kernel does not write the cache: a batch of fresh prefills only, large enough for the rule, runs
    its Gluon prefill on fewer programs than SMs and the cache write beside it; with decodes, small batches, or
    cache_write_sms=0 the grid keeps every SM and the write runs first."""
    long_batch = _common([(1024, 0)] * 16)
    meta = _builder(hopper_cache_write=False).build(long_batch)
    k = meta.cache_write_sms
    assert 0 < k <= 132 // 4 and meta.prefill_split[0] is None and meta.prefill_split[1].grid == (132 - k,)
    assert _builder().build(long_batch).cache_write_sms == 0  # the kernel writes the cache itself
    for builder, common in ((_builder(cache_write_sms=0, hopper_cache_write=False), long_batch),
                            (_builder(hopper_cache_write=False), _common([(64, 0), (3, 0)])),
                            (_builder(), _common([(1, 40)] + [(1024, 0)] * 16))):
        meta = builder.build(common)
        assert meta.cache_write_sms == 0 and isinstance(meta.prefill_split[1], HopperPrefillPlan)
        assert meta.prefill_split[1].grid[0] == min(132, 32 * meta.prefill_split[1].num_seqs
                                                     * meta.prefill_split[1].num_q_blocks)
    forced = _builder(cache_write_sms=7, hopper_cache_write=False).build(long_batch)
    assert forced.cache_write_sms == 7 and forced.prefill_split[1].grid == (125,)
    assert _builder(hopper_prefill=False).build(long_batch).cache_write_sms == 0  # the Triton prefill kernel
    with pytest.raises(ValueError, match="cache_write_sms"):
        _builder(cache_write_sms=132)


def test_builder_off_the_hopper():
    builder = _builder(prefill_kernel=True)  # the real (CPU) device: interpreted, or no CUDA device
    assert builder.choices.fresh_prefill.kernel is FreshPrefillKernel.AS_OTHER_PREFILLS
    meta = builder.build(_common([(40, 0), (33, 0)]))
    assert meta.prefill_split is None or isinstance(meta.prefill_split[1], PrefillPlan)


@needs_gluon
def test_kernel_note_names_the_prefill_kernel():
    notes = TritonAttentionBackend.kernel_notes(SPEC, DeviceInfo.cuda(9, 0))
    assert len(notes) == 3 and "Gluon warp-specialised Hopper kernel" in notes[0] and "no cached context" in notes[0]
    assert notes[1].startswith("decode schedule:") and notes[2].startswith("CUDA graphs:")
    assert "writes the step's keys and values into the cache itself" in notes[0]
    odd_pages = TritonAttentionBackend.kernel_notes(SPEC.model_copy(update=dict(block_size=48)), DeviceInfo.cuda(9, 0))
    assert "not in it: block_size 48" in odd_pages[0]
    notes = TritonAttentionBackend.kernel_notes(SPEC.model_copy(update=dict(has_sinks=True)), DeviceInfo.cuda(9, 0))
    assert "Triton prefill kernel" in notes[0] and "not the Gluon Hopper kernel: attention sinks" in notes[0]
    assert "compute capability" in TritonAttentionBackend.kernel_notes(SPEC, DeviceInfo.cuda(10, 0))[0]
    assert "unified kernel (the prefill kernels are not used" in TritonAttentionBackend.kernel_notes(
        SPEC, DeviceInfo.cuda(8, 0))[0]
    assert "unified kernel" in TritonAttentionBackend.kernel_notes(SPEC, DeviceInfo.cpu())[0]


@needs_gluon
def test_explain_shows_the_note():
    from attnbackends import AttentionConfig, explain

    result = explain(SPEC, DeviceInfo.cuda(9, 0), AttentionConfig(backend="triton"))
    assert any(n.startswith("triton: prefill kernel: the Gluon") for n in result.notes), result.notes


@needs_gluon
@pytest.mark.skipif(ON_GPU, reason="the GPU runs the kernel itself")
def test_backend_config_compiles_for_sm90():
    """Offline sm_90 compile (a fresh process: the interpreter patches triton.language in this one) of the
    backend's config through the library's own argument builder: no spill, consumers and loader within their
    setmaxnreg limits, shared memory within a block's limit, wgmma not serialised."""
    from benchmarks.compile_check import gluon_prefill_problems as compile_problems

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-m", "benchmarks.compile_check", "--gluon-prefill"], capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2], env=env,
                         timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (rep,) = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert rep["config"] == {**dataclasses.asdict(HopperPrefillConfig()), "regs": [240, 24]}, rep
    assert not compile_problems(rep), (compile_problems(rep), rep)
    assert rep["maxnreg"] == 168 and rep["regs"] <= 168, rep  # 384 threads: one program per SM


@needs_gluon
@pytest.mark.skipif(ON_GPU, reason="the GPU runs the kernel itself")
def test_backend_config_with_its_cache_write_compiles_for_sm90():
    """The same offline compile of the variant the backend runs for batches of fresh prefills only (the kernel
    writing the cache itself: a writer warp beside the loader): within every limit above except that the two
    single-warp partitions, at their few registers, keep a few scalars on the stack."""
    from benchmarks.compile_check import gluon_prefill_problems as compile_problems

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-m", "benchmarks.compile_check", "--gluon-prefill",
                          "--cache-write"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2], env=env, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (rep,) = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert all(p.startswith("spills") for p in compile_problems(rep)), (compile_problems(rep), rep)
    assert rep["stack"] <= 64 and rep["regs_by_limit"]["24"] <= 24, rep
    assert rep["maxnreg"] == 168 and rep["regs"] <= 168, rep


# ----------------------------------------------------------------------------------------------------------- GPU

needs_hopper = pytest.mark.skipif(not (HOPPER and prefill_hopper.gluon_available()),
                                  reason="needs an sm_90 GPU and triton.experimental.gluon")
NAN = float("nan")


def _finish(timeout_s: float = 60.0) -> None:
    """Wait for the launched work; one still running after ``timeout_s`` is a barrier deadlock: end the test run
    instead of hanging every later test."""
    ev = torch.cuda.Event()
    ev.record()
    deadline = time.time() + timeout_s
    while not ev.query():
        if time.time() > deadline:
            pytest.exit(f"the prefill did not finish in {timeout_s:.0f} s (deadlock)", returncode=3)
        time.sleep(0.01)


def _poison_cache(cache: torch.Tensor, batch) -> torch.Tensor:
    """NaN in every slot that holds no request's cached context: nothing may be read from there."""
    bs = batch.spec.block_size
    used = torch.zeros(cache.shape[0], bs, dtype=torch.bool)
    table = batch.common.block_table.cpu()
    for r, shape in enumerate(batch.shapes):
        for p in range(shape.context_len):
            used[int(table[r, p // bs]), p % bs] = True
    cache.permute(0, 2, 1, 3, 4)[~used.to(cache.device)] = NAN
    return cache


def _expected_cache(cache: torch.Tensor, batch, slots: torch.Tensor) -> torch.Tensor:
    """``cache`` after the write of the batch's keys and values to ``slots`` (the torch write; slots outside the
    cache skipped)."""
    expected = cache.clone()
    n = slots.shape[0]
    inside = (slots < cache.shape[0] * cache.shape[2]).cpu()
    keep = torch.nonzero(inside).flatten().to(slots.device)
    reshape_and_cache_torch(batch.key[:n][keep], batch.value[:n][keep], expected, slots[keep])
    return expected


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Bitwise equality of 16-bit tensors, NaN payloads included."""
    diff = (actual.view(torch.int16) != expected.view(torch.int16)).nonzero()
    assert diff.numel() == 0, f"{what}: {diff.shape[0]} elements differ, first at {diff[0].tolist()}"


def run_forward(spec, shapes, *, seed=0, pad_tokens=3, layout=None, slots=None, **builder_kw):
    """One forward through the public API on fresh random data, padding rows of query / key / value NaN; checks
    the output against the oracle, that the padding rows of the output stay untouched and that the cache holds
    exactly what the write kernel would have written (every other slot poisoned with NaN and left as it was).
    ``layout`` rebuilds (query, key, value, output) as other views of the same values; ``slots(batch)`` replaces
    the batch's slot mapping. Returns (metadata, output)."""
    batch = make_random_batch(spec, shapes, seed=seed, device="cuda", pad_tokens=pad_tokens)
    n = batch.num_actual_tokens
    for t in (batch.query, batch.key, batch.value):
        t[n:] = NAN
    if slots is not None:
        batch.common.slot_mapping.copy_(slots(batch))
    builder_kw.setdefault("hopper_paged_prefill", False)  # batches with context on the Triton prefill kernel
    builder = TritonAttentionBackend.get_builder_cls()(spec, "cuda", **builder_kw)
    impl = TritonAttentionBackend.get_impl_cls()(spec)
    meta = builder.build(batch.common)
    query, key, value, out = batch.query, batch.key, batch.value, batch.new_output()
    if layout is not None:
        query, key, value, out = layout(query, key, value, out)
    cache = _poison_cache(batch.kv_cache.clone(), batch)
    expected_cache = _expected_cache(cache, batch, batch.common.slot_mapping)
    impl.forward(query, key, value, cache, meta, out)
    _finish()
    assert torch.isnan(out[n:]).all(), "rows past the batch's tokens were written"
    assert_close_to_oracle(out[:n], oracle_attention(batch), tolerance_for(spec.torch_dtype), what="prefill")
    assert_same_bits(cache, expected_cache, "the cache after the forward")
    return meta, out


LENGTHS = {"mixed": [300, 2, 127, 128, 129, 1000, 64, 513], "127": [127], "128": [128], "129": [129],
           "1000": [1000]}


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("lengths", list(LENGTHS.values()), ids=list(LENGTHS))
@pytest.mark.parametrize("heads", [(32, 8), (8, 8)], ids=["gqa4", "mha"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_fresh_prefills_gpu(lengths, heads, dtype):
    spec = AttentionSpec(num_heads=heads[0], num_kv_heads=heads[1], head_size=128, dtype=dtype, block_size=16)
    meta, _ = run_forward(spec, [S(n, 0) for n in lengths], seed=sum(lengths) + heads[0])
    assert meta.prefill_split[0] is None and isinstance(meta.prefill_split[1], HopperPrefillPlan)

DECODES_THEN_FRESH = [S(1, 0), S(1, 700), S(1, 33), S(300, 0), S(2, 0), S(129, 0), S(1000, 0)]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlapped"])
def test_decodes_then_fresh_prefills_gpu(overlap):
    meta, _ = run_forward(SPEC, DECODES_THEN_FRESH, seed=11, overlap_decodes=overlap)
    decode_plan, plan = meta.prefill_split
    assert decode_plan is not None and decode_plan.num_decodes == 3
    assert isinstance(plan, HopperPrefillPlan) and plan.first_seq == 3 and meta.overlap_streams == overlap


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("case", ["context", "turned_off"])
def test_batches_that_fall_back_gpu(case):
    """A prefill with cached context sends the batch's prefills to the Triton prefill kernel, as does
    hopper_prefill=False for a fresh batch; both still match the oracle."""
    if case == "context":
        meta, _ = run_forward(SPEC, [S(1, 50), S(200, 0), S(100, 64), S(129, 0)], seed=12)
    else:
        meta, _ = run_forward(SPEC, DECODES_THEN_FRESH, seed=13, hopper_prefill=False)
    assert isinstance(meta.prefill_split[1], PrefillPlan)


def _shuffled_slots_with_gaps(batch) -> torch.Tensor:
    """The batch's slots for its fresh prefills in a random order (not page-aligned runs), every seventh -1."""
    slots = batch.common.slot_mapping.clone()
    n = batch.num_actual_tokens
    gen = torch.Generator().manual_seed(5)
    slots[:n] = slots[:n][torch.randperm(n, generator=gen).to(slots.device)]
    slots[:n:7] = -1
    return slots


#: How the forward writes the cache for a batch of fresh prefills: the kernel itself (the default), the write kernel
#: first, or the write kernel beside the prefill on 8 SMs it leaves.
WRITE_MODES = {"kernel": {}, "write_first": dict(hopper_cache_write=False, cache_write_sms=0),
               "write_beside": dict(hopper_cache_write=False, cache_write_sms=8)}


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("mode", list(WRITE_MODES))
def test_cache_write_follows_any_slot_mapping_gpu(mode):
    """A batch on the Gluon kernel: the forward's cache write puts each token where its slot says, not where its
    page would be, and skips -1 (the run checks every slot of the cache bitwise)."""
    meta, _ = run_forward(SPEC, [S(300, 0), S(129, 0), S(1000, 0), S(5, 0)], seed=17,
                          slots=_shuffled_slots_with_gaps, **WRITE_MODES[mode])
    plan = meta.prefill_split[1]
    assert isinstance(plan, HopperPrefillPlan) and plan.writes_cache == (mode == "kernel")
    assert meta.cache_write_sms == (8 if mode == "write_beside" else 0)
    if mode == "kernel":
        assert not meta.write_todo.any(), "the write kernel leaves every to-do flag cleared"


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("heads", [(32, 8), (8, 8)], ids=["gqa4", "mha"])
def test_prefill_beside_the_cache_write_gpu(heads):
    """The prefill on all but 16 SMs of a high-priority stream, the write beside it: the output against the oracle,
    the whole cache bitwise, padding rows untouched."""
    spec = AttentionSpec(num_heads=heads[0], num_kv_heads=heads[1], head_size=128, dtype="bfloat16", block_size=16)
    meta, _ = run_forward(spec, [S(n, 0) for n in LENGTHS["mixed"]], seed=19, hopper_cache_write=False,
                          cache_write_sms=16)
    assert meta.cache_write_sms == 16 and meta.prefill_split[1].grid[0] == torch.cuda.get_device_properties(
        0).multi_processor_count - 16


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
@pytest.mark.parametrize("heads", [(32, 8), (8, 8), (40, 8)], ids=["gqa4", "mha", "gqa5"])
def test_kernel_writes_the_cache_gpu(block_size, heads):
    """The kernel's own cache write on pages of each size that divides a 128-key tile (whole pages by TMA, the
    partial last page of each sequence by the write kernel): the output against the oracle, the whole cache
    bitwise."""
    spec = AttentionSpec(num_heads=heads[0], num_kv_heads=heads[1], head_size=128, dtype="bfloat16",
                         block_size=block_size)
    meta, _ = run_forward(spec, [S(n, 0) for n in LENGTHS["mixed"]], seed=20 + block_size)
    assert meta.prefill_split[1].writes_cache and meta.prefill_split[1].block_size == block_size


def _irregular_chunks(batch) -> torch.Tensor:
    """The batch's slots with five 16-token chunks of the first sequence made irregular: one slot -1, two slots
    swapped, a run of 16 slots that straddles two pages no request uses (in order, but not one page), one slot
    past the cache."""
    slots = batch.common.slot_mapping.clone()
    bs = batch.spec.block_size
    used = set(batch.common.block_table_cpu.flatten().tolist())
    free = next(u for u in range(batch.kv_cache.shape[0] - 1) if u not in used and u + 1 not in used)
    slots[16 * 1 + 5] = -1
    slots[16 * 2 + 3], slots[16 * 2 + 4] = slots[16 * 2 + 4].item(), slots[16 * 2 + 3].item()
    slots[16 * 3:16 * 4] = torch.arange(16, device=slots.device) + free * bs + bs // 2
    slots[16 * 5 + 15] = batch.kv_cache.shape[0] * bs
    return slots


@pytest.mark.gpu
@needs_hopper
def test_kernel_stores_whole_pages_and_flags_the_rest_gpu():
    """The kernel alone (no write kernel after it): every 16-token chunk of a sequence whose slots are one whole
    page in order is in the cache, bitwise; every other token is flagged and its slot untouched. The write kernel
    then completes the cache and clears the flags, and reports the slot past the cache."""
    from attnbackends.ops.kv_cache_write import finish_cache_write

    raise_pending_faults("cuda")
    spec = SPEC
    shapes = [S(300, 0), S(2, 0), S(129, 0), S(1000, 0), S(16, 0), S(17, 0)]
    batch = make_random_batch(spec, shapes, seed=21, device="cuda", pad_tokens=3, num_blocks=400)
    n = batch.num_actual_tokens
    slots = _irregular_chunks(batch)
    batch.common.slot_mapping.copy_(slots)
    meta = TritonAttentionBackend.get_builder_cls()(spec, "cuda").build(batch.common)
    plan = meta.prefill_split[1]
    assert plan.writes_cache
    cache = _poison_cache(batch.kv_cache.clone(), batch)
    before = cache.clone()
    todo = torch.zeros(n + 8, dtype=torch.int8, device="cuda")
    out = batch.new_output()
    prefill_hopper.launch_hopper_prefill(plan, batch.query, batch.key, batch.value, out, batch.common.query_start_loc,
                                         spec.head_size ** -0.5, cache, slots, todo)
    _finish()
    bs, num_slots = spec.block_size, cache.shape[0] * spec.block_size
    expected_flags = torch.zeros(n, dtype=torch.int8)
    starts = batch.common.query_start_loc_cpu.tolist()
    host_slots = slots.cpu()
    for a, b in zip(starts[:-1], starts[1:]):
        for c0 in range(a, b, bs):
            chunk = host_slots[c0:min(c0 + bs, b)]
            whole = (chunk.numel() == bs and 0 <= int(chunk[0]) and int(chunk[0]) % bs == 0
                     and int(chunk[-1]) < num_slots and torch.equal(chunk - chunk[0], torch.arange(bs)))
            if not whole:
                expected_flags[c0:min(c0 + bs, b)] = 1
    assert torch.equal(todo[:n].cpu(), expected_flags), "flags: " + str((todo[:n].cpu() != expected_flags).nonzero())
    assert expected_flags.sum() > 0 and (expected_flags == 0).sum() > n // 2
    stored = (expected_flags == 0).nonzero().flatten().to(slots.device)
    flagged = expected_flags.nonzero().flatten().to(slots.device)
    expected = _expected_cache(before, batch, torch.where(expected_flags.to(slots.device) == 0, slots[:n], -1))
    assert_same_bits(cache, expected, "the cache after the kernel alone")
    assert stored.numel() and flagged.numel()
    finish_cache_write(batch.key, batch.value, cache, slots, todo, n)
    _finish()
    assert not todo.any(), "the write kernel clears every flag"
    assert_same_bits(cache, _expected_cache(before, batch, slots), "the cache after the write kernel")
    with pytest.raises(PageTableError, match=rf"slot_mapping\[{16 * 5 + 15}\]"):
        raise_pending_faults("cuda")
    assert_close_to_oracle(out[:n], oracle_attention(batch), tolerance_for(spec.torch_dtype), what="prefill")


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("mode", list(WRITE_MODES))
def test_cache_write_skips_and_reports_a_slot_outside_the_cache_gpu(mode):
    """A slot past the cache's end is not written (no illegal access: the rest of the cache is checked bitwise)
    and is reported by the next check point, naming the token."""
    raise_pending_faults("cuda")
    bad_token = 310  # a token of the second sequence

    def slots(batch):
        slots = batch.common.slot_mapping.clone()
        slots[bad_token] = batch.kv_cache.shape[0] * SPEC.block_size + 3
        return slots

    run_forward(SPEC, [S(300, 0), S(129, 0)], seed=18, slots=slots, **WRITE_MODES[mode])
    with pytest.raises(PageTableError, match=rf"slot_mapping\[{bad_token}\]"):
        raise_pending_faults("cuda")


def _fused_views(query, key, value, out):
    """query / key / value as slices of one fused [tokens, heads + 2 kv_heads, 128] projection, the output a slice
    of a wider buffer: strided rows the descriptors take."""
    hq, hkv = query.shape[1], key.shape[1]
    qkv = torch.cat([query, key, value], dim=1)
    wide = torch.full((out.shape[0], hq + 2, out.shape[2]), NAN, dtype=out.dtype, device=out.device)
    return qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:], wide[:, 1:hq + 1]


@pytest.mark.gpu
@needs_hopper
def test_fused_projection_views_gpu():
    meta, out = run_forward(SPEC, [S(300, 0), S(129, 0), S(1000, 0)], seed=14, layout=_fused_views)
    assert isinstance(meta.prefill_split[1], HopperPrefillPlan) and out.stride(0) == (SPEC.num_heads + 2) * 128


def _padded_heads(query, key, value, out):
    """key with a gap between heads (head stride 136): no row layout for TMA."""
    padded = torch.full((*key.shape[:2], 136), NAN, dtype=key.dtype, device=key.device)
    padded[..., :128] = key
    return query, padded[..., :128], value, out


def _odd_row_stride(query, key, value, out):
    """value rows 8 bytes past a multiple of 16 apart: no TMA descriptor."""
    t, h, d = value.shape
    buf = torch.full((t, h * d + 4), NAN, dtype=value.dtype, device=value.device)
    view = buf[:, :h * d].view(t, h, d)
    view.copy_(value)
    return query, key, view, out


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("layout", [_padded_heads, _odd_row_stride], ids=["padded_heads", "odd_row_stride"])
def test_layouts_the_descriptors_cannot_take_run_unified_gpu(layout):
    t = torch.zeros(4, SPEC.num_heads, 128, dtype=torch.bfloat16, device="cuda")
    kv = torch.zeros(4, SPEC.num_kv_heads, 128, dtype=torch.bfloat16, device="cuda")
    assert not tma_compatible(*layout(t, kv, kv.clone(), t.clone()))
    run_forward(SPEC, [S(1, 40), S(300, 0), S(129, 0)], seed=15, layout=layout)


@pytest.mark.gpu
@needs_hopper
def test_repeated_launches_and_graph_replay_are_bitwise_gpu():
    """The persistent schedule (16 x 8 query blocks x 32 heads) gives the same bits every launch, eagerly and
    replayed from a CUDA graph, with the kernel writing the cache itself and with the write beside it (the two
    streams captured as a fork and a join); the cache holds every key and value after both."""
    for kernel_writes in (True, False):
        _repeat_and_replay(kernel_writes)


def _repeat_and_replay(kernel_writes: bool) -> None:
    batch = make_random_batch(SPEC, [S(1024, 0)] * 16, seed=16, device="cuda")
    builder = TritonAttentionBackend.get_builder_cls()(SPEC, "cuda", max_num_tokens=16 * 1024,
                                                       hopper_cache_write=kernel_writes)
    impl = TritonAttentionBackend.get_impl_cls()(SPEC)
    meta = builder.build(batch.common)
    assert isinstance(meta.prefill_split[1], HopperPrefillPlan)
    assert meta.prefill_split[1].writes_cache == kernel_writes and (meta.cache_write_sms > 0) != kernel_writes
    cache = batch.kv_cache.clone()
    expected_cache = _expected_cache(cache, batch, batch.common.slot_mapping)
    outs = []
    for _ in range(3):
        out = batch.new_output()
        impl.forward(batch.query, batch.key, batch.value, cache, meta, out)
        _finish()
        outs.append(out)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert_close_to_oracle(outs[0], oracle_attention(batch), tolerance_for(SPEC.torch_dtype), what="prefill")
    graph_out = batch.new_output()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl.forward(batch.query, batch.key, batch.value, cache, meta, graph_out)
    assert_same_bits(cache, expected_cache, "the cache after the eager forwards")
    cache.copy_(batch.kv_cache)
    graph.replay()
    _finish()
    assert torch.equal(graph_out, outs[0])
    assert_same_bits(cache, expected_cache, "the cache after the graph replay")


@pytest.mark.gpu
@needs_hopper
def test_kernel_note_on_this_gpu():
    assert "Gluon warp-specialised Hopper kernel" in TritonAttentionBackend.kernel_notes(SPEC, DeviceInfo.current())[0]
