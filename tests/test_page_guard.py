"""Out-of-range page ids and slots: a clear PageTableError naming request, slot and page id, never a crash or a
silently wrong result (CPU: reference and interpreted Triton; GPU: the device scan and the kernels' containment)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from attnbackends import AttentionSpec  # noqa: E402
from attnbackends.metadata import build_common_metadata  # noqa: E402
from attnbackends.ops.kv_cache_write import reshape_and_cache  # noqa: E402
from attnbackends.ops import page_guard  # noqa: E402
from attnbackends.ops.page_guard import (  # noqa: E402
    PageTableError, _scan_block_table_kernel, contain_page_ids, fault_record, guard_block_table, raise_pending_faults,
)
from attnbackends.reference.backend import ReferenceBackend  # noqa: E402
from attnbackends.triton.backend import TritonAttentionBackend  # noqa: E402
from attnbackends.triton.launch import unified_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = 16
NUM_BLOCKS = 8
SPEC = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=32, dtype="float16", block_size=BLOCK)


def _batch(tables, query_lens=(1, 5), context_lens=(20, 3), device=DEVICE):
    common = build_common_metadata(list(query_lens), list(context_lens), tables, BLOCK, device)
    n = common.num_actual_tokens
    g = torch.Generator().manual_seed(0)
    q = torch.randn(n, 4, 32, generator=g).half().to(device)
    k = torch.randn(n, 2, 32, generator=g).half().to(device)
    v = torch.randn(n, 2, 32, generator=g).half().to(device)
    cache = torch.randn(NUM_BLOCKS, 2, BLOCK, 2, 32, generator=g).half().to(device)
    return common, q, k, v, cache


@pytest.mark.parametrize("backend", [ReferenceBackend, TritonAttentionBackend], ids=lambda b: b.name)
@pytest.mark.parametrize("bad_page", [99, NUM_BLOCKS, -1, -7])
@pytest.mark.parametrize("host_copy", [True, False], ids=["host-table", "device-table-only"])
@pytest.mark.parametrize("num_blocks", [None, NUM_BLOCKS], ids=["forward-checks", "build-checks"])
def test_a_page_outside_the_cache_is_rejected(backend, bad_page, host_copy, num_blocks):
    """By ``build`` where the builder knows the cache's page count, else by ``forward``."""
    common, q, k, v, cache = _batch([[3, 4], [5]])
    # a page id rewritten in place after the metadata was built (build_common_metadata refuses a negative one)
    common.block_table[0, 1] = bad_page
    common.block_table_cpu[0, 1] = bad_page
    if not host_copy:
        common.block_table_cpu = None
    builder = backend.get_builder_cls()(SPEC, DEVICE, num_blocks=num_blocks)
    impl = backend.get_impl_cls()(SPEC)
    out = torch.full_like(q, float("nan"))
    with pytest.raises(PageTableError, match=rf"block_table\[0, 1\] = {bad_page} is outside .*\(request 0, block-table slot 1\)"):
        metadata = builder.build(common)
        if num_blocks is not None:
            if DEVICE == "cuda":
                torch.cuda.synchronize()  # a device-only table: build() recorded the fault without a sync
            raise_pending_faults(DEVICE)  # build() checked: raised now (host) or recorded (device-only table)
            pytest.fail("build() with num_blocks let a bad page id through")
        impl.forward(q, k, v, cache, metadata, out)
        raise_pending_faults(DEVICE)  # device-only table on a GPU: reported at the next check point


def test_unused_block_table_entries_are_not_checked():
    """Columns past a request's pages may hold anything (engines pad rows with -1 or stale ids)."""
    common, q, k, v, cache = _batch([[3, 4, -1, 12345], [5, 99]])
    guard_block_table(common, NUM_BLOCKS, BLOCK)


def test_the_guard_reads_the_table_every_time_and_writes_nothing_to_the_batch():
    """An engine's persistent batch rewritten in place is checked again: the guard keeps no memo on it."""
    common, *_ = _batch([[3, 4], [5]])
    before = dict(vars(common))
    guard_block_table(common, NUM_BLOCKS, BLOCK)
    assert vars(common) == before and all(vars(common)[k] is v for k, v in before.items())
    common.block_table_cpu[0, 0] = 99
    with pytest.raises(PageTableError, match=r"block_table\[0, 0\] = 99"):
        guard_block_table(common, NUM_BLOCKS, BLOCK)


def test_device_scan_records_the_first_bad_entry_and_is_raised_once():
    """The scan kernel that guards engines without a host block table (interpreted on the CPU)."""
    common, *_ = _batch([[3, 4], [5, 6, 7, 1]], query_lens=(1, 3), context_lens=(20, 60))
    table = common.block_table.clone()
    table[1, 2] = 1000
    table[1, 3] = -3
    rec = fault_record(table.device)
    _scan_block_table_kernel[(2,)](table, table.stride(0), common.seq_lens, NUM_BLOCKS, BLOCK, rec.record,
                                   rec.host_flag, BLOCK=4)
    with pytest.raises(PageTableError, match=r"block_table\[1, 2\] = 1000 is outside .*\(request 1, block-table slot 2\)"):
        raise_pending_faults(table.device)
    raise_pending_faults(table.device)  # cleared: nothing pending


def test_kv_write_skips_and_reports_a_slot_outside_the_cache():
    common, q, k, v, cache = _batch([[3, 4], [5]])
    before = cache.clone()
    slots = common.slot_mapping.clone()
    slots[2] = NUM_BLOCKS * BLOCK + 5
    with pytest.raises(PageTableError, match=rf"slot_mapping\[2\] = {NUM_BLOCKS * BLOCK + 5}"):
        reshape_and_cache(k, v, cache, slots)
        raise_pending_faults(DEVICE)
    blk, off = int(slots[2]) // BLOCK, int(slots[2]) % BLOCK
    written = torch.zeros(NUM_BLOCKS * BLOCK, dtype=torch.bool)
    good = [int(s) for i, s in enumerate(slots.tolist()) if i != 2 and s >= 0]
    written[good] = True
    untouched = ~written.view(NUM_BLOCKS, BLOCK)
    assert torch.equal(cache.permute(0, 2, 1, 3, 4)[untouched.to(cache.device)],
                       before.permute(0, 2, 1, 3, 4)[untouched.to(cache.device)])
    assert blk >= NUM_BLOCKS and off >= 0


def test_kernel_never_reads_outside_the_cache():
    """Containment without the guard: the functional launcher with a bad page id attends page 0 instead."""
    common, q, k, v, cache = _batch([[3, 99], [5]])
    out_bad = torch.full_like(q, float("nan"))
    unified_attention(q, cache[:, 0], cache[:, 1], out_bad, common.query_start_loc, common.seq_lens,
                      common.block_table, common.max_query_len, common.max_seq_len, SPEC.softmax_scale)
    table = common.block_table.clone()
    table[0, 1] = 0
    out_page0 = torch.full_like(q, float("nan"))
    unified_attention(q, cache[:, 0], cache[:, 1], out_page0, common.query_start_loc, common.seq_lens, table,
                      common.max_query_len, common.max_seq_len, SPEC.softmax_scale)
    assert torch.equal(out_bad, out_page0)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_contain_page_ids_puts_page_zero_in_place_of_ids_outside_the_cache(dtype, impl, monkeypatch):
    if impl == "torch":
        monkeypatch.setattr(page_guard, "is_triton_interpreted", lambda: False)
    ids = torch.tensor([3, NUM_BLOCKS, 7, -1, 0, 1 << 30, NUM_BLOCKS - 1, -(1 << 20)] * 300, dtype=dtype)
    want = torch.where((ids >= 0) & (ids < NUM_BLOCKS), ids, 0)
    assert contain_page_ids(ids, NUM_BLOCKS) is ids
    assert torch.equal(ids, want)
    assert contain_page_ids(ids[:0], NUM_BLOCKS).numel() == 0


@pytest.mark.gpu
def test_device_table_fault_is_raised_at_the_next_step_on_gpu():
    """No host copy on a GPU: no sync in the step, the error at the next check point, the CUDA context intact."""
    tables = [[3, 1 << 20], [5]]
    common, q, k, v, cache = _batch(tables, device="cuda")
    common.block_table_cpu = None
    builder = TritonAttentionBackend.get_builder_cls()(SPEC, "cuda")
    impl = TritonAttentionBackend.get_impl_cls()(SPEC)
    out = torch.full_like(q, float("nan"))
    impl.forward(q, k, v, cache, builder.build(common), out)
    torch.cuda.synchronize()
    with pytest.raises(PageTableError, match=r"block_table\[0, 1\] = 1048576"):
        raise_pending_faults("cuda")
    good, q, k, v, cache = _batch([[3, 4], [5]], device="cuda")
    impl.forward(q, k, v, cache, builder.build(good), out)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
