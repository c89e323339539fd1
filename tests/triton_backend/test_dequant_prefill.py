"""Prefills over a cache with page scales on the 16-bit prefill kernels (attnbackends/triton/dequant_prefill.py,
kv_dequant.py), on the CPU.

The page dequantisation kernel (interpreted) against the torch read of the same pages, per format; the host
collection of the pages a batch's prefills read and their rewritten block-table rows against a plain Python oracle
(ragged batches, shared pages, requests without context, sequences ending mid-page, table entries past a request's
pages holding anything); the scratch's growth and bound; what the builder plans on a faked sm_90 device (the decodes
on the unified kernel over the quantised cache, the dequantisation, the paged Gluon kernel over the scratch; fresh
prompts too; the unified kernel above the bound, without a host block table, under CUDA-graph capture, turned off);
what ``explain`` says. End to end through ``forward`` (the unified kernel over the scratch standing in for the Gluon
kernel): tests/test_kv_formats.py.
"""

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from attnbackends import AttentionSpec, DeviceInfo, build_common_metadata  # noqa: E402
from attnbackends.ops.kv_cache_write import reshape_and_cache_torch  # noqa: E402
from attnbackends.ops.kv_layout import kv_page_layout  # noqa: E402
from attnbackends.platform import is_triton_interpreted  # noqa: E402
from attnbackends.reference.backend import ReferenceBackend  # noqa: E402
from attnbackends.triton import prefill_hopper_paged  # noqa: E402
from attnbackends.triton.backend import TritonAttentionBackend  # noqa: E402
from attnbackends.triton.choices import QuantisedPrefill  # noqa: E402
from attnbackends.triton.dequant_prefill import DequantScratch, collect_prefill_pages, default_max_pages  # noqa
from attnbackends.triton.kv_dequant import dequant_config, dequantise_pages, dequantise_pages_torch  # noqa: E402
from attnbackends.triton.step_plan import LaunchKind as K  # noqa: E402
from attnbackends.triton.step_plan import make_step_plan  # noqa: E402

FORMATS = ("fp8_per_token_head", "int8_per_token_head", "int4_per_token_head", "nvfp4")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_gluon = pytest.mark.skipif(not prefill_hopper_paged.gluon_available(), reason="needs triton.experimental.gluon")


def _spec(kv_cache_dtype, *, head_size=128, dtype="bfloat16", block_size=16, **kw):
    return AttentionSpec(num_heads=32, num_kv_heads=8, head_size=head_size, dtype=dtype,
                         kv_cache_dtype=kv_cache_dtype, block_size=block_size, **kw)


def _globals(kv_cache_dtype):
    return (0.01, 0.02) if kv_cache_dtype == "nvfp4" else (1.0, 1.0)


# ------------------------------------------------------------------------------------------ the dequantisation


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_dequant_kernel_reads_pages_like_torch(kv_cache_dtype, dtype):
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=32, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                         block_size=16)
    g = _globals(kv_cache_dtype)
    cache = ReferenceBackend.allocate_kv_cache(6, spec, DEVICE)
    gen = torch.Generator().manual_seed(1)
    k = (torch.randn(96, 2, 32, generator=gen) * 3).to(spec.torch_dtype).to(DEVICE)
    v = torch.randn(96, 2, 32, generator=gen).to(spec.torch_dtype).to(DEVICE)
    reshape_and_cache_torch(k, v, cache, torch.arange(96, device=DEVICE), k_scale=g[0], v_scale=g[1],
                            kv_format=spec.kv_cache_format)
    pages = torch.tensor([4, 1, 5, 0], dtype=torch.int32, device=DEVICE)
    out = torch.full((5, 2, 16, 2, 32), float("nan"), dtype=spec.torch_dtype, device=DEVICE)
    dequantise_pages(dequant_config(spec.kv_cache_format, 32, 16), cache[:, 0], cache[:, 1], pages, out, *g)
    layout = kv_page_layout(spec)
    read = dequantise_pages_torch(cache, layout, pages, torch.float32, *g)  # the exact read, float32
    assert torch.isnan(out[4]).all()  # only the P pages are written
    got = out[:4]
    if spec.torch_dtype == torch.bfloat16 and is_triton_interpreted():
        # the interpreter converts float32 to bfloat16 by truncation (numpy has no bfloat16); CUDA rounds to nearest
        want = (read.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
    else:
        want = read.to(spec.torch_dtype)
        assert torch.equal(want, dequantise_pages_torch(cache, layout, pages, spec.torch_dtype, *g))
    assert torch.equal(got, want)
    assert (read - torch.stack((k, v), 1).view(6, 16, 2, 2, 32).transpose(1, 2)[pages.long()].float()).abs().max() \
        < 3 * k.abs().max()  # it read the written keys, not zeros


def test_dequant_config_needs_page_scales_and_power_of_two_pages():
    with pytest.raises(ValueError, match="page scales"):
        dequant_config(_spec("fp8").kv_cache_format, 128, 16)
    with pytest.raises(ValueError, match="power-of-two"):
        dequant_config(_spec("int8_per_token_head").kv_cache_format, 128, 48)


# ------------------------------------------------------------------------------------------ page collection


def _oracle_pages(table, seq_lens, first, num_seqs, block_size):
    """The pages requests first .. num_seqs - 1 read (sorted, each once) and their rows in compact ids."""
    reads = []
    for i in range(first, num_seqs):
        n = -(-int(seq_lens[i]) // block_size)
        reads.append([int(table[i][j]) for j in range(n)])
    pages = sorted({p for row in reads for p in row})
    index = {p: i for i, p in enumerate(pages)}
    width = max([len(r) for r in reads] + [1])
    rows = [[index[p] for p in row] + [0] * (width - len(row)) for row in reads]
    return pages, rows


def _check_pages(table, seq_lens, first, num_seqs, block_size):
    host = collect_prefill_pages(np.asarray(table), np.asarray(seq_lens), first, num_seqs, block_size)
    pages, rows = _oracle_pages(table, seq_lens, first, num_seqs, block_size)
    assert host.pages.dtype == np.int32 and host.block_table.dtype == np.int32
    assert host.pages.tolist() == pages
    assert host.block_table.tolist() == rows
    return host


def test_collect_pages_of_a_ragged_batch_with_shared_pages():
    bs = 16
    table = [
        [7, 99, 99, 99],      # a decode (not collected)
        [3, 9, 4, -1],        # context and a chunk ending mid-page: 35 tokens, 3 pages
        [3, 9, 12, 13],       # shares its prefix pages with the request before: 64 tokens, exactly 4 pages
        [20, -5, 1000, 7],    # a fresh prompt of 5 tokens: one page (the entries after it hold anything)
        [8, 8, 8, 8],         # no tokens at all (seq_len 0): nothing
        [30, 2, 7, 7],        # 17 tokens: two pages, one of them the decode's page
    ]
    seq_lens = [40, 35, 64, 5, 0, 17]
    host = _check_pages(table, seq_lens, 1, 6, bs)
    assert host.pages.tolist() == [2, 3, 4, 9, 12, 13, 20, 30]
    assert host.block_table.shape == (5, 4)
    with pytest.raises(ValueError, match="page id -1"):
        collect_prefill_pages(np.asarray(table), np.asarray([40, 49, 64, 5, 0, 17]), 1, 6, bs)


@pytest.mark.parametrize("seed", range(6))
def test_collect_pages_against_the_oracle_on_random_batches(seed):
    rng = np.random.default_rng(seed)
    bs = int(rng.choice([16, 32]))
    num_seqs = int(rng.integers(1, 40))
    first = int(rng.integers(0, num_seqs))
    seq_lens = rng.integers(0, 300, num_seqs)
    seq_lens[rng.random(num_seqs) < 0.2] = 0
    width = int(-(-seq_lens.max() // bs)) + int(rng.integers(0, 3))
    num_blocks = int(rng.integers(8, 200))
    table = rng.integers(0, num_blocks, (num_seqs + int(rng.integers(0, 3)), max(width, 1)))
    _check_pages(table.tolist(), seq_lens.tolist(), first, num_seqs, bs)


def test_collect_pages_host_cost_is_vectorised():
    """Hundreds of requests on long contexts: collected in well under a step's time (no loop per page)."""
    import time

    rng = np.random.default_rng(0)
    seq_lens = rng.integers(1, 16384, 512)
    table = rng.integers(0, 200_000, (512, 1024)).astype(np.int32)
    collect_prefill_pages(table, seq_lens, 0, 512, 16)
    start = time.perf_counter()
    host = collect_prefill_pages(table, seq_lens, 0, 512, 16)
    assert time.perf_counter() - start < 0.25
    assert host.pages.size == np.unique(np.concatenate(
        [table[i, :-(-seq_lens[i] // 16)] for i in range(512)])).size


def test_scratch_grows_on_demand_up_to_its_bound():
    scratch = DequantScratch(10, 16, 2, 32, torch.float16, torch.device("cpu"))
    assert scratch.capacity == 0
    a = scratch.view(3)
    assert tuple(a.shape) == (3, 2, 16, 2, 32) and scratch.capacity == 3
    b = scratch.view(4)
    assert scratch.capacity == 6 and b.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
    assert scratch.view(6).data_ptr() == b.data_ptr()  # no regrowth within the capacity
    assert scratch.view(10).shape[0] == 10 and scratch.capacity == 10  # bounded
    assert scratch.view(11) is None
    assert default_max_pages(16) == 16384 and default_max_pages(64) == 4096


# ------------------------------------------------------------------------------------------ what the builder plans


def _common(shapes, block_size=16, host_table=True):
    tables, at = [], 0
    for q, c in shapes:
        n = -(-(q + c) // block_size)
        tables.append(list(range(at, at + n)))
        at += n
    common = build_common_metadata([q for q, _ in shapes], [c for _, c in shapes], tables, block_size, "cpu")
    if not host_table:
        import dataclasses

        common = dataclasses.replace(common, block_table_cpu=None)
    return common


def _builder(spec, **kw):
    return TritonAttentionBackend.get_builder_cls()(spec, "cpu", **{"max_num_tokens": 32768, **kw})


@needs_gluon
@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_builder_plans_dequantised_pages_for_the_paged_gluon_kernel(kv_cache_dtype, fake_h100):
    spec = _spec(kv_cache_dtype)
    builder = _builder(spec)
    assert builder.choices.quantised_prefill.kernel is QuantisedPrefill.DEQUANTISED_GLUON_PAGED
    md = builder.build(_common([(1, 40), (1, 7), (512, 3584), (100, 0)]))
    step = md.step
    assert step.new_kv_rows is None  # no split reads the forward's unquantised keys
    assert step.paged_new_kv.kinds() == (K.CACHE_WRITE, K.ATTENTION, K.DEQUANT_PAGES, K.GLUON_PAGED_PREFILL_SCRATCH)
    assert step.paged_no_new_kv.kinds() == (K.ATTENTION, K.DEQUANT_PAGES, K.GLUON_PAGED_PREFILL_SCRATCH)
    pages = md.dequant_prefill
    assert pages is step.dequant and pages.first_seq == 2
    assert pages.pages.tolist() == list(range(4, 4 + 256 + 7))  # the chunk's 256 pages and the prompt's 7
    assert tuple(pages.scratch.shape) == (263, 2, 16, 8, 128) and pages.scratch.dtype == torch.bfloat16
    assert pages.block_table[2, :256].tolist() == list(range(256))
    assert pages.block_table[3, :7].tolist() == list(range(256, 263))
    decode, prefill = md.paged_prefill
    assert decode.num_seqs == 2 and prefill.first_seq == 2 and prefill.num_seqs == 2
    fresh = builder.build(_common([(300, 0), (200, 0)])).step  # fresh prompts read the scratch too
    assert fresh.new_kv_rows is None
    assert fresh.paged_new_kv.kinds() == (K.CACHE_WRITE, K.DEQUANT_PAGES, K.GLUON_PAGED_PREFILL_SCRATCH)
    assert builder.build(_common([(1, 40), (1, 9)])).dequant_prefill is None  # decodes only


@needs_gluon
def test_program_for_takes_the_scratch_programs_for_any_quantised_cache(fake_h100):
    spec = _spec("int4_per_token_head")
    md = _builder(spec).build(_common([(1, 40), (64, 100)]))
    n = md.common.num_actual_tokens
    q = torch.randn(n, 32, 128).bfloat16()
    kv = torch.randn(n, 8, 128).bfloat16()
    cache = ReferenceBackend.allocate_kv_cache(16, spec)  # not contiguous (scales in the pages): still taken
    step = md.step
    slots = md.common.slot_mapping
    assert step.program_for(q, kv, kv, q.clone(), cache, slots) is step.paged_new_kv
    assert step.program_for(q, None, None, q.clone(), cache, slots) is step.paged_no_new_kv
    rows = torch.randn(n, 32, 130).bfloat16()[..., :128]  # rows the TMA views do not take: the unified kernel
    assert step.program_for(rows, kv, kv, q.clone(), cache, slots) is step.new_kv
    assert step.program_for(rows, None, None, q.clone(), cache, slots) is step.no_new_kv


@needs_gluon
def test_the_unified_kernel_reads_the_quantised_pages_where_dequantising_does_not_apply(fake_h100):
    spec = _spec("nvfp4")
    common = _common([(1, 40), (64, 100), (30, 0)])  # 1 + 11 + 2 = 14 pages; the prefills read 13
    assert _builder(spec, dequant_prefill_max_pages=13).build(common).dequant_prefill.num_pages == 13
    for builder in (_builder(spec, dequant_prefill_max_pages=12), _builder(spec, dequant_prefill_max_pages=0)):
        md = builder.build(common)  # above the bound
        assert md.dequant_prefill is None and md.paged_prefill is None
        assert md.step.new_kv.kinds() == (K.CACHE_WRITE, K.ATTENTION)
    builder = _builder(spec)
    assert builder.build(_common([(64, 100)], host_table=False)).dequant_prefill is None  # no host table
    captured = builder.build_for_cudagraph_capture(common)  # a graph replays any batch of the shape: unified
    assert captured.dequant_prefill is None and captured.paged_prefill is None
    off = _builder(spec, dequant_prefill=False)
    assert off.choices.quantised_prefill.kernel is QuantisedPrefill.UNIFIED
    assert "dequant_prefill=False" in off.choices.quantised_prefill.reason
    assert off.dequant_scratch is None and off.build(common).dequant_prefill is None
    for kw in (dict(hopper_paged_prefill=False), dict(prefill_kernel=False), dict(deterministic=True)):
        choice = _builder(spec, **kw).choices.quantised_prefill
        assert choice.kernel is QuantisedPrefill.UNIFIED and "paged Gluon Hopper kernel" in choice.reason
    with pytest.raises(ValueError, match="dequant_prefill_max_pages"):
        _builder(spec, dequant_prefill_max_pages=-1)
    assert _builder(_spec("auto")).choices.quantised_prefill.kernel is QuantisedPrefill.NOT_QUANTISED
    assert _builder(_spec("fp8")).choices.quantised_prefill.kernel is QuantisedPrefill.NOT_QUANTISED


def test_off_the_hopper_only_when_asked():
    spec = _spec("int8_per_token_head")
    choice = _builder(spec).choices.quantised_prefill
    assert choice.kernel is QuantisedPrefill.UNIFIED and "does not serve the layer" in choice.reason
    asked = _builder(spec, dequant_prefill=True)
    assert asked.choices.quantised_prefill.kernel is QuantisedPrefill.DEQUANTISED_UNIFIED
    md = asked.build(_common([(1, 40), (64, 100)]))
    assert md.step.paged_new_kv.kinds() == (K.CACHE_WRITE, K.ATTENTION, K.DEQUANT_PAGES, K.ATTENTION_SCRATCH)
    odd = _builder(_spec("int8_per_token_head", block_size=48), dequant_prefill=True).choices.quantised_prefill
    assert odd.kernel is QuantisedPrefill.UNIFIED and "block_size 48" in odd.reason


def test_make_step_plan_takes_dequant_only_with_its_paged_prefill():
    spec = _spec("int8_per_token_head")
    md = _builder(spec, dequant_prefill=True).build(_common([(1, 40), (64, 100)]))
    attention = md.plan
    pages = md.dequant_prefill
    with pytest.raises(ValueError, match="goes with the paged prefill"):
        make_step_plan(attention, dequant=(pages, K.ATTENTION_SCRATCH))
    with pytest.raises(ValueError, match="scratch prefill kind"):
        make_step_plan(attention, paged=md.paged_prefill, dequant=(pages, K.GLUON_PAGED_PREFILL))


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_explain_says_which_path_a_quantised_layers_prefills_take(kv_cache_dtype):
    spec = _spec(kv_cache_dtype)
    h100 = TritonAttentionBackend.kernel_notes(spec, DeviceInfo.cuda(9, 0))[0]
    if prefill_hopper_paged.gluon_available():
        assert "dequantised into a bfloat16 scratch" in h100 and "paged Gluon Hopper kernel" in h100
        assert f"at most {default_max_pages(16)} pages" in h100 and "CUDA graph" in h100
    a100 = TritonAttentionBackend.kernel_notes(spec, DeviceInfo.cuda(8, 0))[0]
    assert "unified kernel, reading" in a100 and kv_cache_dtype in a100 and "9.0" in a100
