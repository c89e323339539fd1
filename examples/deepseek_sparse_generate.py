"""Greedy generation from a DeepSeek-V3.2-shaped model (random weights, sparse MLA) on the built-in engine, checked
token for token against a recompute of every whole sequence through the reference's definition.

    python -m examples.deepseek_sparse_generate                 # auto backend: reference_mla_sparse on a CPU
    python -m examples.deepseek_sparse_generate --topk 4096     # top-k above every length: dense MLA

The engine serves :class:`~attnbackends.engine.TinyDeepseekSparse` on the auto-selected sparse MLA backend
(``triton_mla_sparse`` on a CUDA GPU of sm_89+), which keeps each layer's latent and index caches and, per query,
attends over the top-k tokens its indexer picks. The recompute runs the same model over each prompt plus its
generated tokens from scratch, without a cache: per layer the indexer scores every earlier position
(:func:`~attnbackends.reference.sparse_mla.indexer_scores` on the keys rounded as the index cache stores them),
takes the same top-k per position and attends over exactly those tokens
(:func:`~attnbackends.reference.sparse_mla.sparse_mla_attention`). Each generated token is compared with the
recompute's greedy choice at its position (teacher-forced).

The top-k is a step function of the indexer's scores: a rounding-level difference upstream (a half-precision
kernel's P.V against the recompute's float32) can swap a near-tied k-th and (k+1)-th token in a later layer, which
moves that position's logits by tenths and can flip its greedy token. The reference backend computes as the
recompute does and matches it token for token; for any backend the script exits 1 when fewer than
``MIN_AGREEMENT`` of the tokens match.
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass
from typing import Any, Optional

import torch

from attnbackends import AttentionConfig
from attnbackends.engine import EngineConfig, PagedEngine, TinyDeepseekSparse, TinyDeepseekSparseConfig
from attnbackends.ops.sparse_mla_cache import SPARSE_QUANT_BLOCK, dequantize_blockwise_fp8, quantize_blockwise_fp8
from attnbackends.reference.sparse_mla import indexer_scores, sparse_mla_attention, topk_positions
from attnbackends.spec import AttentionSpec

__all__ = ["SparseGenerationReport", "SparseRecompute", "main", "run_sparse_generation"]

BLOCK_SIZE = 16
#: The share of generated tokens that must equal the recompute's choice (module docstring).
MIN_AGREEMENT = 0.9
DEFAULT_PROMPT_LENS = (70, 33, 96, 5)


class SparseRecompute:
    """The ``attn`` of :meth:`TinyDeepseekSparse.forward` over one whole sequence (positions 0 .. L-1), no cache:
    sparse MLA as :mod:`attnbackends.reference.sparse_mla` defines it, in float32 (float64 for float64 models).

    Attributes
    ----------
    visible, selected : per call, the (query, key) pairs the causal mask allows and those the top-k kept.
    """

    def __init__(self, model: TinyDeepseekSparse, spec: AttentionSpec) -> None:
        self.model = model
        self.spec = spec
        self.visible = 0
        self.selected = 0

    def _latent(self, kv_c: torch.Tensor, k_pe: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[L, Lkv + R]: the latent vectors rounded as the latent cache stores them."""
        if self.spec.sparse_indexer.latent_format == "fp8_ds_mla":
            kv_c = dequantize_blockwise_fp8(*quantize_blockwise_fp8(kv_c, SPARSE_QUANT_BLOCK), dtype)
            return torch.cat([kv_c, k_pe.to(torch.bfloat16).to(dtype)], dim=-1)
        return torch.cat([kv_c, k_pe], dim=-1).to(dtype)

    def mla(self, layer: int, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, *, index_q: torch.Tensor,
            index_k: torch.Tensor, index_weights: torch.Tensor) -> torch.Tensor:
        """q [L, N, P + R], kv_c [L, Lkv], k_pe [L, R], index_q [L, H, D], index_k [L, D], index_weights [L, H]
        -> [L, N, V] in q's dtype."""
        spec, sparse = self.spec, self.spec.sparse_indexer
        compute = torch.float64 if q.dtype == torch.float64 else torch.float32
        length = q.shape[0]
        keys = dequantize_blockwise_fp8(*quantize_blockwise_fp8(index_k, sparse.quant_block), compute)
        scores = indexer_scores(index_q, index_weights, keys, sparse, compute)  # [L, L]
        positions = topk_positions(scores, torch.arange(length, device=q.device), sparse.topk)  # [L, topk]
        self.visible += length * (length + 1) // 2
        self.selected += int((positions >= 0).sum())
        n, p, v = spec.num_heads, spec.qk_nope_head_dim, spec.v_head_dim
        w = self.model.impl_kwargs(layer)["kv_b_proj"].view(n, p + v, spec.kv_lora_rank)
        out = sparse_mla_attention(q, self._latent(kv_c, k_pe, compute), positions, w[:, :p],
                                   w[:, p:].transpose(1, 2), spec.softmax_scale, compute)
        return out.to(q.dtype)


@dataclass
class SparseGenerationReport:
    """What :func:`run_sparse_generation` measured.

    tokens : the engine's greedy tokens per prompt; recompute_tokens : the recompute's greedy choice at each of
    those positions; first_logits : per prompt, the engine's logits [vocab] float32 of its first new token (they
    depend on the prompt only); selected_fraction : the share of causally visible (query, key) pairs the top-k
    kept in the recompute (1.0: nothing dropped).
    """

    backend: str
    device: str
    dtype: str
    topk: int
    prompt_lens: list[int]
    tokens: list[list[int]]
    recompute_tokens: list[list[int]]
    first_logits: list[torch.Tensor]
    tokens_per_second: float
    max_logit_diff: float
    selected_fraction: float

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def agreement(self) -> float:
        same = sum(a == b for x, y in zip(self.tokens, self.recompute_tokens) for a, b in zip(x, y))
        return same / max(self.num_tokens, 1)

    @property
    def identical(self) -> bool:
        return self.tokens == self.recompute_tokens


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str) -> torch.dtype:
    """float32 on a CPU; float16 on a GPU (the Triton backend takes 16-bit models; float16 rounds 8x finer than
    bfloat16, which keeps near-tied greedy choices from flipping between the two paths)."""
    return torch.float16 if device.startswith("cuda") else torch.float32


def run_sparse_generation(
    device: Optional[str] = None,
    dtype: Optional[torch.dtype] = None,
    topk: int = 16,
    prompt_lens: tuple[int, ...] = DEFAULT_PROMPT_LENS,
    max_new_tokens: int = 8,
    seed: int = 0,
    attention_config: Optional[AttentionConfig] = None,
    **model_sizes: Any,
) -> SparseGenerationReport:
    """Generate greedily through the engine, then recompute each sequence from scratch and compare (module
    docstring). ``model_sizes`` override :class:`TinyDeepseekSparseConfig` fields (``index_topk`` is ``topk``)."""
    if max_new_tokens < 1 or not prompt_lens or min(prompt_lens) < 1:
        raise ValueError(f"max_new_tokens and every prompt length must be >= 1, got {max_new_tokens}, {prompt_lens}")
    device = device or default_device()
    dtype = dtype or default_dtype(device)
    cfg = TinyDeepseekSparseConfig(index_topk=topk, **model_sizes)
    model = TinyDeepseekSparse(cfg, seed=seed)
    longest = max(prompt_lens) + max_new_tokens
    pages = len(prompt_lens) * -(-longest // BLOCK_SIZE)
    engine = PagedEngine(model, EngineConfig(block_size=BLOCK_SIZE, num_blocks=pages + 8, max_num_batched_tokens=64,
                                             max_num_reqs=len(prompt_lens)),
                         device=device, dtype=dtype, attention_config=attention_config)
    rng = random.Random(seed)
    prompts = [[rng.randrange(cfg.vocab_size) for _ in range(n)] for n in prompt_lens]
    if engine.device.type == "cuda":
        engine.generate(prompts[:2], 2)  # compiles the kernels: the timing below is steady-state
    result = engine.generate(prompts, max_new_tokens)
    recompute = SparseRecompute(engine.model, engine.spec)
    recompute_tokens, worst = [], 0.0
    with torch.inference_mode():
        for prompt, out, logits in zip(prompts, result.tokens, result.logits):
            seq = torch.tensor(prompt + out, device=engine.device)
            full = engine.model.forward(seq, torch.arange(len(seq), device=engine.device), recompute)
            chose = full[len(prompt) - 1: -1].cpu()  # the logits that chose each new token
            recompute_tokens.append(chose.argmax(-1).tolist())
            worst = max(worst, float((chose - logits).abs().max()))
    return SparseGenerationReport(
        backend=result.backend, device=str(engine.device), dtype=str(dtype).replace("torch.", ""), topk=topk,
        prompt_lens=list(prompt_lens), tokens=result.tokens, recompute_tokens=recompute_tokens,
        first_logits=[lg[0] for lg in result.logits], tokens_per_second=result.tokens_per_second,
        max_logit_diff=worst, selected_fraction=recompute.selected / max(recompute.visible, 1),
    )


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--topk", type=int, default=16, help="tokens each query attends over (default 16)")
    parser.add_argument("--new-tokens", type=int, default=8, help="tokens generated per prompt")
    parser.add_argument("--backend", default="auto", help="backend name or auto (ATTNBACKENDS_BACKEND overrides it)")
    parser.add_argument("--latent-format", default="auto", choices=["auto", "fp8_ds_mla"],
                        help="the latent cache's format (fp8_ds_mla: DeepSeek's fp8 latent)")
    args = parser.parse_args(argv)
    config = AttentionConfig.from_env(AttentionConfig(backend=args.backend))
    report = run_sparse_generation(device=args.device, topk=args.topk, max_new_tokens=args.new_tokens,
                                   attention_config=config, latent_format=args.latent_format)
    print(f"backend: {report.backend} on {report.device} ({report.dtype}), top-k {report.topk}, "
          f"prompts of {report.prompt_lens} tokens")
    print(f"selection kept {100 * report.selected_fraction:.1f}% of the causally visible (query, key) pairs")
    print(f"{report.num_tokens} new tokens: {report.tokens_per_second:.1f} tokens/s")
    print(f"agreement with the recompute: {100 * report.agreement:.1f}% of tokens identical, "
          f"max |logit diff| {report.max_logit_diff:.3g}")
    if report.agreement < MIN_AGREEMENT:
        print(f"MISMATCH: under {100 * MIN_AGREEMENT:.0f}% of the engine's tokens equal the recompute's",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
