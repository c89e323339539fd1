"""The ``kv_quant_greedy`` rows of the ``kv_quant_accuracy`` suite: how often the demo model's greedy tokens with a
quantised KV cache equal those with its 16-bit cache, teacher-forced.

The demo's engine and prompts (``attnbackends.engine.demo_setup``) run once with the 16-bit cache (``auto``); every
format's engine is then fed the same prompts followed by those greedy tokens
(``attnbackends.engine.teacher_forced_agreement``), and its greedy choice at each generated position is compared with
the 16-bit run's token there. fp8 per tensor and NVFP4 take per-layer scales calibrated on the 16-bit run's cache
(``calibrated_kv_scales``). The ``auto`` row feeds the 16-bit engine its own tokens: 1.0 unless its steps are not
reproducible. On a GPU: the triton backend in bfloat16; ``--smoke`` (CPU): the reference backend in float32.

Fields: ``format``, ``token_agreement`` (matches / positions), ``positions`` (generated positions over every
prompt), ``matches``, ``first_divergence`` (the earliest continuation index at which some prompt's choice differs;
null where none does), ``prompts``, ``new_tokens`` (per prompt), ``kv_scales`` (how per-tensor scales were set).
"""

from __future__ import annotations

import json
from typing import Sequence

import torch

from attnbackends import AttentionConfig
from attnbackends.engine import calibrated_kv_scales, teacher_forced_agreement
from attnbackends.engine.demo_setup import demo_engine, demo_prompts
from attnbackends.spec import dtype_name, kv_cache_format

__all__ = ["greedy_rows"]


def greedy_rows(formats: Sequence[str], device: torch.device, smoke: bool, num_prompts: int,
                new_tokens: int) -> list[dict]:
    """One row per format (``auto`` first, the control) of the demo model's teacher-forced greedy agreement with
    its 16-bit cache; printed as JSON lines as they come."""
    backend, dtype = ("reference", torch.float32) if smoke else ("triton", torch.bfloat16)
    config = AttentionConfig(backend=backend)
    peer = "reference_float32" if smoke else "triton_bf16"
    base = demo_engine(str(device), dtype, config, seed=0)
    prompts = demo_prompts(base.model.cfg.vocab_size, num_prompts, seed=0)
    reference = base.generate(prompts, new_tokens).tokens
    rows = []
    for fmt in ("auto", *formats):
        calibrate = fmt != "auto" and kv_cache_format(fmt).uses_tensor_scale
        scales = calibrated_kv_scales(base.kv_caches, fmt) if calibrate else None
        engine = base if fmt == "auto" else demo_engine(str(device), dtype, config, seed=0, kv_cache_dtype=fmt,
                                                        kv_scales=scales)
        agree = teacher_forced_agreement(engine, prompts, reference)
        rows.append({"case": "kv_quant_greedy", "backend": engine.backend.name, "peer": peer,
                     "format": fmt, "kv_dtype": fmt, "dtype": dtype_name(dtype), "prompts": len(prompts),
                     "new_tokens": new_tokens, "positions": agree.positions, "matches": agree.matches,
                     "token_agreement": agree.agreement, "first_divergence": agree.first_divergence,
                     "kv_scales": "calibrated (absmax of the unquantised run's cache)" if calibrate else None})
        print(json.dumps(rows[-1]), flush=True)
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows
