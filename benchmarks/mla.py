"""MLA benchmarks on one GPU, every backend side by side in one process (../shared/PERF.md).

Decode (DeepSeek-V3: 128 heads, latent 512 + rope 64, page 64, bf16, pages in random order): triton_mla's kernel
against FlashInfer's BatchMLAPagedAttentionWrapper (backend "fa3", else "auto");
TFLOP/s = 2 * B * H * L * (576 + 512) / time. Prefill: the MLA prefill (up-projection, chunked context, merge) with
each installed prefill kernel at 4 x 4096 new tokens on 8192 cached tokens.

    python -m benchmarks.mla --out benchmarks/results/<gpu>-<date>-mla.json [--sweep]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import traceback

import torch
import triton
import triton.testing

from attnbackends import DeviceInfo
from attnbackends.metadata import build_common_metadata
from attnbackends.mla.backends import TritonMLABackend, TritonMLAMetadataBuilder
from attnbackends.mla.decode_kernel import (
    MLADecodeConfig, choose_num_splits, decode_descriptors, decode_kernel_name, default_decode_config, mla_decode,
)
from attnbackends.mla.prefill import available_prefill_kernels
from attnbackends.platform import package_available
from attnbackends.spec import AttentionSpec

H, LKV, R, PAGE = 128, 512, 64, 64


def bench(fn) -> float:
    """Median time in microseconds."""
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def decode_inputs(batch: int, seq_len: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages_per = math.ceil(seq_len / PAGE)
    num_pages = batch * pages_per
    cache = torch.randn(num_pages, PAGE, LKV + R, device="cuda", dtype=torch.bfloat16, generator=g)
    block_table = torch.randperm(num_pages, device="cuda", generator=g).int().view(batch, pages_per)
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device="cuda")
    ql = torch.randn(batch, H, LKV, device="cuda", dtype=torch.bfloat16, generator=g)
    qpe = torch.randn(batch, H, R, device="cuda", dtype=torch.bfloat16, generator=g)
    return cache, block_table, seq_lens, ql, qpe


def flashinfer_decode(cache, block_table, seq_lens, ql, qpe, scale):
    """(callable, backend name) running FlashInfer's MLA wrapper on the same inputs."""
    from flashinfer.mla import BatchMLAPagedAttentionWrapper

    batch, pages_per = block_table.shape
    out = torch.empty_like(ql)
    ws = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    errors = []
    for backend in ("fa3", "auto"):
        try:
            w = BatchMLAPagedAttentionWrapper(ws, backend=backend)
            w.plan(
                torch.arange(batch + 1, dtype=torch.int32),
                torch.arange(batch + 1, dtype=torch.int32) * pages_per,
                block_table.flatten(),
                seq_lens.cpu(),
                H, LKV, R, PAGE, False, scale, torch.bfloat16, torch.bfloat16,
            )
            fn = lambda: w.run(ql, qpe, cache[..., :LKV], cache[..., LKV:], out=out)  # noqa: E731
            fn()
            torch.cuda.synchronize()
            return fn, backend, out
        except Exception as exc:  # fa3 may be unavailable for this build: fall back to auto
            errors.append(f"{backend}: {type(exc).__name__}: {exc}")
    raise RuntimeError("; ".join(errors))


# block_h,block_n,num_warps,num_stages[,use_tma]; H100 2026-11-21 (pointer loads): 64,64,8,2 was fastest.
DEFAULT_SWEEP = ("64,64,8,2;64,64,8,3;64,128,8,2;64,32,8,2;"
                 "64,64,8,2,1;64,64,8,3,1;64,64,4,2,1;64,32,8,2,1;64,32,8,3,1;64,32,4,3,1;32,64,4,2,1;128,32,8,2,1")


def run_decode(rows, sweep: bool, log, sweep_configs: str = DEFAULT_SWEEP):
    scale = 1.0 / math.sqrt(192)
    sm = DeviceInfo.current().sm_count
    for batch, seq_len in ((64, 4096), (128, 8192)):
        cache, block_table, seq_lens, ql, qpe = decode_inputs(batch, seq_len)
        flops = 2 * batch * H * seq_len * (LKV + R + LKV)
        out = torch.empty_like(ql)
        cfg = default_decode_config(H)
        splits = choose_num_splits(batch, H, seq_len, sm, cfg)
        candidates = [(cfg, splits)]
        if sweep:
            for spec_ in sweep_configs.split(";"):
                fields = [int(x) for x in spec_.split(",")]
                c = MLADecodeConfig(*fields[:4], use_tma=bool(fields[4]) if len(fields) > 4 else False)
                for s in (1, 2):
                    if (c, s) not in candidates:
                        candidates.append((c, s))
        peer_us, peer_name, peer_out = None, None, None
        if package_available("flashinfer"):
            try:
                fn, peer_name, peer_out = flashinfer_decode(cache, block_table, seq_lens, ql, qpe, scale)
                peer_us = bench(fn)
            except Exception:
                log(f"flashinfer MLA failed at B={batch} L={seq_len}:\n{traceback.format_exc()}")
        results = []
        for c, s in candidates:
            try:
                kernel = decode_kernel_name(ql, qpe, cache, c, tree=False)
                desc = decode_descriptors(kernel, cache, LKV, c)  # built once, as the backend's impl does
                fn = lambda: mla_decode(ql, qpe, cache, block_table, seq_lens, out, scale=scale, num_splits=s,  # noqa: E731
                                        config=c, descriptors=desc)
                fn()
                torch.cuda.synchronize()
                us = bench(fn)
                err = float((out.float() - peer_out.float()).abs().max()) if peer_out is not None else float("nan")
                results.append((us, c, s, err, kernel))
                log(f"decode B={batch} L={seq_len} {kernel} {c} splits={s}: {us:.1f} us ({flops / us / 1e6:.0f} TFLOP/s), "
                    f"max |triton - flashinfer| = {err:.3g}")
            except Exception as exc:
                log(f"decode B={batch} L={seq_len} {c} splits={s}: failed: {type(exc).__name__}: {str(exc)[:200]}")
        default_us = results[0][0] if results and results[0][1:3] == (cfg, splits) else None
        best = min(results, key=lambda r: r[0]) if results else None
        for label, res in (("default", results[0] if default_us is not None else None), ("best", best if sweep else None)):
            if res is None:
                continue
            us, c, s, _, kernel = res
            rows.append({
                "case": "mla_decode", "backend": "triton_mla", "peer": "flashinfer_mla",
                "peer_impl": f"BatchMLAPagedAttentionWrapper(backend={peer_name!r})" if peer_name else None,
                "config": f"{label}: kernel={kernel} block_h={c.block_h} block_n={c.block_n} warps={c.num_warps} stages={c.num_stages} "
                          f"tma={c.use_tma} splits={s}",
                "B": batch, "L": seq_len, "H": H, "dtype": "bfloat16", "kv_dtype": "auto",
                "us": round(us, 2), "peer_us": round(peer_us, 2) if peer_us else None,
                "ratio": round(us / peer_us, 3) if peer_us else None,
                "TFLOPs": round(flops / us / 1e6, 1),
                "peer_TFLOPs": round(flops / peer_us / 1e6, 1) if peer_us else None,
                "max_abs_diff_vs_peer": res[3],
            })
        del cache
        torch.cuda.empty_cache()


def run_prefill(rows, log):
    spec = AttentionSpec.mla(H, dtype="bfloat16", block_size=PAGE)
    num_reqs, q_len, ctx = 4, 4096, 8192
    g = torch.Generator(device="cuda").manual_seed(1)
    pages_per = (q_len + ctx) // PAGE
    num_pages = num_reqs * pages_per
    tables = torch.randperm(num_pages, generator=torch.Generator().manual_seed(1)).view(num_reqs, pages_per).tolist()
    common = build_common_metadata([q_len] * num_reqs, [ctx] * num_reqs, tables, PAGE, "cuda")
    cache = torch.randn(num_pages, PAGE, LKV + R, device="cuda", dtype=torch.bfloat16, generator=g)
    t = num_reqs * q_len
    q = torch.randn(t, H, 192, device="cuda", dtype=torch.bfloat16, generator=g)
    kv_c = torch.randn(t, LKV, device="cuda", dtype=torch.bfloat16, generator=g)
    k_pe = torch.randn(t, R, device="cuda", dtype=torch.bfloat16, generator=g)
    w = (torch.randn(H * 256, LKV, device="cuda", generator=g) / math.sqrt(LKV)).bfloat16()
    out = torch.empty(t, H, 128, device="cuda", dtype=torch.bfloat16)
    # attention FLOPs: qk (192) and pv (128) over the context plus the causal half of the new tokens
    flops = 2 * num_reqs * H * (192 + 128) * (q_len * ctx + q_len * (q_len + 1) / 2)
    kernels = available_prefill_kernels(DeviceInfo.current(), torch.bfloat16)
    times, outs = {}, {}
    for name in kernels:
        try:
            builder = TritonMLAMetadataBuilder(spec, "cuda", prefill_backend=name)
            meta = builder.build(common)
            impl = TritonMLABackend.get_impl_cls()(spec, kv_b_proj=w)
            impl.process_weights_after_loading()
            fn = lambda: impl._forward_prefill(q, kv_c, k_pe, cache, meta.prefill, out)  # noqa: E731
            fn()
            torch.cuda.synchronize()
            outs[name] = out.clone()
            times[name] = bench(fn)
            log(f"prefill {name}: {times[name]:.0f} us ({flops / times[name] / 1e6:.0f} TFLOP/s attention), "
                f"{len(meta.prefill.chunks)} context chunk(s)")
        except Exception:
            log(f"prefill {name} failed:\n{traceback.format_exc()}")
    peer = next((n for n in ("flash_attn", "flashinfer") if n in times), None)
    for name, us in times.items():
        err = float((outs[name].float() - outs[peer].float()).abs().max()) if peer else None
        rows.append({
            "case": "mla_prefill", "backend": f"mla_prefill[{name}]", "peer": f"mla_prefill[{peer}]" if peer else None,
            "B": num_reqs, "L": q_len, "context": ctx, "H": H, "dtype": "bfloat16", "kv_dtype": "auto",
            "us": round(us, 1), "peer_us": round(times[peer], 1) if peer else None,
            "ratio": round(us / times[peer], 3) if peer else None,
            "TFLOPs": round(flops / us / 1e6, 1), "max_abs_diff_vs_peer": err,
        })


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file for the result rows")
    parser.add_argument("--sweep", action="store_true", help="also try other decode launch configs and split counts")
    parser.add_argument("--configs", default=DEFAULT_SWEEP,
                        help="decode configs to sweep: 'block_h,block_n,num_warps,num_stages[,use_tma];...'")
    parser.add_argument("--skip-prefill", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2

    def log(msg):
        print(msg, flush=True)

    log(f"device: {DeviceInfo.current().describe()}, torch {torch.__version__}, triton {triton.__version__}")
    rows: list[dict] = []
    try:
        run_decode(rows, args.sweep, log, args.configs)
        if not args.skip_prefill:
            run_prefill(rows, log)
    finally:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                       "rows": rows}, f, indent=1)
        for r in rows:
            log(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
