"""The built-in engine on its demo model, decode-heavy: tokens/s with decode steps from CUDA graphs against every
step eager, and whether the tokens are the same.

    python -m benchmarks.run --suite engine_graphs              # on the GPU host: results/ and RESULTS.md
    python -m benchmarks.engine_graphs --out rows.json           # the rows alone (CUDA)
    python -m benchmarks.engine_graphs --cpu-smoke               # no GPU: a tiny run of the code (eager both ways)

The run: the demo's model (:class:`attnbackends.engine.TinyLlama`, bfloat16) with ``--prompts`` seeded prompts of
8 to 64 tokens and ``--new-tokens`` generated per prompt, all admitted at once (``max_num_reqs`` = prompts), so
after a few prefill steps every step decodes every running request. Each engine first runs a short generation
(compiles kernels and captures its graphs), then the timed one; ``tokens_per_s`` is the timed generation's.

Row (PERF.md ``engine_graphs`` / ``graphs`` / ``eager``): ``us`` and ``peer_us`` the timed generation's seconds x
1e6, ``tokens_per_s`` and ``peer_tokens_per_s``, ``speedup`` = graphs / eager tokens/s (target >= 2), ``ratio`` =
eager tokens/s / graphs tokens/s; ``graph_steps`` / ``eager_steps`` of the graphs engine, ``tokens_identical``
(graphs vs eager), ``backend_used`` (the attention backend), ``cuda_graphs_reason`` where graphs were off.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

from attnbackends.engine import EngineConfig, PagedEngine, TinyLlama, TinyLlamaConfig
from attnbackends.spec import dtype_name

from .report import write_rows

__all__ = ["main", "measure"]


def _prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(8, 64))] for _ in range(n)]


def measure(device: str, dtype: torch.dtype, num_prompts: int, new_tokens: int) -> dict:
    """The row of one eager run and one graphs run of the same generation."""
    cfg = TinyLlamaConfig()
    prompts = _prompts(num_prompts, cfg.vocab_size, 0)
    pages = num_prompts * -(-(64 + new_tokens) // 16) + 16
    config = EngineConfig(block_size=16, num_blocks=pages, max_num_batched_tokens=512, max_num_reqs=num_prompts)
    results, engines = {}, {}
    for label, graphs in (("eager", False), ("graphs", None)):
        engine = PagedEngine(TinyLlama(cfg, seed=0), config, device=device, dtype=dtype, cuda_graphs=graphs)
        engine.generate(prompts, 4)  # compiles kernels; the graphs engine captures the sizes it steps through
        engine.generate(prompts[: max(1, num_prompts // 3)], 3)
        engine.graph_steps = engine.eager_steps = 0
        results[label] = engine.generate(prompts, new_tokens)
        engines[label] = engine
    eager, graphs = results["eager"], results["graphs"]
    engine = engines["graphs"]
    return {
        "case": "engine_graphs", "backend": "graphs", "peer": "eager", "backend_used": graphs.backend,
        "device": device, "dtype": dtype_name(dtype), "prompts": num_prompts, "new_tokens": new_tokens,
        "B": num_prompts, "us": round(graphs.seconds * 1e6, 1), "peer_us": round(eager.seconds * 1e6, 1),
        "tokens_per_s": round(graphs.tokens_per_second, 1), "peer_tokens_per_s": round(eager.tokens_per_second, 1),
        "speedup": round(graphs.tokens_per_second / eager.tokens_per_second, 3),
        "ratio": round(eager.tokens_per_second / graphs.tokens_per_second, 3),
        "steps": graphs.num_steps, "graph_steps": engine.graph_steps, "eager_steps": engine.eager_steps,
        "captured_sizes": sorted(engine.graphs.graphs) if engine.graphs is not None else [],
        "cuda_graphs_reason": engine.cuda_graphs_reason or None,
        "tokens_identical": graphs.tokens == eager.tokens,
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.engine_graphs", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="JSON rows to write (PERF.md format)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--cpu-smoke", dest="cpu_smoke", action="store_true", help="no GPU: 4 prompts, 4 tokens, float32")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        rows = [measure("cpu", torch.float32, 4, 4)]
    elif not torch.cuda.is_available():
        print("the engine_graphs suite needs a CUDA GPU (use --cpu-smoke for a check of its code)", file=sys.stderr)
        return 2
    else:
        rows = [measure("cuda", torch.bfloat16, args.prompts, args.new_tokens)]
    if args.out:
        write_rows(args.out, rows)
    for r in rows:
        print(json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
