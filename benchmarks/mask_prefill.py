"""Masked prefill through the public API, side by side in one process (PERF.md ``mask_prefill`` rows):

- ``mask_prefill`` / ``triton`` / ``triton_causal``: each mask kind (bidirectional image spans, block-causal, a
  two-sided window, non-causal) against our causal prefill of the same batch, on equal useful work;
- ``mask_prefill`` / ``triton`` / ``flashinfer``: the same mask as FlashInfer's custom mask
  (``BatchPrefillWithPagedKVCacheWrapper.plan(custom_mask=...)``, driven directly), where FlashInfer is installed;
  for kind ``custom`` (the spans mask given as bits) both sides read the same bits;
- ``mask_prefill`` / ``flashinfer`` / ``flashinfer_causal`` for kind ``custom``: FlashInfer's custom-mask prefill
  against its own causal prefill, on equal useful work.

    python -m benchmarks.run --suite mask_prefill                        # GPU, results kept
    python -m benchmarks.mask_prefill --smoke --out /tmp/mask.json       # CPU: tiny shapes, Triton interpreted

Every query token is new and its keys are already in the paged cache (pages shuffled): ours is ``build()`` once and
``impl.forward(q, None, None, kv_cache, metadata, out)`` timed (the Gluon paged prefill serves the causal layer,
the unified kernel the masked ones), FlashInfer's ``run(q, kv_cache)``. Useful work is the visible (query, key)
pairs: ``TFLOPs = 4 * pairs * num_heads * head_size / time``; ``ratio`` is our time per pair over the peer's
(<= 1.11 meets ">= 0.9 x the causal TFLOP/s"). ``max_abs_diff``: ours against the peer where both compute the same
mask.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch


def time_us(fn: Callable[[], object], cuda: bool) -> float:
    if cuda:
        import triton

        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[1] * 1e6


def masks_for(seq: int, cuda: bool) -> dict:
    """Mask name -> (AttentionMask, spans per request or None)."""
    from attnbackends.spec import AttentionMask

    image = max(seq // 4, 8)
    spans = [(seq // 16, seq // 16 + image), (seq // 2, seq // 2 + image // 2)]
    window = (1023, 127) if cuda else (7, 3)
    return {
        "spans": (AttentionMask(kind="causal_spans"), spans),
        "block_causal": (AttentionMask(kind="block_causal", block_len=64 if cuda else 4), None),
        "window_two_sided": (AttentionMask(kind="non_causal", window=window), None),
        "non_causal": (AttentionMask(kind="non_causal"), None),
        "custom": (AttentionMask(kind="custom"), spans),
    }


class Setup:
    """``batch`` fresh prompts of ``seq`` tokens for a layer with ``mask``, keys in a shuffled paged cache."""

    def __init__(self, mask, spans, *, batch: int, seq: int, heads: tuple[int, int], head_size: int, block: int,
                 dtype: str, device: str, seed: int = 0):
        from attnbackends import AttentionSpec, build_common_metadata
        from attnbackends.masks import dense_visibility, with_custom_masks, with_spans
        from attnbackends.spec import AttentionMask, MaskKind

        self.spec = AttentionSpec(num_heads=heads[0], num_kv_heads=heads[1], head_size=head_size, dtype=dtype,
                                  block_size=block, mask=mask)
        self.device = device
        g = torch.Generator(device=device).manual_seed(seed)
        pages = -(-seq // block)
        perm = torch.randperm(batch * pages, generator=torch.Generator().manual_seed(seed)).reshape(batch, pages)
        common = build_common_metadata([seq] * batch, [0] * batch, perm.tolist(), block, device,
                                       causal=self.spec.causal)
        # kind custom: the spans mask, given as bits
        vis_spec = self.spec if mask.kind is not MaskKind.CUSTOM else self.spec.model_copy(
            update={"mask": AttentionMask(kind="causal_spans")})
        self.visible = dense_visibility(vis_spec, torch.arange(seq), seq, spans=spans or ())
        if mask.kind is MaskKind.CAUSAL_SPANS:
            common = with_spans(common, [spans] * batch)
        if mask.kind is MaskKind.CUSTOM:
            common = with_custom_masks(common, [self.visible] * batch)
        self.common = common
        self.pairs = int(self.visible.sum()) * batch
        t = torch.bfloat16 if dtype == "bfloat16" else torch.float16
        self.query = torch.randn(batch * seq, heads[0], head_size, generator=g, device=device, dtype=t)
        self.kv_cache = torch.randn(batch * pages, 2, block, heads[1], head_size, generator=g, device=device, dtype=t)
        self.batch, self.seq = batch, seq

    def ours(self, backend: str) -> tuple[Callable[[], object], torch.Tensor]:
        from attnbackends.selection.registry import get_backend_class

        cls = get_backend_class(backend)
        builder = cls.get_builder_cls()(self.spec, self.device, max_num_tokens=max(8192, self.batch * self.seq))
        impl = cls.get_impl_cls()(self.spec)
        meta = builder.build(self.common)
        out = torch.empty_like(self.query)
        fn = lambda: impl.forward(self.query, None, None, self.kv_cache, meta, out)  # noqa: E731
        fn()
        return fn, out

    def flashinfer(self, causal: bool) -> tuple[Callable[[], object], torch.Tensor]:
        import flashinfer

        spec, block = self.spec, self.spec.block_size
        pages = -(-self.seq // block)
        table = self.common.block_table[:, :pages].reshape(-1).to(torch.int32)
        qo = torch.arange(0, (self.batch + 1) * self.seq, self.seq, dtype=torch.int32, device=self.device)
        kv_indptr = torch.arange(0, (self.batch + 1) * pages, pages, dtype=torch.int32, device=self.device)
        last = torch.full((self.batch,), self.seq - (pages - 1) * block, dtype=torch.int32, device=self.device)
        workspace = torch.empty(256 << 20, dtype=torch.uint8, device=self.device)
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        mask = None if causal else self.visible.to(self.device).reshape(-1).repeat(self.batch)
        wrapper.plan(qo, kv_indptr, table, last, spec.num_heads, spec.num_kv_heads, spec.head_size, block,
                     causal=causal, custom_mask=mask, q_data_type=self.query.dtype, kv_data_type=self.query.dtype)
        out = torch.empty_like(self.query)
        fn = lambda: wrapper.run(self.query, self.kv_cache, out=out)  # noqa: E731
        fn()
        return fn, out


class MaskSuiteRun:
    """What both mask suites start from: the command line (``--out``, ``--smoke``), the device, the layer and shapes
    (GPU or CPU smoke), whether FlashInfer runs here, and ``emit`` (each row printed and the JSON rewritten)."""

    def __init__(self, argv: Optional[list[str]], doc: str, gpu_shapes: list[dict], cpu_shapes: list[dict]) -> None:
        ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
        ap.add_argument("--out", required=True, help="JSON file to write (PERF.md rows)")
        ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: Triton interpreted")
        args = ap.parse_args(argv)
        if args.smoke:
            os.environ.setdefault("TRITON_INTERPRET", "1")
        from attnbackends.platform import package_available

        self.cuda = torch.cuda.is_available() and not args.smoke
        self.device = "cuda" if self.cuda else "cpu"
        self.shapes = gpu_shapes if self.cuda else cpu_shapes
        self.layer = (dict(heads=(32, 8), head_size=128, block=16, dtype="bfloat16") if self.cuda
                      else dict(heads=(4, 2), head_size=32, block=16, dtype="float16"))
        self.has_flashinfer = self.cuda and package_available("flashinfer")
        self.gpu = torch.cuda.get_device_name() if self.cuda else "cpu"
        self.rows: list[dict] = []
        self._out = Path(args.out)
        self._command = " ".join([Path(sys.argv[0]).name] + (argv or sys.argv[1:]))

    def emit(self, row: dict) -> None:
        self.rows.append(row)
        print(json.dumps(row), flush=True)
        self._out.write_text(json.dumps({"gpu": self.gpu, "date": time.strftime("%Y-%m-%d"), "command": self._command,
                                         "rows": self.rows}, indent=1))


def main(argv: Optional[list[str]] = None) -> int:
    run = MaskSuiteRun(argv, __doc__, gpu_shapes=[dict(batch=1, seq=8192), dict(batch=4, seq=4096)],
                       cpu_shapes=[dict(batch=2, seq=40)])
    from attnbackends.spec import AttentionMask

    cuda, device, shapes, layer, emit, rows = run.cuda, run.device, run.shapes, run.layer, run.emit, run.rows
    has_flashinfer = run.has_flashinfer

    def tflops(pairs: int, us: float) -> float:
        return 4.0 * pairs * layer["heads"][0] * layer["head_size"] / (us * 1e-6) / 1e12

    for shape in shapes:
        causal = Setup(AttentionMask(), None, device=device, **shape, **layer)
        causal_fn, _ = causal.ours("triton")
        causal_us = time_us(causal_fn, cuda)
        fi_causal_us = time_us(causal.flashinfer(True)[0], cuda) if has_flashinfer else None
        for name, (mask, spans) in masks_for(shape["seq"], cuda).items():
            setup = Setup(mask, spans, device=device, **shape, **layer)
            base = {"case": "mask_prefill", "mask": name, "B": shape["batch"], "L": shape["seq"],
                    "dtype": layer["dtype"], "kv_dtype": "auto", "pairs": setup.pairs}
            ours_out = None
            try:
                fn, ours_out = setup.ours("triton")
                us = time_us(fn, cuda)
                emit({**base, "backend": "triton", "peer": "triton_causal", "us": us, "peer_us": causal_us,
                      "TFLOPs": tflops(setup.pairs, us), "peer_TFLOPs": tflops(causal.pairs, causal_us),
                      "ratio": (us / setup.pairs) / (causal_us / causal.pairs)})
            except Exception as exc:  # one failing row must not cost the others
                emit({**base, "backend": "triton", "peer": "triton_causal", "error": repr(exc)[:300]})
                ours_out = None
            if not has_flashinfer:
                continue
            try:
                fn, peer_out = setup.flashinfer(False)
                peer_us = time_us(fn, cuda)
                if name == "custom":
                    emit({**base, "backend": "flashinfer", "peer": "flashinfer_causal", "us": peer_us,
                          "peer_us": fi_causal_us, "TFLOPs": tflops(setup.pairs, peer_us),
                          "peer_TFLOPs": tflops(causal.pairs, fi_causal_us),
                          "ratio": (peer_us / setup.pairs) / (fi_causal_us / causal.pairs)})
                if ours_out is not None:
                    emit({**base, "backend": "triton", "peer": "flashinfer", "us": us, "peer_us": peer_us,
                          "TFLOPs": tflops(setup.pairs, us), "peer_TFLOPs": tflops(setup.pairs, peer_us),
                          "ratio": us / peer_us,
                          "max_abs_diff": float((ours_out.float() - peer_out.float()).abs().max())})
            except Exception as exc:
                emit({**base, "backend": "triton", "peer": "flashinfer", "error": repr(exc)[:300]})
    if not rows:
        emit({"case": "mask_prefill", "error": "no rows"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
