"""Masked decodes over a cached context through the public API, side by side in one process (``mask_decode`` rows):

- ``mask_decode`` / ``triton`` / ``triton_causal``: a decode batch of a layer with a mask kind (non-causal over the
  cache, causal plus image spans in the context, a custom bit mask) against our causal decode of the same batch
  (same queries, same pages): the masked layer's decodes run on the unified kernel with uniform KV splits, the
  causal one on its default schedule;
- ``mask_decode`` / ``triton`` / ``flashinfer``: the same batch on FlashInfer where it serves the mask: its
  ``BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True)`` for non-causal and spans (a single decode token at
  the end of its sequence sees the same keys under causal, non-causal and context spans) and its
  ``BatchPrefillWithPagedKVCacheWrapper`` with ``custom_mask`` for the custom mask (its decode wrapper takes no
  mask), driven directly.

    python -m benchmarks.run --suite mask_decode                         # GPU, results kept
    python -m benchmarks.mask_decode --smoke --out /tmp/mask_decode.json  # CPU: tiny shapes, Triton interpreted

Each request decodes one token after ``L`` cached keys (pages shuffled). The custom mask is a document mask: the
decode sees the first quarter of its context (a shared prompt) and the second half (its own document), not the
rest. Ours: ``build()`` once, ``impl.forward(q, None, None, kv_cache, metadata, out)`` timed. ``ratio`` = our time
over the peer's (decodes read every page whatever the mask: time, not time per visible pair); ``GBps``: K and V
bytes of the whole context over the time; ``max_abs_diff``: ours against FlashInfer.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .mask_prefill import MaskSuiteRun, time_us


def masks_for(context: int) -> dict:
    """Mask name -> (AttentionMask, spans of each request or None)."""
    from attnbackends.spec import AttentionMask

    image = max(context // 8, 4)
    spans = [(context // 16, context // 16 + image), (context // 2, context // 2 + image)]
    return {
        "non_causal": (AttentionMask(kind="non_causal"), None),
        "spans": (AttentionMask(kind="causal_spans"), spans),
        "custom": (AttentionMask(kind="custom"), None),
    }


def document_mask(seq_len: int) -> torch.Tensor:
    """[1, seq_len] bool: the last token sees keys [0, L/4) and [L/2, seq_len)."""
    row = torch.zeros(1, seq_len, dtype=torch.bool)
    row[0, : seq_len // 4] = True
    row[0, seq_len // 2:] = True
    return row


class DecodeBatch:
    """``batch`` decodes after ``context`` cached keys each: queries and a paged cache, pages shuffled."""

    def __init__(self, *, batch: int, context: int, heads: tuple[int, int], head_size: int, block: int, dtype: str,
                 device: str, seed: int = 0):
        self.batch, self.seq, self.heads, self.head_size, self.block = batch, context + 1, heads, head_size, block
        self.dtype, self.device = dtype, device
        self.pages = -(-self.seq // block)
        self.table = torch.randperm(batch * self.pages, generator=torch.Generator().manual_seed(seed)).reshape(
            batch, self.pages).tolist()
        g = torch.Generator(device=device).manual_seed(seed)
        t = torch.bfloat16 if dtype == "bfloat16" else torch.float16
        self.query = torch.randn(batch, heads[0], head_size, generator=g, device=device, dtype=t)
        self.kv_cache = torch.randn(batch * self.pages, 2, block, heads[1], head_size, generator=g, device=device,
                                    dtype=t)
        self.kv_bytes = 2 * batch * self.seq * heads[1] * head_size * self.kv_cache.element_size()


class MaskedLayer:
    """``data``'s decodes for a layer with ``mask`` (and the requests' ``spans``, kind causal_spans)."""

    def __init__(self, data: DecodeBatch, mask, spans):
        from attnbackends import AttentionSpec, build_common_metadata
        from attnbackends.masks import with_custom_masks, with_spans
        from attnbackends.spec import MaskKind

        self.data = data
        self.spec = AttentionSpec(num_heads=data.heads[0], num_kv_heads=data.heads[1], head_size=data.head_size,
                                  dtype=data.dtype, block_size=data.block, mask=mask)
        common = build_common_metadata([1] * data.batch, [data.seq - 1] * data.batch, data.table, data.block,
                                       data.device, causal=self.spec.causal)
        self.custom = document_mask(data.seq) if mask.kind is MaskKind.CUSTOM else None
        if mask.kind is MaskKind.CAUSAL_SPANS:
            common = with_spans(common, [spans] * data.batch)
        if self.custom is not None:
            common = with_custom_masks(common, [self.custom] * data.batch)
        self.common = common

    def ours(self) -> tuple[Callable[[], object], torch.Tensor]:
        from attnbackends.selection.registry import get_backend_class

        data = self.data
        cls = get_backend_class("triton")
        builder = cls.get_builder_cls()(self.spec, data.device, max_num_reqs=data.batch)
        impl = cls.get_impl_cls()(self.spec)
        meta = builder.build(self.common)
        out = torch.empty_like(data.query)
        fn = lambda: impl.forward(data.query, None, None, data.kv_cache, meta, out)  # noqa: E731
        fn()
        return fn, out

    def flashinfer(self) -> tuple[Callable[[], object], torch.Tensor]:
        import flashinfer

        data, spec = self.data, self.spec
        block, pages, device, dtype = data.block, data.pages, data.device, data.query.dtype
        table = torch.tensor(data.table, dtype=torch.int32, device=device).reshape(-1)
        kv_indptr = torch.arange(0, (data.batch + 1) * pages, pages, dtype=torch.int32, device=device)
        last = torch.full((data.batch,), data.seq - (pages - 1) * block, dtype=torch.int32, device=device)
        workspace = torch.empty(256 << 20, dtype=torch.uint8, device=device)
        out = torch.empty_like(data.query)
        if self.custom is None:
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
            wrapper.plan(kv_indptr, table, last, spec.num_heads, spec.num_kv_heads, spec.head_size, block,
                         pos_encoding_mode="NONE", q_data_type=dtype, kv_data_type=dtype)
        else:
            wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
            qo = torch.arange(0, data.batch + 1, dtype=torch.int32, device=device)
            mask = self.custom.to(device).reshape(-1).repeat(data.batch)
            wrapper.plan(qo, kv_indptr, table, last, spec.num_heads, spec.num_kv_heads, spec.head_size, block,
                         causal=False, custom_mask=mask, q_data_type=dtype, kv_data_type=dtype)
        fn = lambda: wrapper.run(data.query, data.kv_cache, out=out)  # noqa: E731
        fn()
        return fn, out


def main(argv: Optional[list[str]] = None) -> int:
    run = MaskSuiteRun(argv, __doc__, gpu_shapes=[dict(batch=64, context=4096), dict(batch=8, context=16384)],
                       cpu_shapes=[dict(batch=2, context=40)])
    from attnbackends.spec import AttentionMask

    cuda, device, shapes, layer, emit, rows = run.cuda, run.device, run.shapes, run.layer, run.emit, run.rows
    has_flashinfer = run.has_flashinfer

    for shape in shapes:
        data = DecodeBatch(device=device, **shape, **layer)
        causal_us = time_us(MaskedLayer(data, AttentionMask(), None).ours()[0], cuda)
        gbps = lambda us: data.kv_bytes / (us * 1e-6) / 1e9  # noqa: E731
        for name, (mask, spans) in masks_for(shape["context"]).items():
            setup = MaskedLayer(data, mask, spans)
            base = {"case": "mask_decode", "mask": name, "B": shape["batch"], "L": shape["context"],
                    "dtype": layer["dtype"], "kv_dtype": "auto", "backend": "triton"}
            try:
                fn, ours_out = setup.ours()
                us = time_us(fn, cuda)
                emit({**base, "peer": "triton_causal", "us": us, "peer_us": causal_us, "ratio": us / causal_us,
                      "GBps": gbps(us), "peer_GBps": gbps(causal_us)})
            except Exception as exc:  # one failing row must not cost the others
                emit({**base, "peer": "triton_causal", "error": repr(exc)[:300]})
                continue
            if not has_flashinfer:
                continue
            try:
                fn, peer_out = setup.flashinfer()
                peer_us = time_us(fn, cuda)
                emit({**base, "peer": "flashinfer", "us": us, "peer_us": peer_us, "ratio": us / peer_us,
                      "GBps": gbps(us), "peer_GBps": gbps(peer_us),
                      "peer_path": "decode wrapper" if setup.custom is None else "prefill wrapper custom_mask",
                      "max_abs_diff": float((ours_out.float() - peer_out.float()).abs().max())})
            except Exception as exc:
                emit({**base, "peer": "flashinfer", "error": repr(exc)[:300]})
    if not rows:
        emit({"case": "mask_decode", "error": "no rows"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
