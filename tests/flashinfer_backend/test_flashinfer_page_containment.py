"""FlashInfer with page ids outside the cache: the page ids FlashInfer reads are contained (page 0 in their place)
and the bad entry is a PageTableError at the next check point.

CPU: the page-id kernels (interpreted) and the whole adapter through the stand-in `flashinfer` of
test_flashinfer_cpu.py, with the guard made to treat the CPU table as device-only. GPU (`pytest -m gpu`): a CUDA
block table with no host copy through the real FlashInfer, the CUDA context usable afterwards.
"""

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.flashinfer_backend.test_flashinfer_cpu import fake_flashinfer  # noqa: E402,F401 (fixture)

from attnbackends import AttentionSpec  # noqa: E402
from attnbackends.flashinfer import CascadePolicy, FlashInferBackend, FlashInferMetadataBuilder  # noqa: E402
from attnbackends.ops.flashinfer import page_ids  # noqa: E402
from attnbackends.compat import flashinfer_installed  # noqa: E402
from attnbackends.ops.flashinfer.plan_inputs import paged_kv_plan_inputs  # noqa: E402
from attnbackends.metadata import build_common_metadata  # noqa: E402
from attnbackends.ops import page_guard  # noqa: E402
from attnbackends.ops.page_guard import PageTableError, raise_pending_faults  # noqa: E402
from attnbackends.testing import SequenceShape as S  # noqa: E402
from attnbackends.testing import make_random_batch  # noqa: E402
from attnbackends.testing.run_ahead import STALL_CYCLES, put_host_ahead  # noqa: E402

NUM_BLOCKS = 40
SPEC = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=64, dtype="float16", block_size=16)


def _clear_faults(device):
    try:
        raise_pending_faults(device)
    except PageTableError:
        pass


def _contained(table, num_blocks=NUM_BLOCKS):
    return torch.where((table >= 0) & (table < num_blocks), table, torch.zeros_like(table))


# -- the page-id kernels --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("skip", [0, 2])
@pytest.mark.parametrize("bad_page", [NUM_BLOCKS, 1 << 30, -1])
def test_gather_page_ids_contains_and_records(impl, skip, bad_page, monkeypatch):
    if impl == "torch":
        monkeypatch.setattr(page_ids, "is_triton_interpreted", lambda: False)
    _clear_faults("cpu")
    gen = torch.Generator().manual_seed(skip)
    table = torch.randperm(NUM_BLOCKS, generator=gen)[:24].view(3, 8).int()
    counts = torch.tensor([3, 5, 4])
    table[1, skip + 3] = bad_page
    table[2, 7] = -5  # past request 2's pages: never read
    indptr = torch.zeros(4, dtype=torch.int32)
    indptr[1:] = counts.cumsum(0)
    out = torch.full((int(indptr[-1]),), -7, dtype=torch.int32)
    page_ids.gather_page_ids(table, indptr, out, skip_pages=skip, num_blocks=NUM_BLOCKS)
    want = [p for r, n in enumerate(counts.tolist()) for p in _contained(table)[r, skip : skip + n].tolist()]
    assert out.tolist() == want
    if impl == "triton":  # the torch path runs on host tables, which the guard checks before any kernel
        with pytest.raises(PageTableError, match=rf"block_table\[1, {skip + 3}\] = {bad_page} is outside"):
            raise_pending_faults("cpu")
    raise_pending_faults("cpu")
    page_ids.gather_page_ids(table, indptr, out, skip_pages=skip)  # without num_blocks: copied as they are
    assert bad_page in out.tolist()
    raise_pending_faults("cpu")  # and nothing recorded


@pytest.mark.parametrize("bad_page", [NUM_BLOCKS + 3, -2])
def test_decode_page_table_contains_and_records(bad_page):
    _clear_faults("cpu")
    common = build_common_metadata([1, 1, 1], [20, 49, 3], [[4, 9], [1, 2, 3, 5], [7]], 16)
    table = common.block_table.clone()
    table[1, 2] = bad_page
    kv_indptr, last = torch.full((4,), -3, dtype=torch.int32), torch.full((3,), -3, dtype=torch.int32)
    kv_indices = torch.full((7,), -3, dtype=torch.int32)
    page_ids.decode_page_table(common.seq_lens, table, 16, kv_indptr, last, kv_indices, num_blocks=NUM_BLOCKS)
    assert kv_indices.tolist() == [4, 9, 1, 2, 0, 5, 7]
    with pytest.raises(PageTableError, match=rf"block_table\[1, 2\] = {bad_page} is outside .*\(request 1, "
                                             r"block-table slot 2\)"):
        raise_pending_faults("cpu")


def test_host_gathered_page_ids_are_contained_when_num_blocks_is_given():
    common = build_common_metadata([1, 4], [20, 3], [[4, 99], [5]], 16)
    common.block_table[1, 0] = -1  # rewritten in place after the build (build_common_metadata refuses it)
    p = paged_kv_plan_inputs(common.query_start_loc_cpu, common.seq_lens_cpu, common.block_table, 16,
                             num_blocks=NUM_BLOCKS)
    assert p.kv_indices.tolist() == [4, 0, 0]
    p = paged_kv_plan_inputs(common.query_start_loc_cpu, common.seq_lens_cpu, common.block_table, 16)
    assert p.kv_indices.tolist() == [4, 99, -1]


# -- the adapter through the stand-in ------------------------------------------------------------------------------
MIXED = [S(1, 20), S(1, 47), S(6, 30), S(3, 0)]
BAD = ((1, 1), (2, 0))  # a decode's page, a prefill's context page


def _device_only(monkeypatch, common):
    """The guard and the builder treat this CPU batch as one whose block table lives on the device alone."""
    monkeypatch.setattr(page_guard, "_host_table", lambda c: None)
    common.block_table_cpu = None
    return common


def _batch(seed, shapes=MIXED, bad=BAD, page=1 << 20):
    batch = make_random_batch(SPEC, shapes, seed=seed, num_blocks=NUM_BLOCKS)
    table = batch.common.block_table.clone()
    for r, c in bad:
        table[r, c] = page
    batch.common.block_table = batch.common.block_table_cpu = table
    return batch


def _forward(builder, batch, build=None):
    """One step; the cache already holds the new tokens' keys and values (interpreted KV writes raise a recorded
    fault at once, which would end the step before attention)."""
    meta = (build or builder.build)(batch.common)
    impl = FlashInferBackend.get_impl_cls()(SPEC)
    out = batch.new_output()
    impl.forward(batch.query, None, None, batch.kv_cache.clone(), meta, out)
    return meta, out


def _fields(meta):
    """Every field of the metadata and of its plan (tensors and wrappers by identity)."""
    return {**vars(meta), **{f"plan.{k}": v for k, v in vars(meta.plan).items()}}


def test_without_num_blocks_every_forward_contains_and_nothing_is_learned(fake_flashinfer, monkeypatch):
    _clear_faults("cpu")
    builder = FlashInferMetadataBuilder(SPEC, "cpu", workspace_bytes=1024)
    batch = _batch(1)
    table = batch.common.block_table.clone()
    meta = builder.build(_device_only(monkeypatch, batch.common))
    assert meta.origin.num_blocks is None and len(meta.plan.uncontained_page_ids) == 1
    before = _fields(meta)
    impl = FlashInferBackend.get_impl_cls()(SPEC)
    out = batch.new_output()
    impl.forward(batch.query, None, None, batch.kv_cache.clone(), meta, out)
    after = _fields(meta)
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before), "forward wrote the metadata"
    assert torch.equal(batch.common.block_table, table), "containment must not write the engine's block table"
    with pytest.raises(PageTableError, match=r"block_table\[1, 1\] = 1048576 is outside"):
        raise_pending_faults("cpu")
    n = batch.num_actual_tokens
    substituted = _batch(1, page=0)
    _, want = _forward(FlashInferMetadataBuilder(SPEC, "cpu", workspace_bytes=1024), substituted)
    assert torch.equal(out[:n], want[:n])

    later = _batch(2, bad=((0, 1),), page=-4)
    meta2, out2 = _forward(builder, _device_only(monkeypatch, later))
    assert builder.num_blocks is None and len(meta2.plan.uncontained_page_ids) == 1  # nothing learned
    assert torch.isfinite(out2[:n].float()).all()
    with pytest.raises(PageTableError, match=r"block_table\[0, 1\] = -4 is outside"):
        raise_pending_faults("cpu")
    _clear_faults("cpu")


def test_num_blocks_given_contains_in_build(fake_flashinfer, monkeypatch):
    _clear_faults("cpu")
    with pytest.raises(ValueError, match="num_blocks must be None or a positive int"):
        FlashInferMetadataBuilder(SPEC, "cpu", num_blocks=0)
    builder = FlashInferMetadataBuilder(SPEC, "cpu", workspace_bytes=1024, num_blocks=NUM_BLOCKS)
    batch = _batch(3, page=NUM_BLOCKS)
    meta = builder.build(_device_only(monkeypatch, batch.common))
    assert meta.origin.num_blocks == NUM_BLOCKS and meta.plan.uncontained_page_ids == ()
    assert NUM_BLOCKS not in meta.plan_inputs.kv_indices.tolist()
    with pytest.raises(PageTableError, match=rf"block_table\[1, 1\] = {NUM_BLOCKS} is outside"):
        raise_pending_faults("cpu")  # build() scanned the device-only table
    impl = FlashInferBackend.get_impl_cls()(SPEC)
    with pytest.raises(ValueError, match=rf"kv_cache has {NUM_BLOCKS + 8} pages .* num_blocks={NUM_BLOCKS}"):
        impl.forward(batch.query, None, None, torch.cat([batch.kv_cache, batch.kv_cache[:8]]), meta,
                     batch.new_output())
    _clear_faults("cpu")


def test_host_tables_are_checked_not_contained(fake_flashinfer):
    """With a host table the guard raises before any kernel runs (in build() where the builder knows num_blocks,
    else in forward): nothing to contain, nothing recorded."""
    _clear_faults("cpu")
    batch = _batch(4, page=NUM_BLOCKS + 1)
    batch.common.block_table_cpu = batch.common.block_table
    builder = FlashInferMetadataBuilder(SPEC, "cpu", workspace_bytes=1024, num_blocks=NUM_BLOCKS)
    with pytest.raises(PageTableError, match=rf"block_table\[1, 1\] = {NUM_BLOCKS + 1}"):
        builder.build(batch.common)
    meta = FlashInferMetadataBuilder(SPEC, "cpu", workspace_bytes=1024).build(batch.common)
    assert meta.plan.uncontained_page_ids == ()
    impl = FlashInferBackend.get_impl_cls()(SPEC)
    with pytest.raises(PageTableError, match=rf"block_table\[1, 1\] = {NUM_BLOCKS + 1}"):
        impl.forward(batch.query, batch.key, batch.value, batch.kv_cache.clone(), meta, batch.new_output())
    raise_pending_faults("cpu")  # nothing left for the next step


def test_cuda_graph_buffers_are_contained_too(fake_flashinfer, monkeypatch):
    _clear_faults("cpu")
    builder = FlashInferMetadataBuilder(SPEC, "cpu", workspace_bytes=1024, max_num_reqs=4, max_model_len=512)
    shapes = [S(1, c) for c in (5, 40, 17)]
    batch = _batch(5, shapes=shapes, bad=((1, 2),))
    capture = builder.build_for_cudagraph_capture
    meta, out = _forward(builder, batch, build=lambda common: capture(_device_only(monkeypatch, common)))
    assert meta.cuda_graph and len(meta.plan.uncontained_page_ids) == 2  # the page table and the graph's copy
    assert builder.wrappers.graph_page_ids(meta.plan_inputs.num_pages).max() < NUM_BLOCKS
    _clear_faults("cpu")
    _, want = _forward(FlashInferMetadataBuilder(SPEC, "cpu", workspace_bytes=1024), _batch(5, shapes, ((1, 2),), 0))
    assert torch.equal(out, want)


def test_cascade_shared_level_is_contained_on_a_copy(fake_flashinfer, monkeypatch):
    _clear_faults("cpu")
    shared = [3, 7, 11, 12]
    shapes = [S(1, 80 + 2 * i) for i in range(6)]
    tables = [shared + [20 + 2 * i, 21 + 2 * i] for i in range(6)]
    batch = make_random_batch(SPEC, shapes, seed=6, num_blocks=NUM_BLOCKS, block_tables=tables)
    table = batch.common.block_table.clone()
    table[:, 1] = NUM_BLOCKS + 9  # the shared prefix's second page, in every row
    batch.common.block_table = table
    policy = CascadePolicy(enabled=True, min_requests=2, min_shared_tokens=16, min_saved_fraction=0.0)
    builder = FlashInferMetadataBuilder(SPEC, "cpu", workspace_bytes=1024, cascade_policy=policy)
    meta = builder.build(_device_only(monkeypatch, batch.common), common_prefix_len=4 * 16)
    assert meta.cascade_wrapper is not None and len(meta.plan.uncontained_page_ids) == 2
    impl = FlashInferBackend.get_impl_cls()(SPEC)
    impl.forward(batch.query, None, None, batch.kv_cache.clone(), meta, batch.new_output())
    assert meta.cascade_wrapper.levels[0].plan_args["indices"].tolist() == [3, 0, 11, 12]
    assert torch.equal(batch.common.block_table, table)
    with pytest.raises(PageTableError, match=rf"block_table\[0, 1\] = {NUM_BLOCKS + 9}"):
        raise_pending_faults("cpu")


# -- the real thing --------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not flashinfer_installed(), reason="flashinfer is not installed")
@pytest.mark.parametrize("shapes", [[S(1, c) for c in (20, 300, 47, 90)], MIXED], ids=["decode", "mixed"])
@pytest.mark.parametrize("num_blocks_given", [False, True])
def test_cuda_table_without_host_copy(shapes, num_blocks_given):
    """No host copy: FlashInfer never reads outside the cache (no illegal memory access), the output is that of page
    0 in the bad entry's place, the error comes at the next check point, and the CUDA context keeps working; page
    ids are contained in build() with num_blocks, else in every forward(). Each step is built and run behind a GPU
    stall, so the host is ahead and the fault its own check records cannot be seen before its forward runs; a last
    step with the GPU caught up shows the other order: the next check point raises, naming the entry (forward()
    itself, or the next forward() when its own scan is still in flight, without num_blocks; with it, build()
    checked the table and the next build() raises)."""
    spec = AttentionSpec(num_heads=32, num_kv_heads=8, head_size=128, dtype="bfloat16", block_size=16)
    builder = FlashInferMetadataBuilder(spec, "cuda", num_blocks=64 if num_blocks_given else None)
    impl = FlashInferBackend.get_impl_cls()(spec)

    def bad_batch(page):
        batch = make_random_batch(spec, shapes, seed=8, device="cuda", num_blocks=64)
        batch.common.block_table_cpu = None
        batch.common.block_table[1, 1] = page
        return batch

    def step_with_host_ahead(batch):
        # A host slowed past the stall (every core busy) lets the GPU catch up, and forward() then raises itself:
        # that order is the last step's; this one retries behind a longer stall.
        for stall in (STALL_CYCLES, 8 * STALL_CYCLES, 64 * STALL_CYCLES):
            put_host_ahead("cuda", stall)
            meta = builder.build(dataclasses.replace(batch.common))
            out = batch.new_output()
            try:
                impl.forward(batch.query, batch.key, batch.value, batch.kv_cache.clone(), meta, out)
            except PageTableError:
                torch.cuda.synchronize()
                continue
            torch.cuda.synchronize()
            return meta, out
        pytest.fail("the host never got ahead of the GPU, even behind a stall of several seconds")

    outs = []
    for page in (1 << 24, 0, -3):
        batch = bad_batch(page)
        meta, out = step_with_host_ahead(batch)
        outs.append(out)
        if page:
            if num_blocks_given:
                assert meta.origin.num_blocks == 64 and meta.plan.uncontained_page_ids == ()
            else:
                assert meta.origin.num_blocks is None and meta.plan.uncontained_page_ids
            with pytest.raises(PageTableError, match=rf"block_table\[1, 1\] = {page} is outside"):
                raise_pending_faults("cuda")
    n = batch.num_actual_tokens
    assert torch.equal(outs[0][:n], outs[1][:n]) and torch.equal(outs[2][:n], outs[1][:n])

    batch = bad_batch(-7)
    meta = builder.build(dataclasses.replace(batch.common))
    torch.cuda.synchronize()
    with pytest.raises(PageTableError, match=r"block_table\[1, 1\] = -7 is outside"):
        impl.forward(batch.query, batch.key, batch.value, batch.kv_cache.clone(), meta, batch.new_output())
        torch.cuda.synchronize()
        good = bad_batch(0)
        good_meta = builder.build(dataclasses.replace(good.common))  # num_blocks given: build() raises here
        impl.forward(good.query, good.key, good.value, good.kv_cache.clone(), good_meta,
                     good.new_output())  # without num_blocks: the next forward()'s check point raises
    x = torch.randn(256, 256, device="cuda")
    assert torch.isfinite(x @ x).all()
    torch.cuda.synchronize()
