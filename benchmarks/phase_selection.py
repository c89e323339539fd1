"""Phase selection on one GPU: causal prefill per backend, and an engine-like mixed workload on every single backend
and on the measured composition, through the public API. JSON rows in PERF.md's format go to --out.

    python -m benchmarks.run --suite phase_selection                                      # GPU, results kept
    TRITON_INTERPRET=1 python -m benchmarks.phase_selection --smoke --out /tmp/smoke.json   # CPU check

Prefill: 1x8192, 4x4096, 16x1024 new tokens (32 q / 8 kv heads, head 128, page 16), every token new, one
``builder.build()`` then ``impl.forward`` (with the new K/V, written into the cache, as an engine calls it) timed
for flash_attn, flashinfer and triton, torch SDPA (dense, causal, GQA) beside
them. Mixed workload: a run of engine steps (60 decodes at 4096 context every step, 4 chunks of 512 new tokens on
2048 context every other step), each step one ``build()`` and ``forward`` for every layer, timed end to end (host
time included) per candidate: every single backend that fits, and the measured choice (from the stored profile, or
from an in-process tune when there is none) when it is a composition.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Optional

import torch

from attnbackends import AttentionConfig, AttentionSpec, DeviceInfo, explain, get_backend_class
from attnbackends.selection.tune_timing import run_tune, time_us, timing_batch, tune_candidates
from attnbackends.selection.registry import environment_facts
from attnbackends.selection.tuning import choose, default_profile_dir, load_profile

logger = logging.getLogger("phase_selection")

FULL = dict(heads=(32, 8, 128), block=16, prefill=[(1, 8192), (4, 4096), (16, 1024)], layers=8, steps=8,
            decodes=(60, 4096), chunks=(4, 512, 2048))
SMOKE = dict(heads=(4, 2, 32), block=16, prefill=[(1, 40), (2, 24)], layers=2, steps=2,
             decodes=(3, 20), chunks=(1, 9, 7))


def prefill_tflops(batch: int, length: int, heads: int, head_size: int, us: float) -> float:
    return 2 * 2 * batch * length * length * heads * head_size / 2 / (us * 1e-6) / 1e12


def time_prefill(name: str, spec: AttentionSpec, batch: int, length: int, device: torch.device) -> float:
    cls = get_backend_class(name)
    data = timing_batch(spec, [length] * batch, [0] * batch, device)
    builder = cls.get_builder_cls()(spec, device, max_num_tokens=batch * length,
                                    num_blocks=data.kv_cache.shape[0])
    impl = cls.get_impl_cls()(spec)
    metadata = builder.build(data.common)
    return time_us(lambda: data.forward(impl, metadata), device)


def time_sdpa(spec: AttentionSpec, batch: int, length: int, device: torch.device) -> float:
    shape = (batch, spec.num_heads, length, spec.head_size)
    q = torch.randn(shape, device=device, dtype=spec.torch_dtype)
    k = torch.randn(batch, spec.num_kv_heads, length, spec.head_size, device=device, dtype=spec.torch_dtype)
    v = torch.randn_like(k)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return time_us(lambda: sdpa(q, k, v, is_causal=True, enable_gqa=True), device)


def workload_steps(spec: AttentionSpec, cfg: dict, device: torch.device) -> list:
    num_decodes, decode_ctx = cfg["decodes"]
    num_chunks, chunk, chunk_ctx = cfg["chunks"]
    steps = []
    for i in range(cfg["steps"]):
        q = [1] * num_decodes + ([chunk] * num_chunks if i % 2 == 0 else [])
        c = [decode_ctx + i] * num_decodes + ([chunk_ctx + i * chunk] * num_chunks if i % 2 == 0 else [])
        steps.append(timing_batch(spec, q, c, device, seed=i))
    return steps


def time_workload(name: str, spec: AttentionSpec, steps: list, layers: int, device: torch.device) -> float:
    """Mean µs per engine step: one build and ``layers`` forwards, the whole run timed end to end."""
    cls = get_backend_class(name)
    builder = cls.get_builder_cls()(spec, device, max_num_reqs=256, max_num_tokens=8192)
    impls = [cls.get_impl_cls()(spec) for _ in range(layers)]

    def run() -> None:
        for data in steps:
            metadata = builder.build(data.common)
            for impl in impls:
                data.forward(impl, metadata)

    run()  # compiles, plans
    return time_us(run, device) / len(steps)


def measured_choice(spec: AttentionSpec, device: DeviceInfo, profile_dir: Optional[str],
                    smoke: bool) -> tuple[list[str], str]:
    """(the measured ranking, where it came from): the stored profile's, else an in-process tune's."""
    config = AttentionConfig(selection="measured", profile_dir=profile_dir)
    if device.is_cuda:
        found = load_profile(spec, device, default_profile_dir(config), environment_facts())
        if found is not None:
            result = explain(spec, device, config)
            logger.info("%s", result.measured.render())
            return result.measured.ranking, f"stored profile {found[0]}"
    profile = run_tune(spec, device, grid="tiny" if smoke else "small")
    reasons = {n: get_backend_class(n).not_supported_reasons(spec, device) for n in profile.times_us}
    choice = choose(profile, reasons, [], source="in-process tune")
    logger.info("%s", choice.render())
    return choice.ranking, "in-process tune"


def row(case: str, backend: str, peer: Optional[str], us: float, peer_us: Optional[float], spec: AttentionSpec,
        **extra) -> dict:
    out = {"case": case, "backend": backend, "peer": peer, "dtype": spec.dtype, "kv_dtype": spec.kv_cache_dtype,
           "us": round(us, 2), "peer_us": round(peer_us, 2) if peer_us else None,
           "ratio": round(us / peer_us, 4) if peer_us else None}
    out.update(extra)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file for the rows")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes (runs on the CPU: reference, interpreted Triton)")
    parser.add_argument("--profile-dir", default=None, help="where `attnbackends tune` stored its profile")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    cfg = SMOKE if args.smoke else FULL
    device = DeviceInfo.current()
    torch_device = device.torch_device
    hq, hkv, d = cfg["heads"]
    dtype = "float16" if args.smoke and not device.is_cuda else "bfloat16"
    spec = AttentionSpec(num_heads=hq, num_kv_heads=hkv, head_size=d, dtype=dtype, block_size=cfg["block"])
    singles = [n for n in tune_candidates(spec, device) if not n.startswith("phased(")]
    logger.info("device %s; backends that fit: %s", device.describe(), ", ".join(singles))
    rows = []

    prefill_backends = [n for n in ("flash_attn", "flashinfer", "triton") if n in singles] or singles
    for batch, length in cfg["prefill"]:
        sdpa_us = time_sdpa(spec, batch, length, torch_device)
        rows.append(row("prefill", "sdpa", None, sdpa_us, None, spec, B=batch, L=length,
                        TFLOPs=round(prefill_tflops(batch, length, hq, d, sdpa_us), 1)))
        timed = {}
        for name in prefill_backends:
            try:
                timed[name] = time_prefill(name, spec, batch, length, torch_device)
            except Exception as exc:  # a backend failing here is a result, not the end of the run
                logger.warning("prefill %dx%d on %s failed: %s: %s", batch, length, name, type(exc).__name__, exc)
        peer = "flashinfer" if "flashinfer" in timed else None
        for name, us in timed.items():
            rows.append(row("prefill", name, peer if peer and name != peer else "sdpa", us,
                            timed[peer] if peer and name != peer else sdpa_us, spec,
                            B=batch, L=length, TFLOPs=round(prefill_tflops(batch, length, hq, d, us), 1)))
        logger.info("prefill %dx%d: %s, sdpa %.1f µs", batch, length,
                    ", ".join(f"{n} {u:.1f} µs" for n, u in timed.items()), sdpa_us)

    ranking, source = measured_choice(spec, device, args.profile_dir, args.smoke)
    winner = ranking[0] if ranking else None
    best_pair = next((n for n in ranking if n.startswith("phased(")), None)
    logger.info("measured choice: %s; best-ranked composition: %s (%s)", winner, best_pair, source)
    steps = workload_steps(spec, cfg, torch_device)
    candidates = singles + [n for n in (winner, best_pair) if n is not None and n not in singles]
    workload = {}
    for name in candidates:
        try:
            workload[name] = time_workload(name, spec, steps, cfg["layers"], torch_device)
            logger.info("mixed workload on %s: %.1f µs per step", name, workload[name])
        except Exception as exc:
            logger.warning("mixed workload on %s failed: %s: %s", name, type(exc).__name__, exc)
    best_single = min((n for n in workload if n in singles), key=workload.get, default=None)
    for name, us in workload.items():
        rows.append(row("mixed_workload", name, best_single, us, workload.get(best_single), spec,
                        steps=cfg["steps"], layers=cfg["layers"], measured_choice=name == winner,
                        choice_source=source if name == winner else None))
    if winner in workload and best_single is not None:
        verdict = "met" if workload[winner] <= workload[best_single] else "missed"
        logger.info("measured choice %s: %.1f µs per step vs best single backend %s %.1f µs: %s",
                    winner, workload[winner], best_single, workload[best_single], verdict)

    with open(args.out, "w") as f:
        json.dump({"device": device.describe(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                   "rows": rows}, f, indent=1)
    logger.info("%d rows written to %s", len(rows), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
