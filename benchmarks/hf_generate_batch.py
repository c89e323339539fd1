"""transformers' continuous batching, tokens/s: ``generate_batch`` with ``paged|attnbackends`` against transformers'
own ``paged|sdpa`` (and ``paged|flash_attention_2`` where flash-attn is importable), in one process, on the same
model: a generated ~1B-parameter Llama-shaped config in bf16 (hidden 2048, 16 layers, 32 query / 8 KV heads of 64,
intermediate 8192, vocab 32000: 1.0B parameters, random weights), 64 prompts of 512 random tokens, 256 new tokens
each, greedy, EOS off (every request generates all of them).

Each implementation runs once untimed (a shorter generation: kernels compiled, caches warm), then ``--repeats``
timed runs; tokens/s = new tokens / the median wall time of ``generate_batch``. transformers picks its own batch
sizes (``max_batch_tokens``, cache size from free memory) the same way for every implementation; auto-switching
to flash attention is off so that ``paged|sdpa`` stays SDPA.

``python -m benchmarks.hf_generate_batch --out X.json`` (``--smoke``: a tiny model on the CPU, reference backend,
to check the script). Rows: ``{"case": "hf_generate_batch", "backend": "attnbackends", "peer": "sdpa", ...,
"tokens_per_s", "peer_tokens_per_s", "ratio": peer / ours}`` (ratio < 1: attnbackends is faster).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import warnings
from typing import Any, Optional, Sequence

import torch


def llama_1b_config(smoke: bool = False) -> Any:
    from transformers import LlamaConfig

    if smoke:
        return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                           bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=4096,
                       rope_theta=500000.0, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                       tie_word_embeddings=True)


def _generate(model, implementation: str, prompts: list[list[int]], new_tokens: int, cb: dict[str, Any]) -> float:
    """Wall seconds of one greedy generate_batch; checks every request generated ``new_tokens``."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    generation = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.set_attn_implementation(implementation)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate_batch(inputs=prompts, generation_config=generation,
                                   continuous_batching_config=ContinuousBatchingConfig(auto_switch_to_flash=False,
                                                                                       **cb),
                                   progress_bar=False)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    short = [rid for rid, o in out.items() if len(o.generated_tokens) != new_tokens]
    if len(out) != len(prompts) or short:
        raise RuntimeError(f"{implementation}: {len(out)} of {len(prompts)} requests returned, {len(short)} short "
                           "(transformers logs the failure)")
    return seconds


def _flash_attention_2_available() -> bool:
    try:
        from transformers.utils import is_flash_attn_2_available
    except ImportError:
        return False
    return bool(is_flash_attn_2_available()) and torch.cuda.is_available()


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="JSON rows to write ({'rows': [...]})")
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU (reference backend)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backend", default="auto", help="attnbackends backend (auto: the registry's choice)")
    ap.add_argument("--page-size", type=int, default=256, help="transformers' ContinuousBatchingConfig.page_size")
    args = ap.parse_args(argv)

    from attnbackends import AttentionConfig
    from attnbackends.integrations.transformers import layer_groups_for, register
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        ap.error("the full-size benchmark needs a GPU; use --smoke on the CPU")
    if args.smoke:
        args.prompts, args.prompt_len, args.new_tokens, args.repeats, args.page_size = 4, 24, 6, 1, 16
        args.backend = "reference"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    register(AttentionConfig(backend=args.backend))
    torch.manual_seed(0)
    config = llama_1b_config(args.smoke)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype).to(device).eval()
    groups = layer_groups_for(model, page_size=args.page_size)
    rng = random.Random(0)
    prompts = [[rng.randrange(config.vocab_size) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    cb: dict[str, Any] = dict(page_size=args.page_size)
    if args.smoke:  # transformers' CPU defaults size the cache (and SDPA's masks) from 60% of the host memory
        cb.update(num_blocks=64, max_batch_tokens=64)

    implementations = ["paged|attnbackends", "paged|sdpa"]
    if _flash_attention_2_available():
        implementations.append("paged|flash_attention_2")
    seconds: dict[str, float] = {}
    for impl in implementations:
        _generate(model, impl, prompts[: max(1, args.prompts // 4)], min(8, args.new_tokens), cb)  # warm-up
        runs = [_generate(model, impl, prompts, args.new_tokens, cb) for _ in range(args.repeats)]
        seconds[impl] = statistics.median(runs)
        print(f"{impl}: {args.prompts * args.new_tokens / seconds[impl]:.0f} tokens/s "
              f"(runs {', '.join(f'{s:.2f}' for s in runs)} s)", flush=True)

    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    params = sum(p.numel() for p in model.parameters())
    new = args.prompts * args.new_tokens
    ours = new / seconds["paged|attnbackends"]
    rows = []
    for impl in implementations[1:]:
        peer = new / seconds[impl]
        rows.append({
            "case": "hf_generate_batch", "backend": "attnbackends",
            "backends": ",".join(f"{g.name}={g.backend.name}" for g in groups.groups),
            "peer": impl.removeprefix("paged|"), "gpu": gpu, "dtype": str(dtype).removeprefix("torch."),
            "params": params, "prompts": args.prompts, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
            "page_size": args.page_size, "tokens_per_s": round(ours, 1), "peer_tokens_per_s": round(peer, 1),
            "ratio": round(peer / ours, 4),
        })
    for row in rows:
        print(json.dumps(row))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
