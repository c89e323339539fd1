"""The Triton prefill kernel (new tokens' K/V from the forward's key/value, context from the pages) through the
backend's public API, against the float64 oracle: interpreted at tiny shapes on the CPU, at real shapes on the GPU."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from attnbackends import AttentionSpec  # noqa: E402
from attnbackends.testing import SequenceShape as S  # noqa: E402
from attnbackends.testing import assert_close_to_oracle, make_random_batch, oracle_attention, tolerance_for  # noqa: E402
from attnbackends.triton.backend import TritonAttentionBackend  # noqa: E402
from attnbackends.triton.choices import KernelChoice, PrefillSplit  # noqa: E402
from attnbackends.triton.heuristics import prefill_kernel_pays  # noqa: E402
from attnbackends.triton.prefill_launch import prefill_new_kv_unsupported_reason  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"

# Decodes first, then chunked prefills with context (partial last context tile), a plain prefill, a 1-token
# prefill-classified tail, and a prefill longer than two query blocks.
MIXED = [S(1, 20), S(1, 3), S(40, 23), S(33, 0), S(2, 17), S(20, 48)]


def poison_unread_slots(cache: torch.Tensor, batch) -> torch.Tensor:
    """NaN in every cache slot that holds no request's cached context (other pages, slots past a request's context,
    the step's own slots before the write): an allocator's pages may hold anything, and nothing may leak from them."""
    common, bs = batch.common, batch.spec.block_size
    used = torch.zeros(cache.shape[0], bs, dtype=torch.bool)
    table = common.block_table.cpu()
    for r, shape in enumerate(batch.shapes):
        for p in range(shape.context_len):
            used[int(table[r, p // bs]), p % bs] = True
    by_slot = cache.permute(0, 2, 1, 3, 4)  # [num_blocks, block_size, 2, kv_heads, head_size]
    by_slot[~used.to(cache.device)] = float("nan")
    return cache


def run_forward(spec: AttentionSpec, shapes, *, seed: int = 0, pad_tokens: int = 0, key_strided: bool = False,
                config=None):
    """One forward with the step's key/value on fresh random data, the prefills on the prefill kernel (planned with
    ``config`` when given: its tiles and gqa_pack); returns (output, batch, metadata)."""
    import dataclasses

    from attnbackends.triton.prefill_launch import plan_prefill_new_kv
    from attnbackends.triton.step_plan import Launch, LaunchKind, make_step_plan

    batch = make_random_batch(spec, shapes, seed=seed, device=DEVICE, pad_tokens=pad_tokens)
    builder = TritonAttentionBackend.get_builder_cls()(spec, DEVICE, prefill_kernel=True,
                                                       hopper_paged_prefill=False)  # not the paged Gluon kernel
    impl = TritonAttentionBackend.get_impl_cls()(spec, sinks=batch.sinks)
    meta = builder.build(batch.common)
    if config is not None:
        decode_plan, plan = meta.prefill_split
        planned = plan_prefill_new_kv(
            num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
            block_size=spec.block_size, num_seqs=batch.common.num_reqs, first_seq=plan.first_seq,
            max_query_len=batch.common.max_query_len, sliding_window=spec.sliding_window,
            use_softcap=bool(spec.logits_soft_cap), use_sinks=spec.has_sinks, config=config)
        assert planned.grid[0] == spec.num_heads // config.gqa_pack
        step = make_step_plan(meta.plan, decode=decode_plan, prefill=Launch(LaunchKind.TRITON_PREFILL, planned))
        meta = dataclasses.replace(meta, step=step)
    key, value = batch.key, batch.value
    if key_strided:  # keys and values as views of one fused [tokens, 2, kv_heads, head] projection
        fused = torch.stack([key, value], dim=1)
        key, value = fused[:, 0], fused[:, 1]
    out = batch.new_output()
    out.fill_(float("nan"))
    impl.forward(batch.query, key, value, poison_unread_slots(batch.kv_cache.clone(), batch), meta, out)
    return out, batch, meta


def check(spec, shapes, **kw):
    out, batch, meta = run_forward(spec, shapes, **kw)
    assert meta.prefill_split is not None, "the batch should run on the prefill kernel"
    n = batch.num_actual_tokens
    assert_close_to_oracle(out[:n], oracle_attention(batch), tolerance_for(spec.torch_dtype), what="prefill kernel")
    return meta


CPU_SPECS = [
    AttentionSpec(num_heads=4, num_kv_heads=2, head_size=32, dtype="float16", block_size=16),
    AttentionSpec(num_heads=2, num_kv_heads=2, head_size=64, dtype="float16", block_size=32),
    AttentionSpec(num_heads=5, num_kv_heads=1, head_size=32, dtype="float16", block_size=16),
]


@pytest.mark.skipif(ON_GPU, reason="interpreted shapes; the GPU runs test_prefill_kernel_gpu")
@pytest.mark.parametrize("spec", CPU_SPECS, ids=lambda s: f"h{s.num_heads}kv{s.num_kv_heads}d{s.head_size}b{s.block_size}")
def test_mixed_batch_matches_oracle_interpreted(spec):
    meta = check(spec, MIXED, pad_tokens=3)
    decode_plan, prefill_plan = meta.prefill_split
    assert decode_plan is not None and decode_plan.num_decodes == 2 and prefill_plan.first_seq == 2


@pytest.mark.skipif(ON_GPU, reason="interpreted shapes")
def test_only_prefills_and_fused_key_value_views():
    spec = CPU_SPECS[0]
    meta = check(spec, [S(40, 23), S(17, 0)], key_strided=True)
    assert meta.prefill_split[0] is None  # no decodes: no decode launch


@pytest.mark.skipif(ON_GPU, reason="interpreted shapes")
def test_without_new_keys_the_unified_plan_runs():
    """forward(q, None, None, ...) (the cache already holds the step's K/V) runs the batch's unified plan."""
    spec = CPU_SPECS[0]
    batch = make_random_batch(spec, MIXED, seed=1, device=DEVICE)
    builder = TritonAttentionBackend.get_builder_cls()(spec, DEVICE)
    impl = TritonAttentionBackend.get_impl_cls()(spec)
    cache = batch.kv_cache.clone()
    impl.update_kv_cache(batch.key, batch.value, cache, batch.common.slot_mapping)
    out = batch.new_output()
    out.fill_(float("nan"))
    impl.forward(batch.query, None, None, cache, builder.build(batch.common), out)
    assert_close_to_oracle(out, oracle_attention(batch), tolerance_for(spec.torch_dtype), what="unified")


FEATURES = {
    "window": dict(sliding_window=20),  # ends inside the context of some requests, inside the new tokens of others
    "window_small": dict(sliding_window=5),  # shorter than a tile: rows see nothing in their block's first tiles
    "softcap": dict(logits_soft_cap=2.0),  # small enough to change the scores of the random data
    "sinks": dict(has_sinks=True),
    "window_sinks": dict(sliding_window=20, has_sinks=True),
}


@pytest.mark.skipif(ON_GPU, reason="interpreted shapes")
@pytest.mark.parametrize("feature", list(FEATURES))
def test_features_match_oracle_interpreted(feature):
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=32, dtype="float16", block_size=16,
                         **FEATURES[feature])
    check(spec, MIXED, seed=7, pad_tokens=2)


@pytest.mark.skipif(ON_GPU, reason="interpreted shapes")
@pytest.mark.parametrize("pack", [2, 4])
@pytest.mark.parametrize("feature", ["plain", "window_small", "softcap", "window_sinks"])
def test_gqa_packed_tiles_match_oracle_interpreted(pack, feature):
    """gqa_pack heads of one KV head share a program's rows (token-major): same answers as the oracle, including
    the rows of a partial last token block, windows, soft-cap and per-head sinks."""
    from attnbackends.triton.heuristics import PrefillConfig

    spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=32, dtype="float16", block_size=16,
                         **FEATURES.get(feature, {}))
    check(spec, MIXED, seed=9, pad_tokens=2, config=PrefillConfig(16, 16, 4, 1, gqa_pack=pack))


def test_gqa_pack_must_divide_the_heads_and_the_tile():
    from attnbackends.triton.heuristics import PrefillConfig
    from attnbackends.triton.prefill_launch import plan_prefill_new_kv

    for pack, heads in ((4, 6), (3, 6), (32, 32)):
        with pytest.raises(ValueError, match="gqa_pack"):
            plan_prefill_new_kv(num_heads=heads, num_kv_heads=1, head_size=64, block_size=16, num_seqs=1,
                                first_seq=0, max_query_len=64, config=PrefillConfig(16, 16, 4, 1, gqa_pack=pack))


@pytest.mark.parametrize("feature, reason", [
    (dict(kv_cache_dtype="fp8_e4m3"), "fp8"), (dict(attn_type="encoder_only"), "encoder"),
    (dict(alibi_slopes=(0.5, 0.25, 0.125, 0.0625)), "ALiBi"),
])
def test_features_the_kernel_does_not_take_keep_the_unified_path(feature, reason):
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=32, dtype="float16", block_size=16, **feature)
    builder = TritonAttentionBackend.get_builder_cls()(spec, "cpu", prefill_kernel=True)
    assert builder.choices.prefill_split.kernel is PrefillSplit.OFF and reason in builder.choices.prefill_split.reason


def test_off_on_request_and_default_per_device():
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=64, dtype="float16", block_size=16)
    batch = make_random_batch(spec, MIXED, seed=2, device=DEVICE)
    off = TritonAttentionBackend.get_builder_cls()(spec, DEVICE, prefill_kernel=False)
    assert off.choices.prefill_split == KernelChoice(PrefillSplit.OFF, "turned off (prefill_kernel=False)")
    assert off.build(batch.common).prefill_split is None
    default = TritonAttentionBackend.get_builder_cls()(spec, DEVICE)
    if ON_GPU and torch.cuda.get_device_capability() == (9, 0):  # on by default where the kernel applies and pays
        assert default.choices.prefill_split.kernel is PrefillSplit.WHERE_IT_PAYS
        fresh = make_random_batch(spec, [S(1, 30), S(64, 0), S(40, 8)], seed=3, device=DEVICE)
        assert default.build(fresh.common).prefill_split is not None
        assert default.build(batch.common).prefill_split is None  # context-heavy: the unified kernel
    elif not ON_GPU:  # off on the CPU, so the interpreter keeps covering the unified path
        assert default.choices.prefill_split.kernel is PrefillSplit.OFF and "on the CPU" in default.choices.prefill_split.reason
        assert default.build(batch.common).prefill_split is None


@pytest.mark.parametrize("query_lens, seq_lens, first, pays", [
    ([8192], [8192], 0, True),                          # a whole prompt: no cached context
    ([1] * 60 + [512] * 4, [4096] * 60 + [2560] * 4, 60, False),  # chunks on a long context, decodes before them
    ([1, 1, 100], [50, 900, 150], 2, True),             # the decodes' long contexts do not count
    ([100, 10], [150, 1000], 0, False),                 # 5050 of new-token work against 14900 of context work
])
def test_prefill_kernel_pays_where_new_tokens_dominate(query_lens, seq_lens, first, pays):
    q, s = torch.tensor(query_lens, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32)
    assert prefill_kernel_pays(q, s, first) is pays


def test_reasons_per_device():
    kw = dict(dtype=torch.bfloat16, kv_fp8=False, causal=True, use_alibi=False)
    assert prefill_new_kv_unsupported_reason(head_size=128, compute_capability=(9, 0), **kw) is None
    assert "head_size 96" in prefill_new_kv_unsupported_reason(head_size=96, compute_capability=(9, 0), **kw)
    assert "sm_90" in prefill_new_kv_unsupported_reason(head_size=128, compute_capability=(8, 9), **kw)
    assert "CUDA" in prefill_new_kv_unsupported_reason(head_size=128, compute_capability=None, **kw)
    assert "bfloat16" in prefill_new_kv_unsupported_reason(head_size=128, compute_capability=None, interpreted=True,
                                                           **kw)


GPU_SHAPES = [S(1, 700), S(1, 33), S(300, 517), S(1000, 0), S(129, 4096), S(64, 64), S(7, 1)]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(8, 8), (16, 4), (40, 8), (32, 4)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_prefill_kernel_gpu(head_size, num_heads, num_kv_heads, dtype):
    spec = AttentionSpec(num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype,
                         block_size=16)
    meta = check(spec, GPU_SHAPES, seed=head_size + num_heads, pad_tokens=5)
    assert meta.prefill_split[1].first_seq == 2


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("feature", ["window_sinks", "softcap", "window_small"])
def test_prefill_kernel_gpu_features(head_size, feature):
    spec = AttentionSpec(num_heads=32, num_kv_heads=8, head_size=head_size, dtype="bfloat16", block_size=16,
                         **{"window_sinks": dict(sliding_window=128, has_sinks=True),
                            "softcap": dict(logits_soft_cap=30.0), "window_small": dict(sliding_window=5)}[feature])
    check(spec, GPU_SHAPES, seed=head_size, pad_tokens=3)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("block_size", [32, 64])
def test_prefill_kernel_gpu_pages_and_fused_views(block_size):
    spec = AttentionSpec(num_heads=32, num_kv_heads=8, head_size=128, dtype="bfloat16", block_size=block_size)
    check(spec, GPU_SHAPES, seed=block_size, key_strided=True)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("config", [(64, 64, 4, 3, 4), (128, 64, 8, 3, 4), (128, 64, 8, 3, 2)], ids=str)
@pytest.mark.parametrize("feature", ["plain", "window_sinks", "softcap"])
def test_prefill_kernel_gpu_gqa_packed(head_size, config, feature):
    from attnbackends.triton.heuristics import PrefillConfig

    spec = AttentionSpec(num_heads=32, num_kv_heads=8, head_size=head_size, dtype="bfloat16", block_size=16,
                         **{"plain": {}, "window_sinks": dict(sliding_window=128, has_sinks=True),
                            "softcap": dict(logits_soft_cap=30.0)}[feature])
    check(spec, GPU_SHAPES, seed=head_size + config[0], pad_tokens=3, config=PrefillConfig(*config))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_prefill_kernel_gpu_overlapped_with_decodes():
    """overlap_decodes: the decodes' launch and the prefill kernel on two streams give the oracle's answer, bit for
    bit the same as one after the other, eagerly and replayed from a CUDA graph."""
    spec = AttentionSpec(num_heads=32, num_kv_heads=8, head_size=128, dtype="bfloat16", block_size=16)
    batch = make_random_batch(spec, GPU_SHAPES, seed=5, device=DEVICE, pad_tokens=3)
    impl = TritonAttentionBackend.get_impl_cls()(spec)
    outs = []
    for overlap in (False, True):
        builder = TritonAttentionBackend.get_builder_cls()(spec, DEVICE, prefill_kernel=True, overlap_decodes=overlap,
                                                           hopper_paged_prefill=False)
        meta = builder.build(batch.common)
        assert meta.prefill_split[0] is not None and meta.overlap_streams == overlap
        out = batch.new_output()
        out.fill_(float("nan"))
        impl.forward(batch.query, batch.key, batch.value, batch.kv_cache.clone(), meta, out)
        outs.append(out)
    n = batch.num_actual_tokens
    assert_close_to_oracle(outs[1][:n], oracle_attention(batch), tolerance_for(spec.torch_dtype), what="overlapped")
    assert torch.equal(outs[0][:n], outs[1][:n])
    cache = batch.kv_cache.clone()
    graph_out = batch.new_output()
    graph_out.fill_(float("nan"))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl.forward(batch.query, batch.key, batch.value, cache, meta, graph_out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_out[:n], outs[1][:n])


@pytest.mark.skipif(ON_GPU, reason="the GPU runs the kernel itself")
def test_default_config_compiles_for_sm90():
    """An offline sm_90 compile (no GPU): the default tiles fit shared memory and use wgmma at head 64 and 128,
    plain, with window + sinks, and with a soft-cap; no register spills, except the small one of head 128's
    one-warpgroup 64x64 tiles, which the H100 sweep measured fastest anyway."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-m", "benchmarks.prefill_compile_report", "--features"],
                         capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2], env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    reports = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert [r["head_size"] for r in reports] == [64] * 3 + [128] * 3
    for r in reports:
        measured_spill = r["head_size"] == 128 and not r["sliding_window"] and r["config"] == [64, 64, 4, 3, 1]
        assert r["stack"] <= (1024 if measured_spill else 0), r
        assert r["shared"] <= r["shared_limit"] and r["wgmma"], r
