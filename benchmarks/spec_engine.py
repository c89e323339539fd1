"""Speculative decoding end to end on the compact engine: acceptance length and tokens/s with and without
speculation, per backend and drafter, greedy tokens checked identical (issue 16, point 4).

The model is the wide-margin Llama of the engine's GPU checks (``build_hf_model("llama", successor_logit=
MARGIN_SUCCESSOR_LOGIT)``, hidden 256, 4 query / 2 KV heads of 64, bf16 on the GPU): its greedy choices win by many
bf16 rounding steps, so a speculative run must give exactly the plain run's tokens. Its greedy path after a token is
that token's seeded successor chain; each prompt quotes a stretch of the chain it will generate (a document the
answer repeats), so the n-gram drafter finds real continuations, and ends on a token of that stretch.

Drafters: ``ngram`` (prompt lookup, 2 branches x 3 tokens) and ``draft_model`` (a 1-layer model with the same
seed, so the same successor table: top-2 first tokens, each continued greedily to 3 tokens; it runs its own dense
forward per proposed token, without a cache, and that time counts in tokens/s). Verify batches carry a tree mask.

    python -m benchmarks.run --suite spec_engine                                          # GPU, bf16, results kept
    python -m benchmarks.spec_engine --smoke --out /tmp/spec-engine                        # CPU, float32, tiny

Writes ``spec_engine.json`` under ``--out`` (one row per backend and drafter, plus the plain run's rows) and prints
the rows as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Optional

import torch

LLAMA = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


def successor_chain(model: torch.nn.Module, token: int, n: int, device: str) -> list[int]:
    """The model's greedy continuation of ``token`` alone, ``n`` tokens (its successor chain)."""
    chain = [token]
    with torch.inference_mode():
        for _ in range(n):
            chain.append(int(model(torch.tensor([chain], device=device)).logits[0, -1].argmax()))
    return chain[1:]


def make_prompts(model, num_prompts: int, device: str, seed: int = 0) -> list[list[int]]:
    """Random text quoting ``num`` tokens of the successor chain that follows its last token."""
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    prompts = []
    for _ in range(num_prompts):
        last = rng.randrange(vocab)
        quote = successor_chain(model, last, 24, device)
        prompts.append([rng.randrange(vocab) for _ in range(rng.randint(8, 64))] + [last] + quote
                       + [rng.randrange(vocab) for _ in range(rng.randint(4, 16))] + [last])
    return prompts


def draft_model_drafter(dtype: torch.dtype, device: str, margin: float):
    from attnbackends.engine.speculative import DraftModelDrafter
    from examples.engine.hf_models import build_hf_model

    draft = build_hf_model("llama", seed=0, dtype=dtype, device=device, successor_logit=margin,
                           **{**LLAMA, "num_hidden_layers": 1})

    @torch.inference_mode()
    def next_logits(tokens: list[int]) -> torch.Tensor:
        return draft(torch.tensor([tokens], device=device)).logits[0, -1].float()

    return DraftModelDrafter(next_logits, num_branches=2, depth=3)


def run(hf, prompts, backend: str, new_tokens: int, engine_config, speculative=None):
    from attnbackends import AttentionConfig
    from attnbackends.engine import PagedEngine
    from examples.engine.hf_models import wrap_hf_model

    param = next(hf.parameters())
    engine = PagedEngine(wrap_hf_model(hf), engine_config, device=param.device, dtype=param.dtype,
                         attention_config=AttentionConfig(backend=backend), speculative=speculative)
    # warm-up: the same run once untimed, so that every kernel specialisation the timed run meets (batch shapes,
    # split counts, tree and verify variants) is compiled before it, whichever configuration runs first
    engine.generate(prompts, new_tokens)
    return engine.generate(prompts, new_tokens)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for spec_engine.json")
    ap.add_argument("--smoke", action="store_true", help="CPU, float32, reference backend, a few tokens")
    ap.add_argument("--backends", nargs="*", default=None,
                    help="backends to run (default: triton flashinfer on the GPU, reference with --smoke)")
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--num-speculative-tokens", type=int, default=6)
    args = ap.parse_args(argv)

    from attnbackends import AttentionConfig, DeviceInfo, explain
    from attnbackends.engine import EngineConfig
    from attnbackends.engine.speculative import NgramDrafter, SpeculativeConfig
    from examples.engine.hf_models import build_hf_model, wrap_hf_model
    from examples.engine.hf_models.hf import MARGIN_SUCCESSOR_LOGIT

    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        print("no CUDA GPU: run with --smoke on the CPU", file=sys.stderr)
        return 2
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    backends = args.backends or (["triton", "flashinfer"] if cuda else ["reference"])
    num_prompts = args.num_prompts or (8 if cuda else 3)
    new_tokens = args.new_tokens or (64 if cuda else 10)
    engine_config = EngineConfig(block_size=16, num_blocks=512, max_num_batched_tokens=256 if cuda else 96,
                                 max_num_reqs=num_prompts)
    hf = build_hf_model("llama", seed=0, dtype=dtype, device=device, successor_logit=MARGIN_SUCCESSOR_LOGIT, **LLAMA)
    prompts = make_prompts(hf, num_prompts, device)
    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    k = args.num_speculative_tokens
    drafters = {
        "ngram": lambda: NgramDrafter(num_branches=2, depth=3),
        "draft_model": lambda: draft_model_drafter(dtype, device, MARGIN_SUCCESSOR_LOGIT),
    }
    rows = []
    for backend in backends:
        spec = wrap_hf_model(hf).attention_spec(dtype, engine_config.block_size).model_copy(
            update={"num_speculative_tokens": k, "speculative_tree": True})
        reasons = {r.name: r.reasons for r in explain(spec, DeviceInfo.current(torch.device(device)),
                                                      AttentionConfig()).rows}.get(backend)
        if reasons:
            rows.append({"backend": backend, "skipped": "; ".join(reasons)})
            print(json.dumps(rows[-1]), flush=True)
            continue
        plain = run(hf, prompts, backend, new_tokens, engine_config)
        base = {"case": "spec_engine", "gpu": gpu, "backend": backend, "dtype": str(dtype).removeprefix("torch."), "prompts": num_prompts,
                "new_tokens": new_tokens, "num_speculative_tokens": k}
        rows.append({**base, "peer": None, "drafter": None, "tokens_per_s": round(plain.tokens_per_second, 1),
                     "steps": plain.num_steps, "seconds": round(plain.seconds, 4)})
        print(json.dumps(rows[-1]), flush=True)
        for name, make in drafters.items():
            result = run(hf, prompts, backend, new_tokens, engine_config, SpeculativeConfig(make(), k))
            stats = result.speculative
            rows.append({
                **base, "peer": "no_speculation", "drafter": name, "tokens_identical": result.tokens == plain.tokens,
                "acceptance_length": round(stats.acceptance_length, 3), "verify_steps": stats.verify_steps,
                "branching_steps": stats.branching_steps, "draft_tokens": stats.draft_tokens,
                "accepted_tokens": stats.accepted_tokens, "steps": result.num_steps,
                "tokens_per_s": round(result.tokens_per_second, 1),
                "speedup_vs_plain": round(result.tokens_per_second / plain.tokens_per_second, 3),
                # throughput: the peer's tokens/s over ours, as PERF.md's rows of tokens/s
                "ratio": round(plain.tokens_per_second / result.tokens_per_second, 3),
                "seconds": round(result.seconds, 4),
            })
            print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python -m benchmarks.spec_engine " + " ".join(argv if argv is not None else sys.argv[1:])
    (out / "spec_engine.json").write_text(json.dumps(
        {"gpu": gpu, "date": time.strftime("%Y-%m-%d"), "command": command, "rows": rows}, indent=1))
    mismatched = [r for r in rows if r.get("tokens_identical") is False]
    if mismatched:
        print(f"greedy tokens differ with speculation: {mismatched}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
