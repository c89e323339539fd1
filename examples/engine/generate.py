"""Greedy generation on the paged engine for a small Hugging Face transformers model, checked against transformers.

    python examples/engine/generate.py --model llama --backend auto
    python examples/engine/generate.py --model deepseek --backend triton_mla     # MLA; Triton interpreted on a CPU

The model is a transformers ``LlamaForCausalLM`` or ``DeepseekV3ForCausalLM`` built from a small config with seeded
random weights. The engine reads its weights and runs the forward itself (block allocator, continuous batching,
chunked prefill, one metadata build per step, each layer through the selected backend's impl); then transformers'
own ``generate`` (greedy) runs on the same prompts and the two are compared token for token.

Needs transformers: ``pip install 'attnbackends[dev]'``. Exit status 1 when a token differs.
"""

from __future__ import annotations

import argparse
import os
import random
import sys

import torch

if not torch.cuda.is_available():
    # Triton backends run on the CPU through the interpreter, which must be chosen before triton is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from attnbackends import AttentionConfig, BackendNotSupportedError  # noqa: E402
from attnbackends.engine import EngineConfig  # noqa: E402
from hf_models import build_hf_model, compare_with_transformers  # noqa: E402  (next to this script)
from hf_models.hf_common import require_transformers  # noqa: E402

_TRITON = ("triton", "triton_mla")
GPU_SIZES = {
    "llama": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    "deepseek": dict(
        hidden_size=256, intermediate_size=512, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=128,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    ),
}
# Below float32, transformers' logits are rounded (bf16: steps of 1/16 at 8..16) and exact ties between the top two
# tokens are common on a random model: where the runs part, transformers' margin between the two tokens must be
# within this many of its largest logit's ulps for the divergence to count as a rounding decision.
NEAR_TIE_ULPS = 2


def main(argv: "list[str] | None" = None) -> int:
    require_transformers()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("llama", "deepseek"), default="llama")
    parser.add_argument("--backend", default="auto", help='"auto" or a backend name (see `attnbackends list`)')
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument(
        "--dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"),
        help="auto: bfloat16 on CUDA; on the CPU float32, or float16 for the Triton backends (no float32 kernels)",
    )
    parser.add_argument("--prompts", type=int, default=4, help="number of prompts (lengths 1, 5, 23, 16, 40, ...)")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--token-budget", type=int, default=32, help="tokens per engine step (prefills are chunked)")
    args = parser.parse_args(argv)

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.dtype != "auto":
        dtype = getattr(torch, args.dtype)
    elif device.startswith("cuda"):
        dtype = torch.bfloat16
    else:
        dtype = torch.float16 if args.backend in _TRITON else torch.float32

    rng = random.Random(args.seed)
    lengths = [1, 5, 23, 16, 40, 64][: args.prompts] + [rng.randint(2, 60) for _ in range(max(0, args.prompts - 6))]
    # On a GPU, head sizes the fast kernels serve (Llama head_dim 64; DeepSeek-V3's MLA geometry, latent 512 + rope 64).
    overrides = GPU_SIZES[args.model] if device.startswith("cuda") else {}
    model = build_hf_model(args.model, seed=args.seed, dtype=dtype, device=device, **overrides)
    prompts = [[rng.randrange(model.config.vocab_size) for _ in range(n)] for n in lengths]
    engine_config = EngineConfig(block_size=16, num_blocks=256, max_num_batched_tokens=args.token_budget, max_num_reqs=8)
    try:
        report = compare_with_transformers(
            model, prompts, args.new_tokens, attention_config=AttentionConfig(backend=args.backend),
            engine_config=engine_config, model_name=type(model).__name__,
        )
    except BackendNotSupportedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result = report.engine
    print(f"model: {type(model).__name__} ({args.model}), {str(dtype).replace('torch.', '')} on {device}")
    print(f"backend chosen: {result.backend}")
    for prompt, ours, theirs in zip(prompts, result.tokens, report.reference_tokens):
        mark = "==" if ours == theirs else "!="
        print(f"  prompt of {len(prompt):3d} tokens -> {ours} {mark} transformers {theirs}")
    print(f"engine: {sum(map(len, result.tokens))} tokens in {result.num_steps} steps, {result.tokens_per_second:.1f} tokens/s")
    print(
        f"transformers generate: {report.tokens_identical}/{report.tokens_compared} tokens identical; "
        f"max |logit diff| {report.max_logit_diff:.3g} (largest logit {report.max_abs_logit:.3g})"
    )
    if report.all_identical:
        return 0
    ulp = torch.finfo(dtype).eps * 2.0 ** torch.tensor(report.max_abs_logit).log2().floor().item()
    if dtype != torch.float32 and all(m <= NEAR_TIE_ULPS * ulp for m in report.mismatch_margins):
        print(f"every divergence is a near-tie in transformers' {dtype} logits (margins {report.mismatch_margins})")
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
