"""transformers' continuous batching (``model.generate_batch``) on attnbackends, checked against transformers itself.

Tiny seeded models of four families (Llama, Qwen2, Gemma 3 with sliding and global layers, gpt-oss with sinks and
alternating windows) generate greedily with ``attn_implementation="paged|attnbackends"``, with transformers' own
paged attention (``paged|sdpa``; ``paged|eager`` for gpt-oss, which has no SDPA path) and with plain ``generate``
one prompt at a time. Run ``python -m examples.transformers_generate_batch [--backend NAME] [--device cuda]`` from
the checkout's root.
"""

from __future__ import annotations

import argparse
import random
import warnings
from typing import Any, Optional, Sequence

import torch

from attnbackends import AttentionConfig

__all__ = ["MODEL_KINDS", "generate_batch_tokens", "generate_tokens", "peer_implementation", "random_prompts",
           "tiny_model"]

MODEL_KINDS = ("llama", "qwen2", "gemma3", "gpt_oss")


def _llama_like(kind: str, overrides: dict[str, Any]) -> Any:
    import transformers

    kwargs: dict[str, Any] = dict(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, rms_norm_eps=1e-6,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    config_cls = transformers.LlamaConfig if kind == "llama" else transformers.Qwen2Config
    return transformers.AutoModelForCausalLM.from_config(config_cls(**kwargs), attn_implementation="eager")


def tiny_model(kind: str, *, seed: int = 0, successor_logit: float = 0.0, device: "torch.device | str" = "cpu",
               dtype: torch.dtype = torch.float32, **overrides: Any) -> torch.nn.Module:
    """A seeded tiny causal LM of ``kind`` (one of :data:`MODEL_KINDS`), eager attention, in eval mode.

    llama / qwen2: 2 layers, 4 query / 2 KV heads of 32, vocab 256 (``successor_logit`` > 0: the wide-margin model
    of :func:`examples.engine.hf_models.hf_common.seed_weights`). gemma3: 4 layers (3 sliding of window 8, 1
    global); gpt_oss: 4 layers alternating sliding (window 8) and full, with sinks (both vocab 128, see
    :mod:`examples.hybrid_hf_models`; their experts are plain float tensors, no MXFP4).
    """
    if kind in ("llama", "qwen2"):
        from examples.engine.hf_models.hf_common import seed_weights

        torch.manual_seed(seed)
        model = seed_weights(_llama_like(kind, overrides), seed, successor_logit=successor_logit)
    elif kind == "gemma3":
        from examples.hybrid_hf_models import tiny_gemma3

        model = tiny_gemma3(seed, **overrides)
    elif kind == "gpt_oss":
        from examples.hybrid_hf_models import tiny_gpt_oss

        model = tiny_gpt_oss(seed, **overrides)
    else:
        raise ValueError(f"kind must be one of {', '.join(MODEL_KINDS)}, got {kind!r}")
    return model.to(device=device, dtype=dtype).eval()


def peer_implementation(kind: str) -> str:
    """transformers' own paged implementation to compare with: ``paged|sdpa``; ``paged|eager`` for gpt-oss (its
    sinks have no SDPA path)."""
    return "paged|eager" if kind == "gpt_oss" else "paged|sdpa"


def random_prompts(lengths: Sequence[int], vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def generate_batch_tokens(model: torch.nn.Module, implementation: str, prompts: Sequence[Sequence[int]],
                          max_new_tokens: int, **cb_config: Any) -> list[list[int]]:
    """Greedy ``generate_batch`` with ``implementation``: the new tokens of every prompt, in prompt order.
    ``cb_config``: fields of transformers' ``ContinuousBatchingConfig`` (page_size, num_blocks, max_batch_tokens,
    ...)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    generation = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5.x: the "paged|" prefix is deprecated
        model.set_attn_implementation(implementation)
        out = model.generate_batch(inputs=[list(p) for p in prompts], generation_config=generation,
                                   continuous_batching_config=ContinuousBatchingConfig(**cb_config),
                                   progress_bar=False)
    by_index = {int(rid.rsplit("_", 1)[-1]): o.generated_tokens for rid, o in out.items()}
    return [list(by_index[i]) for i in range(len(prompts))]


@torch.inference_mode()
def generate_tokens(model: torch.nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                    implementation: str = "eager") -> list[list[int]]:
    """Plain greedy ``generate``, one prompt at a time, with ``implementation``: the new tokens of every prompt."""
    model.set_attn_implementation(implementation)
    device = next(model.parameters()).device
    tokens = []
    for prompt in prompts:
        ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, num_beams=1, eos_token_id=None, pad_token_id=0)
        tokens.append(out[0, len(prompt):].tolist())
    return tokens


def main(argv: Optional[Sequence[str]] = None) -> None:
    from attnbackends.integrations.transformers import register

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="auto", help='attnbackends backend ("auto" or a registered name)')
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-new-tokens", type=int, default=12)
    args = parser.parse_args(argv)
    register(AttentionConfig(backend=args.backend))
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    for kind in MODEL_KINDS:
        model = tiny_model(kind, device=args.device, dtype=dtype)
        prompts = random_prompts((1, 5, 23, 40, 16), model.config.vocab_size)
        cb = dict(page_size=16, num_blocks=64, max_batch_tokens=32)
        ours = generate_batch_tokens(model, "paged|attnbackends", prompts, args.max_new_tokens, **cb)
        peer = generate_batch_tokens(model, peer_implementation(kind), prompts, args.max_new_tokens, **cb)
        plain = generate_tokens(model, prompts, args.max_new_tokens)
        total = sum(map(len, ours))
        print(f"{kind}: {sum(a == b for x, y in zip(ours, peer) for a, b in zip(x, y))}/{total} tokens equal to "
              f"{peer_implementation(kind)}, {sum(a == b for x, y in zip(ours, plain) for a, b in zip(x, y))}/"
              f"{total} to plain generate")


if __name__ == "__main__":
    main()
