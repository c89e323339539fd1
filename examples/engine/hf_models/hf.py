"""The engine judged by Hugging Face ``transformers``: build a small seeded model, serve it on the paged engine with
a backend, and compare with transformers' own greedy ``generate``, token for token and logit by logit.

``transformers`` is an optional dependency, imported only by the functions that need it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from attnbackends.spec import AttentionConfig
from attnbackends.engine import EngineConfig, GenerationResult, PagedEngine
from .hf_common import seed_weights, tiny_deepseek_v3_config, tiny_llama_config
from .hf_deepseek import HFDeepseekV3Model
from .hf_llama import HFLlamaModel

__all__ = [
    "HF_MODEL_KINDS",
    "MARGIN_SUCCESSOR_LOGIT",
    "HFComparison",
    "build_hf_model",
    "compare_with_transformers",
    "transformers_greedy",
    "wrap_hf_model",
]

HF_MODEL_KINDS = ("llama", "deepseek")
# successor_logit of the wide-margin model (build_hf_model). Measured on the GPU test configs (hidden 256, vocab
# 256, prompts of 1..250 tokens, 16 greedy steps, seeds 0-4, CPU bf16 as the proxy for GPU bf16): top logits ~30-60,
# smallest top-2 margin 7-19 (median ~30) against bf16 logit errors <= 0.4, so every token equal between bf16 and
# float32; the random part of the logits keeps std ~4 (top ~11), and a context change moves a token's logits by ~12.
MARGIN_SUCCESSOR_LOGIT = 48.0


def build_hf_model(
    kind: str,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: "torch.device | str" = "cpu",
    *,
    successor_logit: float = 0.0,
    **config_overrides,
) -> nn.Module:
    """A small transformers model with seeded random weights (see :func:`~hf_models.hf_common.seed_weights`).

    kind : "llama" (``LlamaForCausalLM``) or "deepseek" (``DeepseekV3ForCausalLM``, MLA + MoE).
    successor_logit : 0 for the plain random model, whose greedy choices are often near-ties that bf16 rounding
        decides. ``MARGIN_SUCCESSOR_LOGIT`` gives the wide-margin model: the same weights plus a seeded successor
        bigram in the LM head that wins each greedy step by many bf16 rounding steps, so bf16 runs give the same
        tokens as float32 ones. On it, identical tokens rule out gross errors only (the choice is the successor
        of the current token whatever attention returns); the logit tolerance is what checks attention, whose
        context-dependent contribution still moves every logit. Other discrete choices in the model keep their
        near-ties: DeepSeek's MoE router picks a group of experts per token, and where two groups nearly tie bf16
        rounding can flip the pick, which moves that position's logits by several units (tokens unchanged on this
        model); routing every token to every expert (``n_group=1, topk_group=1, num_experts_per_tok=`` the number
        of experts) removes that choice.
    config_overrides : fields of the config (e.g. ``num_hidden_layers=4``).
    """
    from transformers import DeepseekV3ForCausalLM, LlamaForCausalLM

    if kind == "llama":
        config, cls = tiny_llama_config(**config_overrides), LlamaForCausalLM
    elif kind == "deepseek":
        config, cls = tiny_deepseek_v3_config(**config_overrides), DeepseekV3ForCausalLM
    else:
        raise ValueError(f"kind {kind!r} is not one of: {', '.join(HF_MODEL_KINDS)}")
    config._attn_implementation = "eager"  # the plainest transformers attention is the judge
    torch.manual_seed(seed)
    model = cls(config)
    seed_weights(model, seed, successor_logit=successor_logit)
    return model.to(device=device, dtype=dtype).eval()


def wrap_hf_model(hf_model: nn.Module) -> nn.Module:
    """The engine adapter for a transformers causal LM, by ``config.model_type``."""
    model_type = getattr(hf_model.config, "model_type", "")
    if model_type == "deepseek_v3":
        return HFDeepseekV3Model(hf_model)
    if model_type in ("llama", "mistral", "qwen2"):
        return HFLlamaModel(hf_model)
    raise NotImplementedError(f"no engine adapter for model_type {model_type!r}; supported: llama, deepseek_v3")


@torch.inference_mode()
def transformers_greedy(hf_model: nn.Module, prompts: list[list[int]], max_new_tokens: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """transformers' ``generate`` (greedy, no EOS stop), one prompt at a time so no padding is involved.

    Returns the new tokens per prompt and the logits that chose them ([new_tokens, vocab] float32, on the CPU).
    """
    device = next(hf_model.parameters()).device
    tokens, logits = [], []
    for prompt in prompts:
        ids = torch.tensor([prompt], dtype=torch.long, device=device)
        out = hf_model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, min_new_tokens=None,
            do_sample=False, num_beams=1, return_dict_in_generate=True, output_logits=True,
            eos_token_id=None, pad_token_id=0,
        )
        tokens.append(out.sequences[0, len(prompt):].tolist())
        logits.append(torch.stack([step[0] for step in out.logits]).float().cpu())
    return tokens, logits


@dataclass
class HFComparison:
    """The engine's greedy generation against transformers' for the same prompts."""

    model: str
    backend: str
    dtype: str
    device: str
    num_prompts: int
    tokens_compared: int
    tokens_identical: int
    first_mismatch: Optional[tuple[int, int]]  # (prompt, position) of the first differing token, None if none
    max_logit_diff: float  # over the positions up to each prompt's first mismatch (same context on both sides)
    max_abs_logit: float
    # Per prompt that diverges: how far transformers' own logits put the engine's token below its choice there.
    # A divergence with a margin below the logit error is a near-tie that rounding decided, not a wrong token.
    mismatch_margins: list[float]
    # The smallest gap between transformers' top two logits over the same steps as max_logit_diff: with
    # max_logit_diff, how close the run came to a greedy choice that rounding could flip.
    min_top2_margin: float
    engine: GenerationResult
    reference_tokens: list[list[int]]
    transformers_seconds: float

    @property
    def all_identical(self) -> bool:
        return self.tokens_identical == self.tokens_compared

    def summary(self) -> str:
        ties = ""
        if self.mismatch_margins:
            ties = f"; diverging prompts' transformers margins {[round(m, 3) for m in self.mismatch_margins]}"
        return (
            f"{self.model} on {self.device} ({self.dtype}), backend {self.backend}: {self.tokens_identical}/"
            f"{self.tokens_compared} tokens identical to transformers' generate over {self.num_prompts} prompts; "
            f"max |logit diff| {self.max_logit_diff:.3g} (logits up to {self.max_abs_logit:.3g}), smallest top-2 margin "
            f"{self.min_top2_margin:.3g}{ties}"
        )


def compare_with_transformers(
    hf_model: nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    attention_config: Optional[AttentionConfig] = None,
    engine_config: EngineConfig = EngineConfig(block_size=16, num_blocks=64, max_num_batched_tokens=32, max_num_reqs=8),
    model_name: str = "",
) -> HFComparison:
    """Generate greedily with transformers, then with the paged engine over the same model object, and compare.

    The model stays where it is (device and dtype); the engine runs in the model's dtype.
    """
    param = next(hf_model.parameters())
    start = time.perf_counter()
    ref_tokens, ref_logits = transformers_greedy(hf_model, prompts, max_new_tokens)
    hf_seconds = time.perf_counter() - start
    engine = PagedEngine(
        wrap_hf_model(hf_model), engine_config, device=param.device, dtype=param.dtype, attention_config=attention_config
    )
    result = engine.generate(prompts, max_new_tokens)
    compared = identical = 0
    first = None
    worst = scale = 0.0
    min_margin = float("inf")
    margins: list[float] = []
    for i, (ours, theirs, our_logits, their_logits) in enumerate(zip(result.tokens, ref_tokens, result.logits, ref_logits)):
        compared += len(theirs)
        same = 0
        while same < len(theirs) and same < len(ours) and ours[same] == theirs[same]:
            same += 1
        identical += sum(a == b for a, b in zip(ours, theirs))
        if same < len(theirs):
            first = first or (i, same)
            if same < len(ours):
                margins.append(float(their_logits[same].max() - their_logits[same, ours[same]]))
        n = min(same + 1, len(theirs), len(ours))  # the first differing step still saw the same context
        worst = max(worst, float((our_logits[:n] - their_logits[:n]).abs().max()))
        scale = max(scale, float(their_logits[:n].abs().max()))
        if n:
            top2 = their_logits[:n].topk(2, dim=-1).values
            min_margin = min(min_margin, float((top2[:, 0] - top2[:, 1]).min()))
    return HFComparison(
        model=model_name or hf_model.config.model_type,
        backend=result.backend,
        dtype=str(param.dtype).replace("torch.", ""),
        device=str(param.device),
        num_prompts=len(prompts),
        tokens_compared=compared,
        tokens_identical=identical,
        first_mismatch=first,
        max_logit_diff=worst,
        max_abs_logit=scale,
        mismatch_margins=margins,
        min_top2_margin=min_margin,
        engine=result,
        reference_tokens=ref_tokens,
        transformers_seconds=hf_seconds,
    )
