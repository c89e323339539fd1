"""A hybrid model served with two backends in one engine: sliding-window layers on one backend, global layers on
another, selected per layer group (attnbackends.LayerGroupsConfig) and checked against dense recomputation.

    python examples/hybrid_model.py                       # CPU: sliding on Triton (interpreted), global on reference
    python examples/hybrid_model.py --sliding triton --full flashinfer   # a GPU
    python examples/hybrid_model.py --config model.yaml   # pins from YAML (attention: + layer_groups: sections)

On the CPU, set TRITON_INTERPRET=1 (the script sets it when no GPU is present) and keep the model small.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from attnbackends import LayerGroupsConfig  # noqa: E402
from attnbackends.engine import EngineConfig, GroupedPagedEngine, TinyHybrid, TinyHybridConfig  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sliding", default="triton", help="backend of the sliding-window layers")
    parser.add_argument("--full", default="reference", help="backend of the global layers")
    parser.add_argument("--config", help="a YAML file with attention: / layer_groups: sections (overrides the two)")
    parser.add_argument("--window", type=int, default=24)
    parser.add_argument("--new-tokens", type=int, default=4)
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float16)
    cfg = TinyHybridConfig(vocab_size=256, hidden_size=128, num_layers=6, num_heads=4, num_kv_heads=2, head_size=64,
                           intermediate_size=256, sliding_window=args.window, global_every=3)
    model = TinyHybrid(cfg, seed=0)
    reference = TinyHybrid(cfg, seed=0).to(device)  # float32 twin for the check
    if args.config:
        pins = LayerGroupsConfig.from_file(args.config)
    else:
        pins = LayerGroupsConfig(groups={f"sliding_{args.window}": args.sliding, "full": args.full})
    engine = GroupedPagedEngine(model, EngineConfig(block_size=16, num_blocks=64, max_num_batched_tokens=64,
                                                    max_num_reqs=4), device=device, dtype=dtype,
                                attention_config=pins)
    print(engine.groups)
    prompts = [list(range(1, 50)), [7, 8, 9], list(range(100, 130))]
    result = engine.generate(prompts, args.new_tokens)
    worst = 0.0
    with torch.inference_mode():
        for prompt, tokens, logits in zip(prompts, result.tokens, result.logits):
            for i in range(len(tokens)):
                want = reference.forward_dense(torch.tensor(prompt + tokens[:i], device=device))[-1].float().cpu()
                worst = max(worst, float((logits[i] - want).abs().max()))
    ok = worst < 0.1
    print(f"backends per group: {result.backend}; {sum(map(len, result.tokens))} tokens in {result.num_steps} steps; "
          f"max |logit - float32 dense| {worst:.3g}: {'ok' if ok else 'MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
