"""MLA with page ids outside the cache: the Triton decode kernels (pointer and TMA) and the context gather of the
prefill read page 0 in their place, never outside the cache, and a device-only block table's bad entry is a
PageTableError at the next check point (CPU: interpreted kernels at tiny shapes; GPU: the same on a CUDA table with
no host copy, the CUDA context usable afterwards)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from attnbackends.mla.backends import TritonMLABackend  # noqa: E402
from attnbackends.ops.mla_cache import gather_mla_cache  # noqa: E402
from attnbackends.mla.decode_kernel import MLADecodeConfig, tma_decode_applies  # noqa: E402
from attnbackends.mla.decode_launch import mla_decode  # noqa: E402
from attnbackends.testing.mla import make_random_mla_batch, run_mla_backend  # noqa: E402
from attnbackends.ops import page_guard  # noqa: E402
from attnbackends.ops.page_guard import PageTableError, raise_pending_faults  # noqa: E402
from attnbackends.ops.quant import dequantize_from_cache  # noqa: E402
from attnbackends.spec import AttentionSpec  # noqa: E402
from attnbackends.testing import SequenceShape as S  # noqa: E402
from attnbackends.testing.run_ahead import put_host_ahead  # noqa: E402

L, R, BS, NUM_BLOCKS, PAD = 64, 16, 16, 8, 2


def _poisoned_cache(gen, dtype=torch.bfloat16, device="cpu"):
    """A [NUM_BLOCKS, BS, L + R] cache of random values inside a buffer whose PAD pages on either side are NaN:
    a read outside the cache (page -PAD .. NUM_BLOCKS + PAD - 1) brings NaN into the output."""
    buf = torch.full((NUM_BLOCKS + 2 * PAD, BS, L + R), float("nan"), dtype=dtype)
    buf[PAD : PAD + NUM_BLOCKS] = (torch.randn(NUM_BLOCKS, BS, L + R, generator=gen) * 3).to(dtype)
    return buf.to(device)[PAD : PAD + NUM_BLOCKS]


def _clear_faults(device):
    try:
        raise_pending_faults(device)
    except PageTableError:
        pass


def _decode(q_nope, q_pe, cache, table, seq_lens, num_splits, config):
    out = torch.full(q_nope.shape, float("nan"), dtype=q_nope.dtype, device=q_nope.device)
    lse = torch.full(q_nope.shape[:2], float("nan"), device=q_nope.device)
    mla_decode(q_nope, q_pe, cache, table, seq_lens, out, scale=0.1, num_splits=num_splits, lse=lse, config=config)
    return out, lse


@pytest.mark.parametrize("use_tma", [False, True], ids=["pointer", "tma"])
@pytest.mark.parametrize("bad_page", [NUM_BLOCKS, NUM_BLOCKS + 1, -1, -PAD])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_kernels_read_page_zero_for_a_page_outside_the_cache(use_tma, bad_page, num_splits):
    g = torch.Generator().manual_seed(3)
    cache = _poisoned_cache(g)
    seq_lens = torch.tensor([40, 23], dtype=torch.int32)  # whole tiles and a partial last tile in each request
    good = torch.tensor([[5, 2, 7], [1, 6, 0]], dtype=torch.int32)
    bad = good.clone()
    bad[0, 1] = bad_page  # a whole tile (TMA path)
    bad[1, 1] = bad_page  # the partial last tile (pointer loads in the TMA kernel)
    q_nope = torch.randn(2, 4, L, generator=g).bfloat16()
    q_pe = torch.randn(2, 4, R, generator=g).bfloat16()
    config = MLADecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=1, use_tma=use_tma)
    assert tma_decode_applies(q_nope, q_pe, cache, config) == use_tma
    out, lse = _decode(q_nope, q_pe, cache, bad, seq_lens, num_splits, config)
    assert torch.isfinite(out.float()).all() and torch.isfinite(lse).all()
    substituted = torch.where((bad >= 0) & (bad < NUM_BLOCKS), bad, 0)
    want_out, want_lse = _decode(q_nope, q_pe, cache, substituted, seq_lens, num_splits, config)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    good_out, _ = _decode(q_nope, q_pe, cache, good, seq_lens, num_splits, config)
    assert not torch.equal(out, good_out)  # page 0 really stood in for page 2 / 6


@pytest.mark.parametrize("cache_dtype, out_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float8_e4m3fn,
                                                                                      torch.bfloat16),
                                                     (torch.float8_e5m2, torch.float16)])
def test_context_gather_reads_page_zero_for_a_slot_outside_the_cache(cache_dtype, out_dtype):
    """The gather equals the torch read of the same slots (dequantised like dequantize_from_cache, bit for bit),
    with page 0 at the same offset in place of a page outside the cache."""
    g = torch.Generator().manual_seed(4)
    cache = _poisoned_cache(g, torch.float32).to(cache_dtype)
    num_slots = NUM_BLOCKS * BS
    slots = torch.tensor([3, num_slots, 17, -1, num_slots + BS + 5, -PAD * BS, 100, 127], dtype=torch.int64)
    out = torch.full((len(slots) + 2, L + R), float("nan"), dtype=out_dtype)
    got = gather_mla_cache(cache, slots, out, k_scale=0.0137)
    assert got.data_ptr() == out.data_ptr() and got.shape[0] == len(slots)
    read = torch.where((slots >= 0) & (slots < num_slots), slots, slots.remainder(BS))
    want = dequantize_from_cache(cache.view(-1, L + R)[read], out_dtype, 0.0137)
    assert torch.equal(got, want)
    assert torch.isnan(out[len(slots):].float()).all()


def _spec():
    return AttentionSpec.mla(4, kv_lora_rank=L, qk_nope_head_dim=16, qk_rope_head_dim=R, v_head_dim=16,
                             dtype="bfloat16", block_size=BS)


def _device_only(batch, monkeypatch=None):
    """Drop the batch's host block table; on the CPU also make the guard treat the CPU table as device-only."""
    batch.common.block_table_cpu = None
    if monkeypatch is not None:
        monkeypatch.setattr(page_guard, "_host_table", lambda common: None)


# two decodes, then a prefill whose cached context runs through the context gather
SHAPES = [S(1, 40), S(1, 20), S(4, 35)]
BAD = [(0, 1), (2, 1)]  # a decode's page, a context page of the prefill


@pytest.mark.parametrize("req, col", BAD)
@pytest.mark.parametrize("bad_page", [1 << 20, -3])
def test_triton_mla_device_table_fault_is_contained_and_raised_at_the_next_check_point(monkeypatch, req, col,
                                                                                     bad_page):
    _clear_faults("cpu")
    batch = make_random_mla_batch(_spec(), SHAPES, seed=5)
    _device_only(batch, monkeypatch)
    bad = batch.common.block_table.clone()
    bad[req, col] = bad_page
    batch.common.block_table = bad
    # bad pages must not be read: the scan sees them, the kernels replace them by page 0 (a huge id past the
    # interpreter's memory would crash this process)
    out, _ = run_mla_backend(TritonMLABackend, batch, builder_kwargs=dict(prefill_backend="triton"))
    n = batch.num_actual_tokens
    assert torch.isfinite(out[:n].float()).all()
    with pytest.raises(PageTableError, match=rf"block_table\[{req}, {col}\] = {bad_page} is outside .*"
                                             rf"\(request {req}, block-table slot {col}\)"):
        raise_pending_faults("cpu")
    raise_pending_faults("cpu")  # raised once


def test_triton_mla_substitutes_page_zero(monkeypatch):
    """The contained step computes what a table with page 0 in the bad entry's place gives."""
    _clear_faults("cpu")
    outs = []
    for page in (1 << 20, 0):
        batch = make_random_mla_batch(_spec(), SHAPES, seed=6)
        _device_only(batch, monkeypatch)
        table = batch.common.block_table.clone()
        for req, col in BAD:
            table[req, col] = page
        batch.common.block_table = table
        outs.append(run_mla_backend(TritonMLABackend, batch, builder_kwargs=dict(prefill_backend="triton"))[0])
        _clear_faults("cpu")
    n = batch.num_actual_tokens
    assert torch.equal(outs[0][:n], outs[1][:n])


@pytest.mark.gpu
@pytest.mark.parametrize("req, col", BAD)
@pytest.mark.parametrize("prefill_backend", ["triton", "auto"])
def test_triton_mla_cuda_table_without_host_copy(req, col, prefill_backend):
    """A CUDA block table and no host copy: no illegal memory access, the error at the next check point, and the
    CUDA context still works."""
    spec = AttentionSpec.mla(16, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                             dtype="bfloat16", block_size=64)
    shapes = [S(1, 700), S(1, 90), S(40, 300)]
    batch = make_random_mla_batch(spec, shapes, seed=7, device="cuda")
    _device_only(batch)
    batch.common.block_table[req, col] = 1 << 24
    out, _ = run_mla_backend(TritonMLABackend, batch, builder_kwargs=dict(prefill_backend=prefill_backend))
    torch.cuda.synchronize()
    n = batch.num_actual_tokens
    assert torch.isfinite(out[:n].float()).all()
    with pytest.raises(PageTableError, match=rf"block_table\[{req}, {col}\] = {1 << 24}"):
        raise_pending_faults("cuda")
    x = torch.randn(64, 64, device="cuda")
    assert torch.isfinite(x @ x).all()  # the CUDA context is usable
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("req, col", [(0, 1), (1, 0)])
def test_flashinfer_mla_cuda_table_without_host_copy(req, col):
    """FlashInfer MLA decode over a CUDA block table with no host copy and a page id outside the cache: its planned
    page ids are contained (page 0 read instead: the output equals the run with page 0 in that entry), the error
    comes at the next check point, and the CUDA context still works. Each step runs behind a GPU stall, so the
    fault its build() records is not yet visible when its forward checks."""
    from attnbackends.compat import flashinfer_installed
    from attnbackends.mla.backends import FlashInferMLABackend

    if not flashinfer_installed():
        pytest.skip("flashinfer is not installed")
    spec = AttentionSpec.mla(16, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                             dtype="bfloat16", block_size=64)
    shapes = [S(1, 700), S(1, 90)]
    outs = []
    for page in (1 << 24, 0):
        batch = make_random_mla_batch(spec, shapes, seed=8, device="cuda")
        _device_only(batch)
        batch.common.block_table[req, col] = page
        put_host_ahead("cuda")
        out, _ = run_mla_backend(FlashInferMLABackend, batch)
        torch.cuda.synchronize()
        outs.append(out[: batch.num_actual_tokens])
        if page:
            with pytest.raises(PageTableError, match=rf"block_table\[{req}, {col}\] = {page}"):
                raise_pending_faults("cuda")
    assert torch.isfinite(outs[0].float()).all()
    assert torch.equal(outs[0], outs[1])
    x = torch.randn(64, 64, device="cuda")
    assert torch.isfinite(x @ x).all()  # the CUDA context is usable
    torch.cuda.synchronize()
