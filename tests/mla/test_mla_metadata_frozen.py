"""No forward writes to the metadata: a batch's MLA metadata (decode-only and mixed) is built, then frozen (every
object of it that the library defines refuses attribute writes), and two forwards of each of two layers run on it
(three on the GPU for triton_mla: the third launches the prepared sequence).
Afterwards every field of the metadata, of its decode and prefill parts, of the common metadata and of the plans
they carry is the same object as before (lists, tuples and dicts the same items), every tensor the same buffer with
the same layout, and every tensor an input (block table, sequence lengths, slots, ...) holds the same values; only
the plan's scratch buffers (absorbed queries, latent output, split partials, the context workspace) are written.

triton_mla (both projection paths), reference_mla and flashinfer_mla through a stand-in wrapper on the CPU
(interpreted kernels, tiny shapes); triton_mla and flashinfer_mla on a GPU (marked ``gpu``). The flashinfer_mla cases also check
the page ids of a device-only block table: contained in ``build()`` where the builder knows the cache's pages,
else by each ``forward`` (the plan unchanged), the output then equal to the run with page 0 in the bad entry.
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
import sys
import types
from typing import Any, Optional

import pytest
import torch

from attnbackends.metadata import CommonAttentionMetadata
from attnbackends.mla.backends import FlashInferMLABackend, TritonMLABackend
from attnbackends.mla.decode_plan import FlashInferMLADecodePlan, MLADecodeStepPlan, TritonMLADecodePlan
from attnbackends.ops import page_guard
from attnbackends.ops.page_guard import PageTableError, raise_pending_faults
from attnbackends.reference.mla import ReferenceMLABackend
from attnbackends.spec import AttentionSpec
from attnbackends.testing import SequenceShape as S
from attnbackends.testing.mla import make_random_mla_batch

# Fields a forward may write: none, on the common metadata as on a backend's own.
GUARD_MEMOS: dict = {}

DECODE_ONLY = [S(1, 5), S(1, 17), S(1, 30)]
MIXED = [S(1, 9), S(1, 24), S(4, 0), S(3, 12)]


def _spec(block_size=8):
    return AttentionSpec.mla(4, kv_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                             dtype="bfloat16", block_size=block_size)


def _own(obj: Any) -> bool:
    """Whether ``obj`` is one of the library's own records (walked into), not a tensor, wrapper or kernel."""
    return (dataclasses.is_dataclass(obj) and not isinstance(obj, type)
            and type(obj).__module__.startswith("attnbackends."))


def _walk(obj: Any, path: str, facts: dict, records: dict) -> None:
    """Record what ``obj`` (at ``path``) is: its identity, and for a tensor its buffer and layout; walk into the
    library's records (every attribute), sequences and dicts."""
    if isinstance(obj, torch.Tensor):
        facts[path] = (id(obj), obj.data_ptr(), tuple(obj.shape), obj.stride(), obj.dtype, obj.device)
        return
    facts[path] = id(obj)
    if id(obj) in records:
        return
    if _own(obj):
        records[id(obj)] = obj
        attrs = vars(obj) if hasattr(obj, "__dict__") else {f.name: getattr(obj, f.name)
                                                            for f in dataclasses.fields(obj)}
        memos = GUARD_MEMOS.get(type(obj), frozenset())
        facts[path + ".__attrs__"] = tuple(sorted(set(attrs) - memos))
        for name, value in attrs.items():
            if name not in memos:
                _walk(value, f"{path}.{name}", facts, records)
    elif isinstance(obj, (list, tuple)):
        records[id(obj)] = obj
        facts[path + ".__len__"] = len(obj)
        for i, value in enumerate(obj):
            _walk(value, f"{path}[{i}]", facts, records)
    elif isinstance(obj, dict):
        records[id(obj)] = obj
        facts[path + ".__keys__"] = tuple(map(repr, obj))
        for key, value in obj.items():
            _walk(value, f"{path}[{key!r}]", facts, records)


def _tensors(metadata: Any) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}

    def visit(obj, path, seen):
        if isinstance(obj, torch.Tensor):
            found.setdefault(path, obj)
        elif id(obj) not in seen:
            seen.add(id(obj))
            if _own(obj):
                for name, value in (vars(obj) if hasattr(obj, "__dict__") else {}).items():
                    visit(value, f"{path}.{name}", seen)
            elif isinstance(obj, (list, tuple)):
                for i, value in enumerate(obj):
                    visit(value, f"{path}[{i}]", seen)
            elif isinstance(obj, dict):
                for key, value in obj.items():
                    visit(value, f"{path}[{key!r}]", seen)

    visit(metadata, "metadata", set())
    return found


class Frozen:
    """``metadata`` deep-frozen inside ``with``: every library record reachable from it refuses attribute writes
    (the frozen plans already do), but for :data:`GUARD_MEMOS`; :meth:`check` then compares the whole graph with
    the snapshot taken on entry. ``contained``: page-id tensors (by path) a forward may contain in place to a cache
    of that many pages (an id outside it replaced by page 0, nothing else changed)."""

    def __init__(self, metadata: Any, scratch: tuple[Optional[torch.Tensor], ...] = (),
                 contained: Optional[dict[str, int]] = None) -> None:
        self.metadata = metadata
        self.contained = contained or {}
        self.facts: dict = {}
        self.records: dict = {}
        _walk(metadata, "metadata", self.facts, self.records)
        scratch_storages = {t.untyped_storage().data_ptr() for t in scratch if t is not None}
        # the values of every input tensor (what the kernels read); scratch buffers the plans own are written
        self.values = {path: t.clone() for path, t in _tensors(metadata).items()
                       if t.untyped_storage().data_ptr() not in scratch_storages}
        self.frozen_ids = {i for i, obj in self.records.items() if _own(obj)}
        self.patch = pytest.MonkeyPatch()

    def __enter__(self) -> "Frozen":
        ids = self.frozen_ids

        def refuse(obj, name, value):
            if id(obj) in ids and name not in GUARD_MEMOS.get(type(obj), ()):
                raise AssertionError(f"forward set {type(obj).__name__}.{name} on the built metadata")
            object.__setattr__(obj, name, value)

        def refuse_del(obj, name):
            if id(obj) in ids:
                raise AssertionError(f"forward deleted {type(obj).__name__}.{name} of the built metadata")
            object.__delattr__(obj, name)

        for cls in {type(obj) for obj in self.records.values() if _own(obj)}:
            if not cls.__dataclass_params__.frozen:
                self.patch.setattr(cls, "__setattr__", refuse)
                self.patch.setattr(cls, "__delattr__", refuse_del)
        return self

    def __exit__(self, *exc) -> None:
        self.patch.undo()

    def check(self) -> None:
        facts: dict = {}
        _walk(self.metadata, "metadata", facts, {})
        changed = sorted(k for k in facts.keys() | self.facts.keys() if facts.get(k) != self.facts.get(k))
        assert not changed, f"forward changed the metadata at {changed[:8]}"
        tensors = _tensors(self.metadata)
        for path, num_blocks in self.contained.items():
            before = self.values.pop(path)
            assert torch.equal(tensors[path], before.masked_fill((before < 0) | (before >= num_blocks), 0)), path
        written = sorted(path for path, before in self.values.items() if not _same_values(before, tensors[path]))
        assert not written, f"forward wrote the metadata's input tensors {written}"


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (NaN equal to itself)."""
    if a.dtype.is_floating_point:
        a, b = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    return a.shape == b.shape and torch.equal(a, b)


def _scratch(builder) -> tuple:
    """The buffers a builder's plans own and every forward writes (absorbed queries, latent output, partials; the
    context workspace)."""
    return (getattr(builder, "_decode_buffer", None), getattr(builder, "_workspace", None))


def _run_frozen(backend, batch, builder_kwargs=None, rounds=2) -> tuple:
    """Build ``batch``'s metadata, freeze it, run ``rounds`` forwards of each of two layers (their own weights and
    caches), check nothing changed; returns (metadata, outputs per round and layer)."""
    spec = batch.spec
    builder = backend.get_builder_cls()(spec, batch.q.device, **(builder_kwargs or {}))
    metadata = builder.build(batch.common)
    layers = []
    for seed in (101, 102):
        weights = make_random_mla_batch(spec, batch.shapes[:1], seed=seed, device=batch.q.device).kv_b_proj
        impl = backend.get_impl_cls()(spec, kv_b_proj=weights, k_scale=batch.k_scale)
        impl.process_weights_after_loading()
        layers.append((impl, batch.kv_cache.clone()))
    plan = metadata.decode.plan if getattr(metadata, "decode", None) is not None else None
    # the one write a forward may make: unchecked page ids contained in place (idempotent)
    contained = ({"metadata.decode.plan.page_ids": batch.kv_cache.shape[0]}
                 if isinstance(plan, FlashInferMLADecodePlan) and plan.unchecked else None)
    outs = []
    with Frozen(metadata, _scratch(builder), contained) as frozen:
        for _ in range(rounds):
            for impl, cache in layers:
                out = batch.new_output()
                impl.forward(batch.q, batch.kv_c, batch.k_pe, cache, metadata, out)
                outs.append(out)
    frozen.check()
    n = batch.num_actual_tokens
    for i, again in enumerate(outs[2:]):
        assert torch.equal(outs[i % 2][:n], again[:n])  # the same step again: the same numbers
    assert all(torch.isfinite(out[:n].float()).all() for out in outs)
    assert not torch.equal(outs[0][:n], outs[1][:n])  # two layers, two weights
    return metadata, outs


@pytest.mark.parametrize("shapes", [DECODE_ONLY, MIXED], ids=["decode_only", "mixed"])
@pytest.mark.parametrize("builder_kwargs", [
    dict(num_splits=2, up_projection="fused", absorb="triton"),
    dict(num_splits=2, up_projection="bmm", absorb="bmm"),
], ids=["fused", "bmm"])
def test_triton_mla_forward_leaves_the_metadata_as_built(shapes, builder_kwargs):
    batch = make_random_mla_batch(_spec(), shapes, seed=len(shapes), pad_tokens=2)
    metadata, _ = _run_frozen(TritonMLABackend, batch, builder_kwargs)
    plan = metadata.decode.plan
    assert isinstance(plan, TritonMLADecodePlan)
    assert plan.writes_cache == (shapes is DECODE_ONLY and builder_kwargs["absorb"] == "triton")
    assert (metadata.prefill is None) == (shapes is DECODE_ONLY)


@pytest.mark.parametrize("shapes", [DECODE_ONLY, MIXED], ids=["decode_only", "mixed"])
def test_reference_mla_forward_leaves_the_metadata_as_built(shapes):
    batch = make_random_mla_batch(_spec(), shapes, seed=len(shapes) + 10, pad_tokens=2)
    _run_frozen(ReferenceMLABackend, batch)


def test_plans_are_frozen():
    batch = make_random_mla_batch(_spec(), DECODE_ONLY, seed=3)
    plan = TritonMLABackend.get_builder_cls()(_spec(), "cpu").build(batch.common).decode.plan
    assert isinstance(plan, MLADecodeStepPlan)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.writes_cache = False
    assert plan.absorption_reason and plan.up_projection_reason


# ------------------------------------------------------------------------------------------- flashinfer_mla


@pytest.fixture
def stand_in_flashinfer(monkeypatch):
    """flashinfer.mla.BatchMLAPagedAttentionWrapper replaced by test_mla_cpu's float64 stand-in (it reads the
    planned page ids when it runs)."""
    from tests.mla.test_mla_cpu import FakeMLAWrapper

    fi = types.ModuleType("flashinfer")
    fi.__spec__ = importlib.machinery.ModuleSpec("flashinfer", None)
    fi.mla = types.ModuleType("flashinfer.mla")
    fi.mla.BatchMLAPagedAttentionWrapper = FakeMLAWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", fi)
    monkeypatch.setitem(sys.modules, "flashinfer.mla", fi.mla)


def _clear_faults(device):
    try:
        raise_pending_faults(device)
    except PageTableError:
        pass


@pytest.mark.usefixtures("stand_in_flashinfer")
@pytest.mark.parametrize("shapes", [DECODE_ONLY, MIXED], ids=["decode_only", "mixed"])
def test_flashinfer_mla_forward_leaves_the_metadata_as_built(shapes):
    batch = make_random_mla_batch(_spec(), shapes, seed=len(shapes) + 20, pad_tokens=2)
    metadata, _ = _run_frozen(FlashInferMLABackend, batch)
    plan = metadata.decode.plan
    assert isinstance(plan, FlashInferMLADecodePlan) and not plan.writes_cache
    assert not plan.unchecked and plan.page_ids_bound is None  # a host table: checked before any kernel runs


def _device_table_batch(page: int):
    """MIXED with request 1's second page id set to ``page`` and no host copy of the block table."""
    batch = make_random_mla_batch(_spec(), MIXED, seed=31, pad_tokens=2)
    batch.common.block_table_cpu = None
    table = batch.common.block_table.clone()
    table[1, 1] = page
    batch.common.block_table = table
    return batch


@pytest.mark.usefixtures("stand_in_flashinfer")
@pytest.mark.parametrize("where", ["build", "forward"])
def test_flashinfer_mla_device_table_page_ids_are_contained_without_touching_the_metadata(monkeypatch, where):
    """A device-only block table (the CPU table taken for one) with a page id outside the cache: with the builder's
    ``num_blocks`` the page ids are contained in ``build()`` (the output is the run's with page 0 in the bad entry,
    the error comes at the next check point); without it every forward checks the table, so the next layer's forward
    raises, and a good table's page ids are contained in place where FlashInfer reads the planned tensor (the
    stand-in does), the plan unchanged, its ``unchecked`` still set."""
    from attnbackends.mla import backends as mla_backends

    monkeypatch.setattr(page_guard, "_host_table", lambda common: None)
    monkeypatch.setattr(mla_backends, "surface_unsupported_reason", lambda name: None)
    _clear_faults("cpu")
    outs = []
    for page in (1 << 20, 0):
        batch = _device_table_batch(page)
        num_blocks = batch.kv_cache.shape[0]
        if where == "forward" and page:
            # without num_blocks every forward checks the table: the first layer's scan records the fault, the
            # next forward (the next check point) raises it
            with pytest.raises(PageTableError, match=rf"block_table\[1, 1\] = {page}"):
                _run_frozen(FlashInferMLABackend, batch)
            continue
        metadata, layer_outs = _run_frozen(FlashInferMLABackend, batch,
                                           dict(num_blocks=num_blocks) if where == "build" else None)
        plan = metadata.decode.plan
        assert plan.unchecked == (where == "forward")
        assert plan.page_ids_bound == (num_blocks if where == "build" else None)
        assert int(plan.page_ids.max()) < num_blocks and int(plan.page_ids.min()) >= 0
        outs.append(layer_outs[0][: batch.num_actual_tokens])
        if page:
            with pytest.raises(PageTableError, match=rf"block_table\[1, 1\] = {page}"):
                raise_pending_faults("cpu")
    if where == "build":
        assert torch.equal(outs[0], outs[1])


@pytest.mark.usefixtures("stand_in_flashinfer")
def test_flashinfer_mla_unchecked_page_ids_refused_where_flashinfer_may_copy_them(monkeypatch):
    """Where FlashInfer is not known to read the very page-id tensor given to plan() (the surface's fallback),
    every forward checks the unchecked page ids on the host and raises before run(); the metadata unchanged."""
    monkeypatch.setattr(page_guard, "_host_table", lambda common: None)
    _clear_faults("cpu")
    batch = _device_table_batch(1 << 20)
    metadata = FlashInferMLABackend.get_builder_cls()(_spec(), "cpu").build(batch.common)
    impl = FlashInferMLABackend.get_impl_cls()(_spec(), kv_b_proj=batch.kv_b_proj)
    with Frozen(metadata) as frozen:
        for _ in range(2):
            with pytest.raises(PageTableError):
                impl.forward(batch.q, batch.kv_c, batch.k_pe, batch.kv_cache.clone(), metadata, batch.new_output())
    frozen.check()
    assert metadata.decode.plan.unchecked
    _clear_faults("cpu")


@pytest.mark.usefixtures("stand_in_flashinfer")
def test_flashinfer_mla_refuses_a_cache_of_another_size_than_build_contained_to(monkeypatch):
    batch = make_random_mla_batch(_spec(), DECODE_ONLY, seed=33)
    batch.common.block_table_cpu = None
    monkeypatch.setattr(page_guard, "_host_table", lambda common: None)
    num_blocks = batch.kv_cache.shape[0]
    metadata = FlashInferMLABackend.get_builder_cls()(_spec(), "cpu", num_blocks=num_blocks + 1).build(batch.common)
    impl = FlashInferMLABackend.get_impl_cls()(_spec(), kv_b_proj=batch.kv_b_proj)
    with pytest.raises(ValueError, match=rf"kv_cache has {num_blocks} pages .* num_blocks={num_blocks + 1}"):
        impl.forward(batch.q, batch.kv_c, batch.k_pe, batch.kv_cache.clone(), metadata, batch.new_output())


@pytest.mark.parametrize("bad", [0, True, -3, 2.0])
def test_builder_num_blocks_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="num_blocks must be None or a positive int"):
        TritonMLABackend.get_builder_cls()(_spec(), "cpu", num_blocks=bad)


def _v3_batch(shapes, seed):
    """``shapes`` with contexts x 20 on the GPU, DeepSeek-V3's latent sizes (16 heads)."""
    spec = AttentionSpec.mla(16, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                             dtype="bfloat16", block_size=64)
    return make_random_mla_batch(spec, [S(s.query_len, s.context_len * 20) for s in shapes], seed=seed,
                                 device="cuda", pad_tokens=2)


@pytest.mark.gpu
@pytest.mark.parametrize("shapes", [DECODE_ONLY, MIXED], ids=["decode_only", "mixed"])
@pytest.mark.parametrize("up_projection", ["fused", "bmm"])
def test_triton_mla_forward_leaves_the_metadata_as_built_on_gpu(shapes, up_projection):
    """Three forwards of each of two layers: launched in full, prepared, then (decode-only, fused) as the prepared
    launch sequence; the metadata unchanged."""
    batch = _v3_batch(shapes, seed=43)
    metadata, _ = _run_frozen(TritonMLABackend, batch, dict(up_projection=up_projection), rounds=3)
    torch.cuda.synchronize()
    raise_pending_faults("cuda")
    assert metadata.decode.plan.writes_cache == (shapes is DECODE_ONLY)


@pytest.mark.gpu
@pytest.mark.parametrize("shapes", [DECODE_ONLY, MIXED], ids=["decode_only", "mixed"])
@pytest.mark.parametrize("pages", ["host_table", "device_table", "device_table_num_blocks"])
def test_flashinfer_mla_forward_leaves_the_metadata_as_built_on_gpu(shapes, pages):
    """FlashInfer's own wrapper on the GPU (kv_lora_rank 512, rope 64): the metadata unchanged by two forwards of
    two layers; with a device-only table the page ids are contained by the forwards, or in build() where the
    builder is given the cache's pages."""
    from attnbackends.compat import flashinfer_installed

    if not flashinfer_installed():
        pytest.skip("flashinfer is not installed")
    batch = _v3_batch(shapes, seed=41)
    if pages != "host_table":
        batch.common.block_table_cpu = None
    kwargs = dict(num_blocks=batch.kv_cache.shape[0]) if pages == "device_table_num_blocks" else None
    metadata, _ = _run_frozen(FlashInferMLABackend, batch, kwargs)
    torch.cuda.synchronize()
    raise_pending_faults("cuda")
    plan = metadata.decode.plan
    assert plan.unchecked == (pages == "device_table")
    assert plan.page_ids_bound == (batch.kv_cache.shape[0] if pages == "device_table_num_blocks" else None)
