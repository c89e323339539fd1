"""Nothing writes to the batch's metadata after build(): every layer's forward reads the plan the builder made.

Reference and Triton (interpreted on the CPU) run a decode-only and a mixed step over two layers, with the builder
told the cache's page count and without it; the built metadata, its plan and the engine's common metadata are
snapshotted (every field by identity, tensors also by value) before the first layer and compared after the last,
and any attribute write to the common metadata during forward raises. A persistent common metadata rewritten in
place with a bad page id between steps is caught by the next build() where the builder knows num_blocks, and by
forward where it does not.
"""

import dataclasses
import enum
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from attnbackends import AttentionSpec  # noqa: E402
from attnbackends import validation  # noqa: E402
from attnbackends.metadata import CommonAttentionMetadata, build_common_metadata  # noqa: E402
from attnbackends.ops import page_guard  # noqa: E402
from attnbackends.ops.page_guard import PageTableError, raise_pending_faults  # noqa: E402
from attnbackends.reference.backend import ReferenceBackend  # noqa: E402
from attnbackends.testing import SequenceShape as S  # noqa: E402
from attnbackends.testing import make_random_batch  # noqa: E402
from attnbackends.triton.backend import TritonAttentionBackend  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NUM_BLOCKS = 48
SPEC = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=32, dtype="float16", block_size=16)
BACKENDS = [ReferenceBackend, TritonAttentionBackend]
STEPS = {"decode": [S(1, 20), S(1, 47), S(1, 3)], "mixed": [S(1, 20), S(1, 47), S(6, 30), S(9, 0)]}


def _snapshot(obj, depth=0, seen=None, workspaces=()):
    """``obj``'s state: a tensor's identity and a copy of its values (a workspace's identity only: ``workspaces``
    holds the ids of tensors the forward writes by design), a scalar's value, a container's or object's parts (by
    identity, then their own state), to a few levels deep."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        if id(obj) in workspaces:
            return ("workspace", id(obj))
        return ("tensor", id(obj), obj.detach().cpu().clone())
    if obj is None or isinstance(obj, (bool, int, float, str, enum.Enum, type, torch.device, torch.dtype)):
        return obj
    if id(obj) in seen or depth > 4:
        return ("seen", id(obj))
    seen.add(id(obj))
    if isinstance(obj, (tuple, list)):
        return (type(obj), id(obj), tuple(_snapshot(x, depth + 1, seen, workspaces) for x in obj))
    if isinstance(obj, dict):
        return (dict, id(obj), tuple((k, _snapshot(v, depth + 1, seen, workspaces)) for k, v in obj.items()))
    fields = vars(obj) if hasattr(obj, "__dict__") else {}
    return (type(obj), id(obj), tuple((k, _snapshot(v, depth + 1, seen, workspaces))
                                      for k, v in sorted(fields.items())))


def _same(a, b) -> bool:
    if isinstance(a, tuple) and a and a[0] == "tensor":
        return isinstance(b, tuple) and b[0] == "tensor" and a[1] == b[1] and torch.equal(a[2], b[2])
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.fixture
def common_is_read_only(monkeypatch):
    """Inside the block: any attribute write to a CommonAttentionMetadata fails the test."""

    class ReadOnly:
        def __enter__(self):
            def refuse(obj, name, value):
                raise AssertionError(f"forward wrote common.{name}")

            monkeypatch.setattr(CommonAttentionMetadata, "__setattr__", refuse)

        def __exit__(self, *exc):
            monkeypatch.undo()

    return ReadOnly()


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
@pytest.mark.parametrize("step", sorted(STEPS))
@pytest.mark.parametrize("num_blocks", [NUM_BLOCKS, None], ids=["num_blocks", "no_num_blocks"])
def test_forward_over_two_layers_writes_nothing_to_the_metadata(backend, step, num_blocks, common_is_read_only):
    batch = make_random_batch(SPEC, STEPS[step], seed=3, device=DEVICE, num_blocks=NUM_BLOCKS)
    builder = backend.get_builder_cls()(SPEC, DEVICE, num_blocks=num_blocks)
    metadata = builder.build(batch.common)
    assert metadata.origin.num_blocks == num_blocks
    caches = [batch.kv_cache.clone(), batch.kv_cache.clone()]
    impls = [backend.get_impl_cls()(SPEC) for _ in caches]
    before = _snapshot(metadata), _snapshot(batch.common)
    outputs = []
    with common_is_read_only:
        for impl, cache in zip(impls, caches):  # the first layer (first calls: full checks), then the second
            out = batch.new_output()
            impl.forward(batch.query, batch.key, batch.value, cache, metadata, out)
            outputs.append(out)
        for impl, cache in zip(impls, caches):  # later calls take the cheap path
            impl.forward(batch.query, None, None, cache, metadata, batch.new_output())
    after = _snapshot(metadata), _snapshot(batch.common)
    assert _same(before, after), "forward changed the metadata, its plan or the common metadata"
    n = batch.num_actual_tokens
    assert torch.isfinite(outputs[0][:n].float()).all() and torch.equal(outputs[0][:n], outputs[1][:n])
    if dataclasses.is_dataclass(metadata):
        with pytest.raises(dataclasses.FrozenInstanceError):
            metadata.debug = True


@pytest.mark.parametrize("kv_cache_dtype", ["int8_per_token_head", "nvfp4"])
def test_prefills_over_dequantised_pages_write_only_the_scratch(kv_cache_dtype, common_is_read_only):
    """A quantised layer's mixed step with its prefills over the dequantised scratch (the unified kernel over it on
    the CPU), over two layers: the plan (the pages, the rewritten block table, every launch) is unchanged, the
    scratch (a workspace) excepted."""
    from attnbackends.ops.kv_cache_write import reshape_and_cache_torch
    from attnbackends.triton.step_plan import LaunchKind

    spec = SPEC.model_copy(update={"kv_cache_dtype": kv_cache_dtype})
    batch = make_random_batch(SPEC, STEPS["mixed"], seed=5, device=DEVICE, num_blocks=NUM_BLOCKS)
    builder = TritonAttentionBackend.get_builder_cls()(spec, DEVICE, num_blocks=NUM_BLOCKS, dequant_prefill=True)
    metadata = builder.build(batch.common)
    assert LaunchKind.DEQUANT_PAGES in metadata.step.paged_new_kv.kinds()
    g = torch.Generator().manual_seed(6)
    scales = dict(k_scale=0.01, v_scale=0.01) if kv_cache_dtype == "nvfp4" else {}
    caches = []
    for _ in range(2):
        cache = TritonAttentionBackend.allocate_kv_cache(NUM_BLOCKS, spec, DEVICE)
        tokens = torch.randn(NUM_BLOCKS * 16, 2, 32, generator=g).half().to(DEVICE)
        reshape_and_cache_torch(tokens, tokens.flip(0), cache, torch.arange(NUM_BLOCKS * 16, device=DEVICE),
                                kv_format=spec.kv_cache_format, **scales)
        caches.append(cache)
    impls = [TritonAttentionBackend.get_impl_cls()(spec, **scales) for _ in caches]
    scratch = {id(metadata.step.dequant.scratch)}
    before = _snapshot(metadata, workspaces=scratch), _snapshot(batch.common)
    outputs = []
    with common_is_read_only:
        for impl, cache in zip(impls, caches):
            out = batch.new_output()
            impl.forward(batch.query, batch.key, batch.value, cache, metadata, out)
            outputs.append(out)
        for impl, cache in zip(impls, caches):
            impl.forward(batch.query, None, None, cache, metadata, batch.new_output())
    after = _snapshot(metadata, workspaces=scratch), _snapshot(batch.common)
    assert _same(before, after), "forward changed the metadata, its plan or the common metadata"
    n = batch.num_actual_tokens
    assert torch.isfinite(outputs[0][:n].float()).all() and torch.isfinite(outputs[1][:n].float()).all()
    assert not torch.equal(outputs[0][:n], outputs[1][:n])  # each layer read its own cache through the scratch


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_with_num_blocks_forward_only_compares_the_cache_size(backend, monkeypatch):
    batch = make_random_batch(SPEC, STEPS["mixed"], seed=4, device=DEVICE, num_blocks=NUM_BLOCKS)
    metadata = backend.get_builder_cls()(SPEC, DEVICE, num_blocks=NUM_BLOCKS).build(batch.common)

    def no_guard(*args):
        raise AssertionError("forward checked the page ids that build() checked")

    monkeypatch.setattr(validation, "guard_block_table", no_guard)
    impl = backend.get_impl_cls()(SPEC)
    impl.forward(batch.query, batch.key, batch.value, batch.kv_cache.clone(), metadata, batch.new_output())
    bigger = torch.cat([batch.kv_cache, batch.kv_cache[:8]])
    with pytest.raises(ValueError, match=rf"kv_cache has {NUM_BLOCKS + 8} pages .*num_blocks={NUM_BLOCKS}"):
        backend.get_impl_cls()(SPEC).forward(batch.query, batch.key, batch.value, bigger, metadata,
                                             batch.new_output())


def _persistent_batch():
    """An engine's persistent batch: built once, its tensors rewritten in place between steps."""
    common = build_common_metadata([1, 5], [20, 3], [[3, 4], [5]], SPEC.block_size, DEVICE)
    n = common.num_actual_tokens
    g = torch.Generator().manual_seed(0)
    q = torch.randn(n, 4, 32, generator=g).half().to(DEVICE)
    k = torch.randn(n, 2, 32, generator=g).half().to(DEVICE)
    v = torch.randn(n, 2, 32, generator=g).half().to(DEVICE)
    cache = torch.randn(NUM_BLOCKS, 2, SPEC.block_size, 2, 32, generator=g).half().to(DEVICE)
    return common, q, k, v, cache


def _rewrite_in_place(common, page):
    common.block_table[0, 1] = page
    if common.block_table_cpu is not None:
        common.block_table_cpu[0, 1] = page


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
@pytest.mark.parametrize("host_table", [True, False], ids=["host-table", "device-table-only"])
def test_persistent_batch_rewritten_in_place_is_checked_by_the_next_build(backend, host_table, monkeypatch):
    common, q, k, v, cache = _persistent_batch()
    if not host_table:
        monkeypatch.setattr(page_guard, "_host_table", lambda c: None)  # scanned as a device-only table
    builder = backend.get_builder_cls()(SPEC, DEVICE, num_blocks=NUM_BLOCKS)
    impl = backend.get_impl_cls()(SPEC)
    impl.forward(q, k, v, cache, builder.build(common), torch.empty_like(q))
    _rewrite_in_place(common, NUM_BLOCKS + 3)
    with pytest.raises(PageTableError, match=rf"block_table\[0, 1\] = {NUM_BLOCKS + 3} is outside"):
        builder.build(common)
        if DEVICE == "cuda":
            torch.cuda.synchronize()  # a device-only table: build() recorded the fault without a sync
        raise_pending_faults(DEVICE)  # raised at the check point
    _rewrite_in_place(common, 4)
    impl.forward(q, k, v, cache, builder.build(common), torch.empty_like(q))
    raise_pending_faults(DEVICE)  # nothing left over


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_persistent_batch_rewritten_in_place_is_checked_by_forward_without_num_blocks(backend):
    common, q, k, v, cache = _persistent_batch()
    builder = backend.get_builder_cls()(SPEC, DEVICE)
    impls = [backend.get_impl_cls()(SPEC) for _ in range(2)]
    metadata = builder.build(common)
    for impl in impls:
        impl.forward(q, k, v, cache, metadata, torch.empty_like(q))
    _rewrite_in_place(common, NUM_BLOCKS)
    metadata = builder.build(common)  # the builder cannot check: it does not know the cache's page count
    for impl in impls:  # every layer checks, not only the first
        with pytest.raises(PageTableError, match=rf"block_table\[0, 1\] = {NUM_BLOCKS} is outside"):
            impl.forward(q, k, v, cache, metadata, torch.empty_like(q))


def test_num_blocks_is_checked_once_by_the_base_builder():
    for bad in (0, -1, 2.0, True, "8"):
        with pytest.raises(ValueError, match="num_blocks must be None or a positive int"):
            ReferenceBackend.get_builder_cls()(SPEC, DEVICE, num_blocks=bad)
    assert ReferenceBackend.get_builder_cls()(SPEC, DEVICE, num_blocks=8).num_blocks == 8
