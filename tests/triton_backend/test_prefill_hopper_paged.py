"""The paged Gluon Hopper prefill (attnbackends/triton/prefill_hopper_paged.py) in the Triton backend.

CPU: the reason function, the builder's plan per batch on a faked sm_90 device (nothing launches; on by default,
off with ``prefill_kernel=False``), the backend's kernel notes, and offline
sm_90 compiles of the layer shapes it serves (shared memory within a block's limit, wgmma not serialised, no
consumer spill). GPU (sm_90): the public API (``build`` once, ``forward`` with the step's keys and values or with
``key=None`` over keys already in the cache; output poisoned with NaN, every cache slot that holds no key poisoned
with NaN, the cache compared bitwise with the torch write) against the float64 oracle: chunks on cached context
on pages of 16 / 32 / 64 / 128 tokens, GQA 1 / 4 / 5 / 8, heads 64 / 128 / 256, sliding windows, sinks, soft-cap,
float16 and bfloat16, decodes before the prefills, and a CUDA-graph replay.
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
from attnbackends.platform import DeviceInfo  # noqa: E402
from attnbackends.testing import SequenceShape as S  # noqa: E402
from attnbackends.testing import assert_close_to_oracle, make_random_batch, oracle_attention, tolerance_for  # noqa
from attnbackends.triton import prefill_hopper_paged as paged  # noqa: E402
from attnbackends.triton.backend import TritonAttentionBackend  # noqa: E402
from attnbackends.triton.choices import KernelChoice, PagedPrefill  # noqa: E402
from attnbackends.triton.prefill_hopper import HopperPrefillPlan  # noqa: E402
from attnbackends.triton.prefill_hopper_paged import (  # noqa: E402
    SOFTCAP_TANH,
    PagedPrefillPlan,
    default_paged_config,
    paged_prefill_reason,
    plan_paged_prefill,
)

ON_GPU = torch.cuda.is_available()
HOPPER = ON_GPU and torch.cuda.get_device_capability() == (9, 0)
SPEC = AttentionSpec(num_heads=32, num_kv_heads=8, head_size=128, dtype="bfloat16", block_size=16)
H100 = (9, 0)
needs_gluon = pytest.mark.skipif(not paged.gluon_available(), reason="needs triton.experimental.gluon")
ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("change, reason", [
    (dict(head_size=96), "head_size 96"),
    (dict(head_size_v=64), "value head size 64"),
    (dict(dtype="float32"), "dtype float32"),
    (dict(kv_cache_dtype="fp8_e4m3"), "fp8"),
    (dict(alibi_slopes=tuple(2.0 ** -i for i in range(1, 33))), "ALiBi"),
    (dict(block_size=48), "block_size 48"),
])
def test_reason_names_what_the_kernel_does_not_take(change, reason):
    spec = AttentionSpec(**{**dict(num_heads=32, num_kv_heads=8, head_size=128, dtype="bfloat16",
                                   block_size=16), **change})
    assert reason in paged_prefill_reason(spec, H100)


@pytest.mark.parametrize("change", [dict(), dict(head_size=64), dict(head_size=256), dict(sliding_window=128),
                                    dict(logits_soft_cap=30.0), dict(has_sinks=True), dict(dtype="float16"),
                                    dict(num_heads=40), dict(block_size=64), dict(num_kv_heads=32)])
def test_reason_takes_the_common_layer_shapes(change):
    spec = AttentionSpec(**{**dict(num_heads=32, num_kv_heads=8, head_size=128, dtype="bfloat16",
                                   block_size=16), **change})
    assert paged_prefill_reason(spec, H100) == ("" if paged.gluon_available() else
                                                "triton.experimental.gluon is not installed")


def test_reason_device_and_mode():
    assert "9.0" in paged_prefill_reason(SPEC, (8, 0))
    assert "9.0" in paged_prefill_reason(SPEC, None)
    assert "interpreter" in paged_prefill_reason(SPEC, H100, interpreted=True)
    assert "deterministic" in paged_prefill_reason(SPEC, H100, deterministic=True)
    enc = AttentionSpec(num_heads=32, num_kv_heads=8, head_size=128, dtype="bfloat16", block_size=16,
                        attn_type="encoder_only")
    assert "encoder" in paged_prefill_reason(enc, H100)


def test_plan_grid_config_and_options():
    spec = AttentionSpec(num_heads=16, num_kv_heads=8, head_size=256, dtype="bfloat16", block_size=32,
                         sliding_window=1024, logits_soft_cap=50.0, has_sinks=True)
    plan = plan_paged_prefill(spec=spec, num_seqs=5, first_seq=2, max_query_len=300, num_tokens=700, num_sms=132)
    assert plan.num_seqs == 3 and plan.num_q_blocks == 3 and plan.grid == (132,)
    assert plan.sliding_window == 1024 and plan.use_softcap and plan.use_sinks and plan.block_size == 32
    assert plan.config == default_paged_config(256) and plan.config.block_n == 64 and not plan.config.epi_tma
    small = plan_paged_prefill(spec=SPEC, num_seqs=1, first_seq=0, max_query_len=100, num_tokens=100, num_sms=132)
    assert small.grid == (32,) and not small.use_sinks and small.sliding_window == 0
    with pytest.raises(ValueError, match="head_size"):
        plan_paged_prefill(spec=AttentionSpec(num_heads=8, num_kv_heads=8, head_size=96, dtype="bfloat16",
                                              block_size=16), num_seqs=1, first_seq=0, max_query_len=1,
                           num_tokens=1, num_sms=132)


def _common(shapes, block_size=16, device="cpu"):
    """Metadata of a batch of (query_len, context_len) requests on consecutive pages."""
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
    ([(512, 3584), (256, 1792)], 0),  # chunks on context
    ([(1, 40), (1, 7), (200, 1000), (64, 0)], 2),  # decodes before a chunk and a fresh prompt
    ([(300, 0), (129, 0)], 0),  # fresh prompts: planned too (key=None steps), the fresh kernel runs with keys
])
def test_builder_plans_the_paged_kernel(fake_h100, shapes, decodes):
    builder = _builder(hopper_paged_prefill=True)
    assert builder.choices.paged_prefill.kernel is PagedPrefill.GLUON_HOPPER_PAGED
    common = _common(shapes)
    meta = builder.build(common)
    decode_plan, plan = meta.paged_prefill
    assert isinstance(plan, PagedPrefillPlan) and plan.first_seq == decodes
    assert (decode_plan is not None) == bool(decodes)
    assert plan.num_seqs == len(shapes) - decodes and plan.num_tokens == common.num_actual_tokens
    assert plan.num_q_blocks == -(-max(q for q, _ in shapes) // 128)


def test_decodes_beside_the_paged_kernel_split_their_keys():
    """The decodes run before the paged kernel with the GPU to themselves: a few over long contexts get their keys
    split as a decode-only batch's would (where the builder has a workspace), many short ones stay unsplit."""
    from attnbackends.triton.heuristics import choose_num_kv_splits
    from attnbackends.triton.launch import SplitKVWorkspace

    fake = _builder()  # a CPU builder given an H100's SM count and a workspace
    fake.num_sms = 132
    fake.workspace = SplitKVWorkspace.allocate(64, SPEC.num_heads, SPEC.head_size, device="cpu")
    common = _common([(1, 30000), (1, 9000), (2048, 14336)])
    decode_plan, plan = paged.plan_paged_split(fake, common, 2, 2, True)
    splits = choose_num_kv_splits(2, SPEC.num_kv_heads, SPEC.num_heads, 132, 30001)
    assert splits > 1 and decode_plan.grid == (2, SPEC.num_kv_heads, splits)
    assert decode_plan.fused_reduce and decode_plan.reduce_grid is None  # decodes only: merged in their launch
    assert decode_plan.workspace is fake.workspace and plan.first_seq == 2
    many = _common([(1, 100)] * 48 + [(256, 1024)])
    assert paged.plan_paged_split(fake, many, 48, 48, True)[0].grid[2] == 1
    fake.workspace = None  # no workspace (the CPU, deterministic builders): never split
    assert paged.plan_paged_split(fake, common, 2, 2, True)[0].grid[2] == 1


def test_builder_says_why_not(fake_h100):
    off = _builder(hopper_paged_prefill=False).choices.paged_prefill
    assert off.kernel is PagedPrefill.OFF and "turned off" in off.reason
    alibi = AttentionSpec(num_heads=32, num_kv_heads=8, head_size=128, dtype="bfloat16", block_size=16,
                          alibi_slopes=tuple(2.0 ** -i for i in range(1, 33)))
    builder = _builder(alibi, hopper_paged_prefill=True)
    assert builder.choices.paged_prefill == KernelChoice(PagedPrefill.OFF, "ALiBi")
    assert builder.build(_common([(200, 1000)])).paged_prefill is None
    assert _builder(hopper_paged_prefill=True).build(_common([(1, 40), (1, 9)])).paged_prefill is None  # decodes only


@needs_gluon
def test_default_builder_plans_it_unless_the_prefill_kernels_are_off(fake_h100):
    """On by default (PAGED_PREFILL_DEFAULT) for a chunk on context and a key=None-capable fresh batch; a builder
    with prefill_kernel=False keeps every prefill on the unified kernel."""
    assert paged.PAGED_PREFILL_DEFAULT
    default = _builder()
    assert default.choices.paged_prefill.kernel is PagedPrefill.GLUON_HOPPER_PAGED
    assert default.build(_common([(512, 3584), (256, 1792)])).paged_prefill is not None
    fresh = default.build(_common([(300, 0), (129, 0)]))
    assert fresh.paged_prefill is not None and isinstance(fresh.prefill_split[1], HopperPrefillPlan)  # keys: fresh
    off = _builder(prefill_kernel=False)
    assert off.choices.paged_prefill.kernel is PagedPrefill.OFF and "prefill_kernel=False" in off.choices.paged_prefill.reason
    assert off.build(_common([(512, 3584)])).paged_prefill is None
    forced = _builder(prefill_kernel=False, hopper_paged_prefill=True).choices.paged_prefill
    assert forced.kernel is PagedPrefill.GLUON_HOPPER_PAGED and "hopper_paged_prefill=True" in forced.reason


@needs_gluon
def test_kernel_notes_name_the_paged_kernel():
    from attnbackends.triton.backend import TritonAttentionBackend as T

    h100 = DeviceInfo.cuda(9, 0)
    plain = T.kernel_notes(SPEC, h100)[0]
    assert "Gluon warp-specialised Hopper kernel" in plain and "paged Gluon Hopper kernel" in plain
    assert "key=None" in plain and "chunks on cached context" in plain
    sinks = T.kernel_notes(_spec(has_sinks=True), h100)[0]
    assert sinks.startswith("prefill kernel: the paged Gluon Hopper kernel") and "attention sinks" in sinks
    for kw, why in [(dict(kv_cache_dtype="fp8_e4m3"), "an fp8 KV cache"), (dict(block_size=48), "block_size 48"),
                    (dict(alibi_slopes=tuple(2.0 ** -i for i in range(1, 33))), "ALiBi")]:
        note = T.kernel_notes(_spec(**kw), h100)[0]
        assert f"not the paged Gluon Hopper kernel: {why}" in note, note
    assert "not the paged Gluon Hopper kernel: compute capability" in T.kernel_notes(SPEC, DeviceInfo.cuda(8, 0))[0]


def test_builder_off_the_hopper():
    builder = TritonAttentionBackend.get_builder_cls()(SPEC, "cpu", hopper_paged_prefill=True)
    assert builder.choices.paged_prefill.kernel is PagedPrefill.OFF and builder.build(_common([(200, 1000)])).paged_prefill is None


@needs_gluon
def test_every_variant_compiles_for_sm90():
    """Offline sm_90 compile (a fresh process without TRITON_INTERPRET: the interpreter patches triton.language in
    this one, and a Gluon kernel compiled beside interpreted functions fails) of every layer
    shape in ``benchmarks.prefill_hopper_paged_compile.VARIANTS``: shared memory within the limit, no serialised
    wgmma, no partition over its register limit, no spill in the consumers."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled, not interpreted
    res = subprocess.run([sys.executable, "-m", "benchmarks.prefill_hopper_paged_compile"], capture_output=True,
                         text=True, cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)}, timeout=900)
    errors = [line for line in res.stderr.splitlines() if line.strip() and not line.startswith(" ")]
    assert res.returncode == 0, "\n".join(errors[-30:])[-3000:]
    reps = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert len(reps) >= 9
    for rep in reps:
        assert not [p for p in rep["problems"] if not p.startswith("spills")], rep
        consumer = str(rep["config"]["regs"][0])
        assert rep["regs_by_limit"].get(consumer, 0) <= rep["config"]["regs"][0], rep


# ----------------------------------------------------------------------------------------------------------- GPU

needs_hopper = pytest.mark.skipif(not (HOPPER and paged.gluon_available()),
                                  reason="needs an sm_90 GPU and triton.experimental.gluon")
NAN = float("nan")


def _finish(timeout_s: float = 60.0) -> None:
    """Wait for the launched work; one still running after ``timeout_s`` is a barrier deadlock."""
    ev = torch.cuda.Event()
    ev.record()
    deadline = time.time() + timeout_s
    while not ev.query():
        if time.time() > deadline:
            pytest.exit(f"the prefill did not finish in {timeout_s:.0f} s (deadlock)", returncode=3)
        time.sleep(0.01)


def _poison_cache(cache: torch.Tensor, batch, keep_new: bool) -> torch.Tensor:
    """NaN in every slot that holds no key of a request (its context, and its new tokens where ``keep_new``)."""
    bs = batch.spec.block_size
    used = torch.zeros(cache.shape[0], bs, dtype=torch.bool)
    table = batch.common.block_table.cpu()
    for r, shape in enumerate(batch.shapes):
        end = shape.context_len + (shape.query_len if keep_new else 0)
        for p in range(end):
            used[int(table[r, p // bs]), p % bs] = True
    cache.permute(0, 2, 1, 3, 4)[~used.to(cache.device)] = NAN
    return cache


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    diff = (actual.view(torch.int16) != expected.view(torch.int16)).nonzero()
    assert diff.numel() == 0, f"{what}: {diff.shape[0]} elements differ, first at {diff[0].tolist()}"


def run_paged(spec, shapes, *, seed=0, key_none=False, pad_tokens=3):
    """One forward through the public API with the paged kernel on: output and padding rows NaN, the cache's
    unused slots NaN; checks the output against the oracle, the padding rows untouched and the cache bitwise."""
    batch = make_random_batch(spec, shapes, seed=seed, device="cuda", pad_tokens=pad_tokens)
    n = batch.num_actual_tokens
    for t in (batch.query, batch.key, batch.value):
        t[n:] = NAN
    builder = TritonAttentionBackend.get_builder_cls()(spec, "cuda", hopper_paged_prefill=True)
    impl = TritonAttentionBackend.get_impl_cls()(spec, sinks=batch.sinks)
    meta = builder.build(batch.common)
    assert meta.paged_prefill is not None, builder.choices.paged_prefill
    cache = batch.kv_cache.clone()
    slots = batch.common.slot_mapping
    if key_none:  # the step's keys are already in the cache
        reshape_and_cache_torch(batch.key[:n], batch.value[:n], cache, slots[:n])
    cache = _poison_cache(cache, batch, keep_new=key_none)
    expected = cache.clone()
    if not key_none:
        reshape_and_cache_torch(batch.key[:n], batch.value[:n], expected, slots[:n])
    out = batch.new_output()
    if key_none:
        impl.forward(batch.query, None, None, cache, meta, out)
    else:
        impl.forward(batch.query, batch.key, batch.value, cache, meta, out)
    _finish()
    assert torch.isnan(out[n:]).all(), "rows past the batch's tokens were written"
    assert_close_to_oracle(out[:n], oracle_attention(batch), tolerance_for(spec.torch_dtype), what="paged prefill")
    assert_same_bits(cache, expected, "the cache after the forward")
    return meta, out


CHUNKS = [S(300, 1000), S(2, 77), S(129, 129), S(128, 384), S(1000, 3), S(64, 0), S(513, 2000)]


def _spec(**kw):
    base = dict(num_heads=32, num_kv_heads=8, head_size=128, dtype="bfloat16", block_size=16)
    return AttentionSpec(**{**base, **kw})


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
@pytest.mark.parametrize("key_none", [False, True], ids=["keys", "key_none"])
def test_chunks_on_context_gpu(block_size, key_none):
    meta, _ = run_paged(_spec(block_size=block_size), CHUNKS, seed=block_size, key_none=key_none)
    assert meta.paged_prefill[0] is None and meta.paged_prefill[1].num_seqs == len(CHUNKS)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("heads", [(8, 8), (32, 8), (40, 8), (64, 8)], ids=["gqa1", "gqa4", "gqa5", "gqa8"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gqa_and_dtypes_gpu(heads, dtype):
    run_paged(_spec(num_heads=heads[0], num_kv_heads=heads[1], dtype=dtype), CHUNKS[:4], seed=heads[0])


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("kw", [
    dict(head_size=64, num_heads=64, has_sinks=True, sliding_window=128),
    dict(head_size=64, num_heads=16, num_kv_heads=16),
    dict(head_size=256, num_heads=16, sliding_window=1024),
    dict(head_size=256, num_heads=16, logits_soft_cap=50.0, block_size=32),
    dict(sliding_window=4096),
    dict(sliding_window=200, block_size=64),
    dict(logits_soft_cap=30.0),
    dict(has_sinks=True),
    dict(logits_soft_cap=30.0, has_sinks=True, sliding_window=300, dtype="float16"),
], ids=["h64-sinks-win128", "h64-mha", "h256-win1024", "h256-softcap-page32", "win4096", "win200-page64",
        "softcap", "sinks", "all-fp16"])
@pytest.mark.parametrize("key_none", [False, True], ids=["keys", "key_none"])
def test_layer_shapes_gpu(kw, key_none):
    shapes = [S(300, 1000), S(5, 5000), S(700, 0), S(128, 128)]
    run_paged(_spec(**kw), shapes, seed=len(kw), key_none=key_none)


@pytest.mark.gpu
@needs_hopper
def test_decodes_before_chunks_gpu():
    meta, _ = run_paged(SPEC, [S(1, 700), S(1, 33), S(1, 0), S(300, 1000), S(64, 64)], seed=5)
    assert meta.paged_prefill[0] is not None and meta.paged_prefill[1].first_seq == 3


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("kw", [{}, dict(head_size=64, num_heads=64, has_sinks=True, sliding_window=128),
                                dict(head_size=256, num_heads=16, sliding_window=1024)],
                         ids=["h128", "h64-sinks-win128", "h256-win1024"])
def test_split_decodes_before_a_chunk_gpu(kw):
    """A few decodes over long contexts beside a chunk: their keys split (the decode launch's third grid axis)."""
    meta, _ = run_paged(_spec(**kw), [S(1, 9000), S(1, 3000), S(300, 5000)], seed=7)
    decode_plan, plan = meta.paged_prefill
    assert decode_plan is not None and decode_plan.grid[2] > 1 and plan.first_seq == 2


@pytest.mark.gpu
@needs_hopper
def test_graph_replay_is_bitwise_gpu():
    """Eager forwards give the same bits each time, and a CUDA-graph replay gives them too, cache included."""
    batch = make_random_batch(SPEC, [S(512, 3584)] * 4 + [S(256, 1792)] * 4, seed=21, device="cuda")
    builder = TritonAttentionBackend.get_builder_cls()(SPEC, "cuda", hopper_paged_prefill=True)
    impl = TritonAttentionBackend.get_impl_cls()(SPEC)
    meta = builder.build(batch.common)
    assert meta.paged_prefill is not None
    cache = batch.kv_cache.clone()
    outs = []
    for _ in range(3):
        out = batch.new_output()
        impl.forward(batch.query, batch.key, batch.value, cache, meta, out)
        _finish()
        outs.append(out)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert_close_to_oracle(outs[0], oracle_attention(batch), tolerance_for(SPEC.torch_dtype), what="paged prefill")
    after_eager = cache.clone()
    graph_out = batch.new_output()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl.forward(batch.query, batch.key, batch.value, cache, meta, graph_out)
    cache.copy_(batch.kv_cache)
    graph.replay()
    _finish()
    assert torch.equal(graph_out, outs[0])
    assert_same_bits(cache, after_eager, "the cache after the graph replay")


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("mode", sorted(SOFTCAP_TANH))
@pytest.mark.parametrize("kw", [dict(logits_soft_cap=30.0), dict(logits_soft_cap=50.0, dtype="float16"),
                                dict(logits_soft_cap=5.0, head_size=256, num_heads=16)],
                         ids=["cap30", "cap50-fp16", "cap5-h256"])
def test_softcap_tanh_modes_gpu(mode, kw, monkeypatch):
    """Every way of computing the soft-cap's tanh against the float64 oracle (a small cap drives the tanh into
    saturation, a large one keeps it near linear)."""
    default = paged.default_paged_config
    monkeypatch.setattr(paged, "default_paged_config",
                        lambda head_size: dataclasses.replace(default(head_size), softcap_tanh=mode))
    run_paged(_spec(**kw), [S(300, 1000), S(5, 700), S(200, 0)], seed=7)
