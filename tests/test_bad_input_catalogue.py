"""The bad-input catalogue: every kind of wrong input an engine can pass, run through every backend, each asserting
the exception type AND that the message names the offending argument (never a crash, never a silent result).

Per-backend kinds (:data:`KINDS`) run on the CPU for reference, triton (interpreted), reference_mla and triton_mla
(interpreted), and on a GPU (marked ``gpu``) for reference, triton, flashinfer and the three MLA backends; kinds
that do not apply to a backend's kind of layer (standard or MLA) are left out of its parametrisation. Kinds that
may crash the process today (out-of-range page ids and slots outside debug mode) run in a child process wherever
a kernel would dereference them. Spec, config and selection kinds (:data:`GLOBAL_KINDS`) run once. pytest's
terminal summary prints the catalogue's size (tests/conftest.py).

Run one backend's column by itself: ``python -m pytest tests/test_bad_input_catalogue.py -k triton_mla``; a
crash-prone case in a child: ``python tests/test_bad_input_catalogue.py TARGET KIND``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable, Optional

import pytest
import torch

from attnbackends import AttentionConfig, AttentionSpec, DeviceInfo, build_common_metadata, select
from attnbackends.ops.page_guard import raise_pending_faults
from attnbackends.selection.registry import get_backend_class
from attnbackends.testing import SequenceShape as S
from attnbackends.testing import make_random_batch, tolerance_for

@dataclass(frozen=True)
class Target:
    """A backend on a device, as the catalogue runs it."""

    backend: str
    device: str
    mla: bool

    @property
    def id(self) -> str:
        return f"{self.backend}-{self.device}"

    def spec(self, **overrides) -> AttentionSpec:
        on_gpu = self.device == "cuda"
        if self.mla:
            base = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                        dtype="bfloat16", block_size=64) if on_gpu else dict(
                kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, dtype="float16",
                block_size=16)
            num_heads = overrides.pop("num_heads", 16 if on_gpu else 4)
            return AttentionSpec.mla(num_heads, **{**base, **overrides})
        base = dict(num_heads=4, num_kv_heads=2, head_size=64 if on_gpu else 32, dtype="float16", block_size=16)
        return AttentionSpec(**{**base, **overrides})


CPU_TARGETS = [Target("reference", "cpu", False), Target("triton", "cpu", False),
               Target("reference_mla", "cpu", True), Target("triton_mla", "cpu", True)]
GPU_TARGETS = [Target("reference", "cuda", False), Target("triton", "cuda", False),
               Target("flashinfer", "cuda", False), Target("reference_mla", "cuda", True),
               Target("triton_mla", "cuda", True), Target("flashinfer_mla", "cuda", True)]

SHAPES = (S(1, 20), S(5, 3))  # a decode over two pages of context, then a chunked prefill: 6 tokens
ENCODER_SHAPES = (S(3), S(5))  # an encoder layer's batch: no cached context
#: Whose metadata each backend is handed in the "another backend's metadata" kinds.
OTHER_BACKEND = {"reference": "triton", "triton": "reference", "flashinfer": "triton", "reference_mla": "triton_mla",
                 "triton_mla": "reference_mla", "flashinfer_mla": "triton_mla"}
ROLES = ("query", "key", "value", "kv_cache", "output")
MLA_NAMES = {"query": "q", "key": "kv_c_normed", "value": "k_pe", "kv_cache": "kv_cache", "output": "output"}


class Ctx:
    """One backend's layer and batch: a fresh impl and builder, the batch's tensors by role."""

    def __init__(self, target: Target, *, debug: bool = False, spec: Optional[AttentionSpec] = None,
                 shapes=SHAPES, **builder_kwargs) -> None:
        self.target = target
        self.backend = get_backend_class(target.backend)
        self.spec = spec or target.spec()
        reasons = self.backend.not_supported_reasons(self.spec, DeviceInfo.current(target.device))
        if reasons:
            pytest.skip(f"{target.backend} declines the catalogue's spec: {'; '.join(reasons)}")
        self.device = torch.device(target.device)
        if target.mla:
            from attnbackends.testing.mla import make_random_mla_batch

            batch = make_random_mla_batch(self.spec, shapes, seed=3, device=self.device)
            self.tensors = dict(query=batch.q, key=batch.kv_c, value=batch.k_pe, kv_cache=batch.kv_cache,
                                output=batch.new_output())
            impl_kwargs = dict(kv_b_proj=batch.kv_b_proj, k_scale=batch.k_scale)
        else:
            batch = make_random_batch(self.spec, shapes, seed=3, device=self.device)
            self.tensors = dict(query=batch.query, key=batch.key, value=batch.value, kv_cache=batch.kv_cache,
                                output=batch.new_output())
            impl_kwargs = dict(k_scale=batch.k_scale, v_scale=batch.v_scale)
        if self.tensors["kv_cache"] is not None:
            self.tensors["kv_cache"] = self.tensors["kv_cache"].clone()
        self.batch = batch
        self.common = batch.common
        self.impl_kwargs = impl_kwargs
        self.impl = self.backend.get_impl_cls()(self.spec, **impl_kwargs)
        self.builder = self.backend.get_builder_cls()(self.spec, self.device, debug=debug, **builder_kwargs)

    def name(self, role: str) -> str:
        """The argument's name in this backend's ``forward`` (MLA calls query ``q`` and so on)."""
        return MLA_NAMES[role] if self.target.mla else role

    def build(self, common=None):
        return self.builder.build(common if common is not None else self.common)

    def forward(self, metadata=None, **override):
        """``impl.forward`` with the batch's tensors, ``override`` replacing some by role."""
        t = {**self.tensors, **override}
        meta = metadata if metadata is not None else self.build()
        return self.impl.forward(t["query"], t["key"], t["value"], t["kv_cache"], meta, t["output"])

    def with_table_entry(self, row: int, col: int, value: int):
        table = self.common.block_table.clone()
        table[row, col] = value
        return dataclasses.replace(self.common, block_table=table, block_table_cpu=table.cpu())

    def last_page_col(self, row: int) -> int:
        """The block-table column of request ``row``'s last used page."""
        return (int(self.common.seq_lens_cpu[row]) - 1) // self.spec.block_size

    def step_boundary(self) -> None:
        """What an engine does between steps: wait for the step (its sampling reads the logits back), then the
        next step's first check raises any fault the device recorded."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        raise_pending_faults(self.device)

    def with_consistent_table_entry(self, row: int, col: int, value: int):
        """``with_table_entry`` with the slot mapping recomputed from the new table (the batch stays consistent
        except for what the new entry itself breaks)."""
        table = self.common.block_table_cpu.clone()
        table[row, col] = value
        qsl, seq = self.common.query_start_loc_cpu.tolist(), self.common.seq_lens_cpu.tolist()
        slots = self.common.slot_mapping.cpu().clone()
        bs = self.spec.block_size
        for i in range(self.common.num_reqs):
            context = seq[i] - (qsl[i + 1] - qsl[i])
            for k in range(qsl[i], qsl[i + 1]):
                pos = context + k - qsl[i]
                slots[k] = int(table[i, pos // bs]) * bs + pos % bs
        return dataclasses.replace(self.common, block_table=table.to(self.device), block_table_cpu=table,
                                   slot_mapping=slots.to(self.device))

    def other_backends_metadata(self):
        """This batch built by the builder of :data:`OTHER_BACKEND`'s backend for the same spec."""
        other = get_backend_class(OTHER_BACKEND[self.target.backend])
        return other.get_builder_cls()(self.spec, self.device).build(self.common)

    def with_slot(self, index: int, value: int):
        slots = self.common.slot_mapping.clone()
        slots[index] = value
        return dataclasses.replace(self.common, slot_mapping=slots)

    @property
    def num_tokens(self) -> int:
        return self.common.num_actual_tokens

    @property
    def num_slots(self) -> int:
        return self.tensors["kv_cache"].shape[0] * self.spec.block_size


@dataclass(frozen=True)
class Kind:
    """One kind of bad input: ``run(ctx)`` must raise ``error`` whose message names ``arg(ctx)`` (a role of
    :data:`ROLES`, mapped to the backend's argument name, or a literal name)."""

    name: str
    run: Callable[[Ctx], object]
    arg: str
    error: type = ValueError
    layers: str = "all"  # "all", "standard" or "mla"
    debug: bool = False
    builder_kwargs: tuple = ()
    crash_prone: bool = False  # may crash the process today: run in a child process where a kernel reads it
    xfail: Optional[str] = None
    host_data: bool = False  # caught from the batch's host copies: CPU batches only (on a GPU: its debug_ kind)

    def argument(self, target: Target) -> str:
        if self.arg in ROLES and target.mla:
            return MLA_NAMES[self.arg]
        return self.arg


def other_float_dtype(t: torch.Tensor) -> torch.Tensor:
    """``t`` in a 16-bit float dtype other than its own."""
    return t.to(torch.float16 if t.dtype == torch.bfloat16 else torch.bfloat16)


def meta_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def strided_last_dim(t: torch.Tensor) -> torch.Tensor:
    wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    view = wide[..., ::2]
    view.copy_(t)
    return view


def wider(t: torch.Tensor, extra: int = 8) -> torch.Tensor:
    return torch.cat([t, t[..., :extra]], dim=-1)


def non_contiguous_cache(c: torch.Tensor) -> torch.Tensor:
    """The same shape and values, every other page of a buffer twice the size."""
    buf = torch.empty(2 * c.shape[0], *c.shape[1:], dtype=c.dtype, device=c.device)
    view = buf[::2]
    view.copy_(c)
    return view


def cache_of_other_layout_same_shape(ctx: Ctx) -> torch.Tensor:
    """Right shape, wrong layout: the standard cache as a K/V-first [2, num_blocks, ...] tensor (vLLM's older
    layout) permuted to [num_blocks, 2, ...]; MLA's latent cache transposed within a page."""
    c = ctx.tensors["kv_cache"]
    if ctx.target.mla:
        return c.transpose(1, 2).contiguous().transpose(1, 2)
    return c.transpose(0, 1).contiguous().transpose(0, 1)


def cache_of_other_layout_shape(ctx: Ctx) -> torch.Tensor:
    """FlashInfer's HND layout [num_blocks, 2, num_kv_heads, block_size, head_size]; MLA: one page per row."""
    c = ctx.tensors["kv_cache"]
    if ctx.target.mla:
        return c.reshape(c.shape[0], 1, c.shape[1], c.shape[2])
    return c.transpose(2, 3).contiguous()


def half_pages(ctx: Ctx) -> torch.Tensor:
    """A cache whose pages hold half the spec's block_size."""
    c = ctx.tensors["kv_cache"]
    return (c[:, : c.shape[1] // 2] if ctx.target.mla else c[:, :, : c.shape[2] // 2]).contiguous()


def later(bad: Callable[[Ctx], dict]) -> Callable[[Ctx], object]:
    """A call with good tensors first (the full validation records their layout), then ``bad(ctx)``'s."""

    def run(ctx: Ctx) -> object:
        meta = ctx.build()
        ctx.forward(meta)
        return ctx.forward(meta, **bad(ctx))

    return run


def fewer_heads(t: torch.Tensor) -> torch.Tensor:
    return t[:, : t.shape[1] // 2].contiguous()


def builder_rejects(common_of: Callable[[Ctx], object], capture: bool = False) -> Callable[[Ctx], object]:
    def run(ctx: Ctx) -> object:
        common = common_of(ctx)
        return ctx.builder.build_for_cudagraph_capture(common) if capture else ctx.builder.build(common)

    return run


def empty_batch(ctx: Ctx):
    return build_common_metadata([], [], [], ctx.spec.block_size, ctx.device)


def impl_with(**kwargs) -> Callable[[Ctx], object]:
    def run(ctx: Ctx) -> object:
        return ctx.backend.get_impl_cls()(ctx.spec, **{**ctx.impl_kwargs, **kwargs})

    return run


def fp8_spec_with_16bit_cache(ctx: Ctx) -> object:
    spec = ctx.target.spec(kv_cache_dtype="fp8")
    fp8 = Ctx(ctx.target, spec=spec)
    return fp8.forward(kv_cache=fp8.tensors["kv_cache"].to(spec.torch_dtype))


def encoder_layer(target: Target) -> Ctx:
    """An encoder layer (bidirectional, no KV cache) of the target's backend, over :data:`ENCODER_SHAPES`."""
    return Ctx(target, spec=target.spec(attn_type="encoder"), shapes=ENCODER_SHAPES)


def encoder_given_kv_cache(ctx: Ctx) -> object:
    enc = encoder_layer(ctx.target)
    cache = enc.backend.allocate_kv_cache(4, enc.spec, enc.device).zero_()
    return enc.forward(kv_cache=cache)


def encoder_batch_with_cached_context(ctx: Ctx) -> object:
    enc = encoder_layer(ctx.target)
    common = build_common_metadata([1, 5], [20, 3], [[0, 1], [2]], enc.spec.block_size, enc.device, causal=False)
    return enc.builder.build(common)


def metadata_built_for_other_heads(ctx: Ctx) -> object:
    other = ctx.target.spec(num_heads=2 * ctx.spec.num_heads)
    return ctx.forward(ctx.backend.get_builder_cls()(other, ctx.device).build(ctx.common))


def common_with_block_size(ctx: Ctx, block_size: int):
    """The catalogue's batch as build_common_metadata makes it for pages of ``block_size`` tokens."""
    query_lens = [s.query_len for s in SHAPES]
    context_lens = [s.context_len for s in SHAPES]
    pages = [-(-s.seq_len // block_size) for s in SHAPES]
    tables = [list(range(sum(pages[:i]), sum(pages[: i + 1]))) for i in range(len(SHAPES))]
    return build_common_metadata(query_lens, context_lens, tables, block_size, ctx.device)


def later_other_backends_metadata(ctx: Ctx) -> object:
    meta = ctx.build()
    ctx.forward(meta)
    return ctx.forward(ctx.other_backends_metadata())


def later_more_tokens_than_rows(ctx: Ctx) -> object:
    meta = ctx.build()
    ctx.forward(meta)
    n = ctx.num_tokens - 1
    return ctx.forward(meta, query=ctx.tensors["query"][:n], output=ctx.tensors["output"][:n])



# ---------------------------------------------------------------------------------------------------- round three
def metadata_planned_for(**features) -> Callable[[Ctx], object]:
    """The batch built by this backend's builder for the layer's spec with ``features`` changed (a window, a
    soft-cap, ALiBi, sinks, the cache dtype or the scale), run by the layer's own impl."""

    def run(ctx: Ctx) -> object:
        other = ctx.target.spec(**features)
        reasons = ctx.backend.not_supported_reasons(other, DeviceInfo.current(ctx.target.device))
        if reasons:
            pytest.skip(f"{ctx.target.backend} declines the other spec: {'; '.join(reasons)}")
        return ctx.forward(ctx.backend.get_builder_cls()(other, ctx.device).build(ctx.common))

    return run


def alibi_slopes(ctx: Ctx) -> tuple:
    return tuple(2.0 ** -(i + 1) for i in range(ctx.spec.num_heads))


def other_device(ctx: Ctx) -> str:
    """A device other than the batch's that tensors can be made on here (meta on a CPU-only machine)."""
    return "cpu" if ctx.device.type == "cuda" else "meta"


def common_with(ctx: Ctx, **tensors):
    """The catalogue's batch with some tensors replaced as an engine would hand-build it (marks cleared)."""
    return dataclasses.replace(ctx.common, **tensors)


def edited_in_place(ctx: Ctx, edit: Callable) -> object:
    """A copy of the batch as ``build_common_metadata`` marked it (checked while built), whose tensors are then
    rewritten in place by ``edit(common)``: what an engine does to a persistent batch after building it."""
    common = copy.copy(ctx.common)
    for name in ("seq_lens", "seq_lens_cpu", "slot_mapping", "block_table", "block_table_cpu",
                 "query_start_loc", "query_start_loc_cpu"):
        t = getattr(common, name)
        if t is not None:
            setattr(common, name, t.clone())
    assert common.host_checked, "the catalogue's batch comes from build_common_metadata"
    edit(common)
    return common


def shorter_seq_len_in_place(common) -> None:
    common.seq_lens_cpu[1] = 2  # request 1 has 5 new tokens
    common.seq_lens[1] = 2


def slot_edited_in_place(common) -> None:
    common.slot_mapping[0] = int(common.slot_mapping[0]) ^ 1


def host_copy_disagrees(ctx: Ctx):
    """The host copy of the block table names another (valid) page for request 0's first page."""
    host = ctx.common.block_table_cpu.clone()
    host[0, 0] = (int(host[0, 0]) + 1) % ctx.tensors["kv_cache"].shape[0]
    return common_with(ctx, block_table=ctx.common.block_table.clone(), block_table_cpu=host)


def device_table_past_cache(ctx: Ctx):
    """The table the kernels read holds a page past the cache; its host copy is fine."""
    table = ctx.common.block_table.clone()
    table[0, 0] = ctx.tensors["kv_cache"].shape[0]
    return common_with(ctx, block_table=table, block_table_cpu=ctx.common.block_table_cpu.clone())


def fresh_prefill_without_cache(ctx: Ctx) -> object:
    """A decoder layer's first step (no cached context) run with ``kv_cache=None``: its keys would never be
    cached."""
    fresh = Ctx(ctx.target, shapes=ENCODER_SHAPES)
    return fresh.forward(kv_cache=None)


def seq_lens_device_disagrees(ctx: Ctx):
    seq = ctx.common.seq_lens.clone()
    seq[0] += 3
    return common_with(ctx, seq_lens=seq, seq_lens_cpu=ctx.common.seq_lens_cpu.clone())


KINDS = [
    # First call: every tensor argument.
    Kind("query_head_count", lambda c: c.forward(query=fewer_heads(c.tensors["query"])), "query"),
    Kind("query_head_size", lambda c: c.forward(query=c.tensors["query"][..., :-8].contiguous()), "query"),
    Kind("query_dtype", lambda c: c.forward(query=c.tensors["query"].float()), "query"),
    Kind("query_not_a_tensor", lambda c: c.forward(query=c.tensors["query"].tolist()), "query"),
    Kind("query_on_meta_device", lambda c: c.forward(query=meta_like(c.tensors["query"])), "query"),
    Kind("query_last_dim_strided", lambda c: c.forward(query=strided_last_dim(c.tensors["query"])), "query"),
    Kind("query_fewer_rows_than_tokens", lambda c: c.forward(query=c.tensors["query"][:-1],
                                                             output=c.tensors["output"][:-1]), "query"),
    Kind("key_width", lambda c: c.forward(key=c.tensors["key"][..., :-8].contiguous()), "key"),
    Kind("key_on_meta_device", lambda c: c.forward(key=meta_like(c.tensors["key"])), "key"),
    Kind("key_dtype", lambda c: c.forward(key=c.tensors["key"].float()), "key"),
    Kind("key_fewer_rows_than_tokens", lambda c: c.forward(key=c.tensors["key"][:-1],
                                                           value=c.tensors["value"][:-1]), "key"),
    Kind("key_head_count", lambda c: c.forward(key=torch.cat([c.tensors["key"]] * 2, dim=1)), "key",
         layers="standard"),
    Kind("value_width", lambda c: c.forward(value=wider(c.tensors["value"])), "value"),
    Kind("value_rows_differ_from_key", lambda c: c.forward(value=c.tensors["value"][:-1]), "value"),
    Kind("key_without_value", lambda c: c.forward(value=None), "value"),
    Kind("output_on_meta_device", lambda c: c.forward(output=meta_like(c.tensors["output"])), "output"),
    Kind("output_fewer_rows_than_query", lambda c: c.forward(output=c.tensors["output"][:-1]), "output"),
    Kind("output_dtype", lambda c: c.forward(output=c.tensors["output"].float()), "output"),
    Kind("output_width", lambda c: c.forward(output=wider(c.tensors["output"])), "output"),
    Kind("output_last_dim_strided", lambda c: c.forward(output=strided_last_dim(c.tensors["output"])), "output"),
    Kind("kv_cache_dtype", lambda c: c.forward(kv_cache=other_float_dtype(c.tensors["kv_cache"])), "kv_cache"),
    Kind("kv_cache_not_a_tensor", lambda c: c.forward(kv_cache=list(c.tensors["kv_cache"].unbind(1))), "kv_cache"),
    Kind("kv_cache_on_meta_device", lambda c: c.forward(kv_cache=meta_like(c.tensors["kv_cache"])), "kv_cache"),
    Kind("kv_cache_non_contiguous", lambda c: c.forward(kv_cache=non_contiguous_cache(c.tensors["kv_cache"])),
         "kv_cache"),
    Kind("kv_cache_other_layout_same_shape", lambda c: c.forward(kv_cache=cache_of_other_layout_same_shape(c)),
         "kv_cache"),
    Kind("kv_cache_other_layout_shape", lambda c: c.forward(kv_cache=cache_of_other_layout_shape(c)), "kv_cache"),
    Kind("kv_cache_block_size", lambda c: c.forward(kv_cache=half_pages(c)), "kv_cache"),
    Kind("kv_cache_head_size", lambda c: c.forward(kv_cache=c.tensors["kv_cache"][..., :-8].contiguous()),
         "kv_cache"),
    Kind("fp8_spec_with_16bit_cache", fp8_spec_with_16bit_cache, "kv_cache"),
    # Later calls: the first call is good and records the layout; the bad one must not run on it.
    Kind("later_query_head_count", later(lambda c: dict(query=fewer_heads(c.tensors["query"]))), "query"),
    Kind("later_query_dtype", later(lambda c: dict(query=c.tensors["query"].float())), "query"),
    Kind("later_query_on_meta_device", later(lambda c: dict(query=meta_like(c.tensors["query"]))), "query"),
    Kind("later_output_shape", later(lambda c: dict(output=c.tensors["output"][..., :-8].contiguous())), "output"),
    Kind("later_output_on_meta_device", later(lambda c: dict(output=meta_like(c.tensors["output"]))), "output"),
    Kind("later_key_last_dim_strided", later(lambda c: dict(key=strided_last_dim(c.tensors["key"]))), "key"),
    Kind("later_value_dtype", later(lambda c: dict(value=c.tensors["value"].float())), "value"),
    Kind("later_kv_cache_dtype", later(lambda c: dict(kv_cache=other_float_dtype(c.tensors["kv_cache"]))),
         "kv_cache"),
    Kind("later_kv_cache_non_contiguous", later(lambda c: dict(kv_cache=non_contiguous_cache(c.tensors["kv_cache"]))),
         "kv_cache"),
    Kind("later_more_tokens_than_rows", later_more_tokens_than_rows, "query"),
    # The builder: limits and shape facts, from host integers.
    Kind("empty_batch", builder_rejects(empty_batch), "num_reqs"),
    Kind("more_tokens_than_max_num_tokens", builder_rejects(lambda c: c.common), "max_num_tokens",
         builder_kwargs=(("max_num_tokens", 5),)),
    Kind("more_requests_than_max_num_reqs", builder_rejects(lambda c: c.common), "max_num_reqs",
         builder_kwargs=(("max_num_reqs", 1),)),
    Kind("cudagraph_buffers_too_small", builder_rejects(lambda c: c.common, capture=True), "max_num_reqs",
         builder_kwargs=(("max_num_reqs", 1),)),
    Kind("slot_mapping_shorter_than_tokens", builder_rejects(
        lambda c: dataclasses.replace(c.common, slot_mapping=c.common.slot_mapping[:-1])), "slot_mapping"),
    Kind("builder_max_num_reqs_zero", lambda c: c.backend.get_builder_cls()(c.spec, c.device, max_num_reqs=0),
         "max_num_reqs"),
    Kind("builder_on_absent_device", lambda c: c.backend.get_builder_cls()(
        c.spec, "cuda" if c.device.type == "cpu" else f"cuda:{torch.cuda.device_count()}"), "device"),
    # Impl construction.
    Kind("k_scale_for_16bit_cache", impl_with(k_scale=0.5), "k_scale"),
    Kind("k_scale_not_finite", impl_with(k_scale=float("inf")), "k_scale"),
    Kind("k_scale_not_positive", impl_with(k_scale=0.0), "k_scale"),
    Kind("k_scale_tensor_of_many", impl_with(k_scale=torch.ones(2)), "k_scale"),
    Kind("v_scale_for_16bit_cache", impl_with(v_scale=2.0), "v_scale", layers="standard"),
    Kind("sinks_without_spec", impl_with(sinks=torch.zeros(4)), "sinks", layers="standard"),
    Kind("kv_b_proj_shape", lambda c: c.backend.get_impl_cls()(c.spec, kv_b_proj=c.batch.kv_b_proj[:, :-8]),
         "kv_b_proj", layers="mla"),
    # The batch against the cache: checked in debug mode (reads device tensors on the host) ...
    Kind("debug_page_id_past_cache", lambda c: c.forward(c.build(c.with_table_entry(0, 0, c.tensors["kv_cache"].shape[0]))),
         "block_table", debug=True),
    Kind("debug_negative_page_id", lambda c: c.forward(c.build(c.with_table_entry(0, c.last_page_col(0), -2))), "block_table",
         debug=True),
    Kind("debug_slot_past_cache", lambda c: c.forward(c.build(c.with_slot(2, c.num_slots))), "slot_mapping",
         debug=True),
    Kind("debug_duplicate_slots", lambda c: c.forward(c.build(c.with_slot(2, int(c.common.slot_mapping[3])))),
         "slot_mapping", debug=True),
    Kind("debug_padding_slot_below_minus_one", lambda c: c.forward(c.build(c.with_slot(1, -5))), "slot_mapping",
         debug=True),
    Kind("debug_seq_len_shorter_than_query", builder_rejects(lambda c: dataclasses.replace(
        c.common, seq_lens_cpu=torch.tensor([21, 2], dtype=torch.int32),
        seq_lens=torch.tensor([21, 2], dtype=torch.int32, device=c.device))), "seq_lens", debug=True),
    # The metadata object forward is given: what the layer's own builder built for the layer's spec.
    Kind("common_metadata_to_forward", lambda c: c.forward(c.common), "metadata"),
    Kind("other_backends_metadata", lambda c: c.forward(c.other_backends_metadata()), "metadata"),
    Kind("later_other_backends_metadata", later_other_backends_metadata, "metadata"),
    Kind("metadata_built_for_other_heads", metadata_built_for_other_heads, "num_heads"),
    # The batch against the layer's spec, in every build (host attributes, and host copies where given).
    Kind("metadata_block_size_differs", builder_rejects(lambda c: common_with_block_size(c, c.spec.block_size // 2)),
         "block_size"),
    Kind("non_causal_metadata_for_causal_layer", builder_rejects(lambda c: dataclasses.replace(c.common, causal=False)),
         "causal"),
    Kind("block_table_not_integer", builder_rejects(lambda c: dataclasses.replace(
        c.common, block_table=c.common.block_table.float(), block_table_cpu=None)), "block_table"),
    Kind("kv_cache_none_with_cached_context", lambda c: c.forward(kv_cache=None), "kv_cache"),
    Kind("encoder_layer_given_kv_cache", encoder_given_kv_cache, "kv_cache", layers="standard"),
    Kind("encoder_batch_with_cached_context", encoder_batch_with_cached_context, "seq_lens", layers="standard"),
    Kind("slot_mapping_disagrees_with_block_table", builder_rejects(
        lambda c: c.with_slot(0, int(c.common.slot_mapping[0]) ^ 1)), "slot_mapping", host_data=True),
    Kind("duplicate_slots", builder_rejects(lambda c: c.with_consistent_table_entry(1, 0, int(
        c.common.block_table_cpu[0, c.last_page_col(0)]))), "slot_mapping", host_data=True),
    Kind("seq_len_shorter_than_query", builder_rejects(lambda c: dataclasses.replace(
        c.common, seq_lens_cpu=torch.tensor([21, 2], dtype=torch.int32),
        seq_lens=torch.tensor([21, 2], dtype=torch.int32, device=c.device))), "seq_lens", host_data=True),
    Kind("debug_slot_mapping_disagrees_with_block_table", builder_rejects(
        lambda c: c.with_slot(0, int(c.common.slot_mapping[0]) ^ 1)), "slot_mapping", debug=True),
    # ... and page ids and slots on every step (the page guard), run in a child process in case one crashes.
    Kind("page_id_past_cache", lambda c: c.forward(c.build(c.with_table_entry(0, 0, c.tensors["kv_cache"].shape[0]))),
         "block_table", crash_prone=True),
    Kind("negative_page_id", lambda c: c.forward(c.build(c.with_table_entry(0, c.last_page_col(0), -2))), "block_table",
         crash_prone=True),
    Kind("slot_past_cache", lambda c: (c.forward(c.build(c.with_slot(2, c.num_slots))), c.step_boundary()),
         "slot_mapping", crash_prone=True),
    # Metadata planned for a layer spec that differs from the layer's in a feature a plan bakes in: an error on
    # every backend (the plan's origin records the features; forward compares them once per origin).
    Kind("metadata_planned_for_other_window", metadata_planned_for(sliding_window=8), "sliding_window",
         layers="standard"),
    Kind("metadata_planned_for_other_soft_cap", metadata_planned_for(logits_soft_cap=30.0), "logits_soft_cap",
         layers="standard"),
    Kind("metadata_planned_for_alibi", lambda c: metadata_planned_for(alibi_slopes=alibi_slopes(c))(c),
         "alibi_slopes", layers="standard"),
    Kind("metadata_planned_for_sinks", metadata_planned_for(has_sinks=True), "has_sinks", layers="standard"),
    Kind("metadata_planned_for_fp8_cache", metadata_planned_for(kv_cache_dtype="fp8_e5m2"), "kv_cache_dtype"),
    Kind("metadata_planned_for_other_scale", metadata_planned_for(scale=0.05), "scale"),
    # Where the batch's tensors live and what they hold: checked in every build from tensor attributes.
    Kind("block_table_on_other_device", builder_rejects(lambda c: common_with(
        c, block_table=c.common.block_table.to(other_device(c)))), "block_table"),
    Kind("seq_lens_on_other_device", builder_rejects(lambda c: common_with(
        c, seq_lens=c.common.seq_lens.to(other_device(c)))), "seq_lens"),
    Kind("host_block_table_on_other_device", builder_rejects(lambda c: common_with(
        c, block_table_cpu=c.common.block_table_cpu.to("meta" if c.device.type == "cpu" else c.device))),
        "block_table_cpu"),
    Kind("host_seq_lens_on_other_device", builder_rejects(lambda c: common_with(
        c, seq_lens_cpu=c.common.seq_lens_cpu.to("meta" if c.device.type == "cpu" else c.device))), "seq_lens_cpu"),
    Kind("block_table_int64", builder_rejects(lambda c: common_with(
        c, block_table=c.common.block_table.long(), block_table_cpu=c.common.block_table_cpu.long())), "block_table"),
    Kind("seq_lens_int64", builder_rejects(lambda c: common_with(
        c, seq_lens=c.common.seq_lens.long(), seq_lens_cpu=c.common.seq_lens_cpu.long())), "seq_lens"),
    Kind("query_start_loc_int64", builder_rejects(lambda c: common_with(
        c, query_start_loc=c.common.query_start_loc.long(), query_start_loc_cpu=c.common.query_start_loc_cpu.long())),
        "query_start_loc"),
    Kind("slot_mapping_int32", builder_rejects(lambda c: common_with(c, slot_mapping=c.common.slot_mapping.int())),
         "slot_mapping"),
    # A layer kind that keeps a KV cache, called without one (no cached context yet: its keys would be lost).
    Kind("kv_cache_none_for_decoder", fresh_prefill_without_cache, "kv_cache"),
    # The host copy and the table the kernels read: compared in build where both are on the host and no producer
    # made them together; on a GPU the device table is then scanned as well (raised at the next check point).
    Kind("host_block_table_disagrees", builder_rejects(host_copy_disagrees), "block_table_cpu", host_data=True),
    Kind("debug_host_block_table_disagrees", builder_rejects(host_copy_disagrees), "block_table_cpu", debug=True),
    Kind("device_block_table_past_cache", lambda c: (c.forward(c.build(device_table_past_cache(c))),
                                                     c.step_boundary()), "block_table", crash_prone=True),
    # A batch edited in place after build_common_metadata checked it.
    Kind("seq_len_shorter_than_query_in_place", builder_rejects(
        lambda c: edited_in_place(c, shorter_seq_len_in_place)), "seq_lens"),
    Kind("debug_slot_edited_in_place", builder_rejects(lambda c: edited_in_place(c, slot_edited_in_place)),
         "slot_mapping", debug=True),
    Kind("debug_seq_lens_device_disagrees", builder_rejects(seq_lens_device_disagrees), "seq_lens", debug=True),
]
KINDS_BY_NAME = {k.name: k for k in KINDS}
assert len(KINDS_BY_NAME) == len(KINDS), "kind names must be unique"


def _applies(kind: Kind, target: Target) -> bool:
    if kind.host_data and target.device != "cpu":
        return False
    return kind.layers == "all" or kind.layers == ("mla" if target.mla else "standard")


def _params(targets: list[Target], gpu: bool) -> list:
    out = []
    for target in targets:
        for kind in KINDS:
            if not _applies(kind, target):
                continue
            marks = [pytest.mark.gpu] if gpu else []
            if kind.xfail:
                marks.append(pytest.mark.xfail(strict=True, reason=kind.xfail))
            out.append(pytest.param(target, kind, id=f"{target.id}-{kind.name}", marks=marks))
    return out


def _message_names(message: str, argument: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(argument)}(?!\w)", message) is not None


def run_kind(target: Target, kind: Kind) -> tuple[str, str]:
    """Run one kind on one target; returns (exception type name, message), or ("", "") if nothing was raised."""
    ctx = Ctx(target, debug=kind.debug, **dict(kind.builder_kwargs))
    try:
        kind.run(ctx)
    except Exception as exc:  # the caller judges the type
        return type(exc).__name__, str(exc)
    return "", ""


def _kernel_reads_it(target: Target) -> bool:
    """Whether a bad page id or slot reaches a kernel (Triton, FlashInfer, or torch indexing on a GPU)."""
    return not (target.device == "cpu" and target.backend.startswith("reference"))


def _run_in_child(target: Target, kind: Kind) -> tuple[str, str]:
    env = dict(os.environ)
    env.setdefault("TRITON_INTERPRET", "1" if target.device == "cpu" else "0")
    # The child imports this checkout's attnbackends (run by path, its sys.path starts at tests/).
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, __file__, target.backend, target.device, kind.name],
                          capture_output=True, text=True, env=env, timeout=300)
    if proc.returncode != 0:
        raise AssertionError(f"{kind.name} crashed the process on {target.id} (exit status {proc.returncode}):\n"
                             f"{proc.stderr[-2000:]}")
    return tuple(json.loads(proc.stdout.strip().splitlines()[-1]))


def check_kind(target: Target, kind: Kind) -> None:
    if kind.crash_prone and _kernel_reads_it(target):
        raised, message = _run_in_child(target, kind)
    else:
        raised, message = run_kind(target, kind)
    assert raised, f"{kind.name} on {target.id}: no error (the bad input ran silently)"
    value_errors = ("ValidationError", "PageTableError")  # pydantic's and the page guard's ValueError subclasses
    assert raised == kind.error.__name__ or (kind.error is ValueError and raised in value_errors), (
        f"{kind.name} on {target.id}: {raised} instead of {kind.error.__name__}: {message}")
    argument = kind.argument(target)
    assert _message_names(message, argument), f"{kind.name} on {target.id}: the message does not name {argument!r}: {message}"


@pytest.mark.parametrize("target, kind", _params(CPU_TARGETS, gpu=False))
def test_bad_input_cpu(target, kind, bad_input_catalogue):
    bad_input_catalogue.add(kind.name)
    check_kind(target, kind)


@pytest.mark.parametrize("target, kind", _params(GPU_TARGETS, gpu=True))
def test_bad_input_gpu(target, kind, bad_input_catalogue):
    bad_input_catalogue.add(kind.name)
    check_kind(target, kind)


def _spec_error(**kwargs) -> Callable[[], object]:
    base = dict(num_heads=4, num_kv_heads=2, head_size=32)
    return lambda: AttentionSpec(**{**base, **kwargs})


def _unknown_backend_from_env() -> object:
    os.environ["ATTNBACKENDS_BACKEND"] = "no_such_backend"
    try:
        return select(AttentionSpec(num_heads=4, num_kv_heads=2, head_size=32), DeviceInfo.cpu(), AttentionConfig())
    finally:
        del os.environ["ATTNBACKENDS_BACKEND"]


def _allocate_zero_blocks() -> object:
    from attnbackends.reference.backend import ReferenceBackend

    return ReferenceBackend.allocate_kv_cache(0, AttentionSpec(num_heads=4, num_kv_heads=2, head_size=32))


def _absent_cuda() -> str:
    """A CUDA device this machine does not have: "cuda" without CUDA, else one past the last GPU."""
    return f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"


#: Kinds that do not depend on a backend: (name, call, exception type, the argument the message must name).
GLOBAL_KINDS = [
    ("spec_block_size_too_large", _spec_error(block_size=100000), ValueError, "block_size"),
    ("spec_block_size_zero", _spec_error(block_size=0), ValueError, "block_size"),
    ("spec_dtype_unknown_string", _spec_error(dtype="float64"), ValueError, "dtype"),
    ("spec_dtype_torch_unsupported", _spec_error(dtype=torch.int8), ValueError, "dtype"),
    ("spec_kv_cache_dtype_unknown_string", _spec_error(kv_cache_dtype="int8"), ValueError, "kv_cache_dtype"),
    ("spec_heads_not_a_multiple", _spec_error(num_heads=6, num_kv_heads=4), ValueError, "num_heads"),
    ("spec_mla_head_size", _spec_error(num_kv_heads=1, head_size=40, kv_lora_rank=32, qk_nope_head_dim=16,
                                       qk_rope_head_dim=16, v_head_dim=16), ValueError, "head_size"),
    ("spec_sliding_window_zero", _spec_error(sliding_window=0), ValueError, "sliding_window"),
    ("tolerance_for_unknown_dtype", lambda: tolerance_for("int8"), ValueError, "dtype"),
    ("tolerance_for_unknown_kv_cache_dtype", lambda: tolerance_for("float16", "int4"), ValueError,
     "kv_cache_dtype"),
    ("unknown_backend_from_environment", _unknown_backend_from_env, ValueError, "ATTNBACKENDS_BACKEND"),
    ("allocate_kv_cache_zero_blocks", _allocate_zero_blocks, ValueError, "num_blocks"),
    ("spec_scale_not_finite", _spec_error(scale=float("inf")), ValueError, "scale"),
    ("spec_soft_cap_not_finite", _spec_error(logits_soft_cap=float("inf")), ValueError, "logits_soft_cap"),
    ("spec_mla_negative_dim", lambda: AttentionSpec.mla(4, qk_rope_head_dim=-64), ValueError, "qk_rope_head_dim"),
    ("spec_mla_float_dim", lambda: AttentionSpec.mla(4, kv_lora_rank=32.5), ValueError, "kv_lora_rank"),
    ("metadata_float_query_len", lambda: build_common_metadata([1.0], [0], [[0]], 16), ValueError, "query_lens"),
    ("metadata_float_context_len", lambda: build_common_metadata([1], [2.5], [[0]], 16), ValueError,
     "context_lens"),
    ("metadata_float_block_size", lambda: build_common_metadata([1], [0], [[0]], 16.0), ValueError, "block_size"),
    ("metadata_non_integer_page_id", lambda: build_common_metadata([1], [0], [[0.7]], 16), ValueError,
     "block_tables"),
    ("metadata_negative_page_id", lambda: build_common_metadata([1], [0], [[-1]], 16), ValueError, "block_tables"),
    ("metadata_page_written_by_two_requests", lambda: build_common_metadata([1, 1], [3, 5], [[7], [7]], 16),
     ValueError, "block_tables"),
    ("metadata_on_absent_device", lambda: build_common_metadata([1], [0], [[0]], 16, _absent_cuda()), ValueError,
     "device"),
    ("device_info_of_absent_device", lambda: DeviceInfo.current(_absent_cuda()), ValueError, "device"),
]


@pytest.mark.parametrize("name, call, error, argument", GLOBAL_KINDS, ids=[k[0] for k in GLOBAL_KINDS])
def test_bad_input_global(name, call, error, argument, bad_input_catalogue, monkeypatch):
    bad_input_catalogue.add(name)
    monkeypatch.delenv("ATTNBACKENDS_BACKEND", raising=False)
    with pytest.raises(error) as info:
        call()
    assert _message_names(str(info.value), argument), f"{name}: the message does not name {argument!r}: {info.value}"


def test_catalogue_size():
    names = {k.name for k in KINDS} | {k[0] for k in GLOBAL_KINDS}
    assert len(names) == len(KINDS) + len(GLOBAL_KINDS) >= 40


if __name__ == "__main__":  # a crash-prone kind in a child process: prints [exception type, message] as JSON
    _, backend, device, kind_name = sys.argv
    target = next(t for t in CPU_TARGETS + GPU_TARGETS if t.backend == backend and t.device == device)
    print(json.dumps(run_kind(target, KINDS_BY_NAME[kind_name])))
