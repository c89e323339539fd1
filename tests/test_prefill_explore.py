"""CPU (interpreter) checks of the prefill candidates in benchmarks/prefill_explore.py against the float64 oracle.

Tiny shapes: head 32 / 64, block size 16, shuffled pages, a chunked prefill with cached context, a plain
prefill, a one-token query and a sequence whose length is not a multiple of the tiles. Outputs are poisoned
with NaN first, so a row a kernel forgets to write fails the check.
"""

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CPU interpreter checks; the GPU runs the script itself", allow_module_level=True)

os.environ.setdefault("TRITON_INTERPRET", "1")

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "prefill_explore.py"
_spec = importlib.util.spec_from_file_location("prefill_explore", _PATH)
pe = importlib.util.module_from_spec(_spec)
sys.modules["prefill_explore"] = pe  # dataclasses look their module up by name
_spec.loader.exec_module(pe)

# One config per candidate family (small tiles: the interpreter is slow), with the loop options that change
# what the kernel computes under compilation only (warp specialisation, loop stages) exercised for the
# argument plumbing.
CASES = [
    pe.Config("A", 32, 16, 4, 3),
    pe.Config("A", 32, 32, 4, 3),
    pe.Config("B", 32, 16, 4, 3, rows_per_tok=0),
    pe.Config("C", 32, 32, 4, 3, loop_ws=True),
    pe.Config("C", 32, 32, 4, 3, loop_stages=4),
    pe.Config("C", 32, 32, 4, 3, tma=True, kv_tma=True, loop_ws=True),
    pe.Config("D", 32, 32, 4, 3, tma=True, kv_tma=True),
    pe.Config("D", 32, 64, 4, 3, tma=True, kv_tma=True),
    pe.Config("D", 32, 16, 4, 3, tma=True),
    pe.Config("E", 32, 16, 4, 3, programs_per_sm=1),
    pe.Config("F", 32, 16, 4, 3, tma=True, new_kv=True),
    pe.Config("F", 32, 32, 4, 3, tma=True, new_kv=True, loop_ws=True),
    pe.Config("G", 32, 16, 4, 3, single_loop=True, loop_ws=True),
]
NO_CONTEXT = [(40, 0), (33, 0), (1, 0), (20, 0)]

SEQS = [(40, 23), (33, 0), (1, 17), (20, 48)]  # (query_len, context_len)


@pytest.fixture(scope="module", autouse=True)
def _allocator():
    pe.set_tma_allocator("cpu")


# Head 32 with GQA 2 for every config; head 64 without GQA for the two load paths (pointer rows, TMA pages).
PARAMS = [(c, 32, 4, 2) for c in CASES] + [(CASES[0], 64, 2, 1), (CASES[6], 64, 2, 1)]


@pytest.mark.parametrize("cfg,head_size,num_heads,num_kv_heads", PARAMS,
                         ids=[f"{c.label.replace(' ', '_')}-d{d}" for c, d, _, _ in PARAMS])
def test_candidate_matches_oracle(cfg, head_size, num_heads, num_kv_heads):
    seqs = NO_CONTEXT if cfg.single_loop else SEQS
    b = pe.PagedBatch(seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size, block_size=16,
                      dtype=torch.float32, device="cpu", seed=head_size)
    out = torch.full_like(b.query, float("nan"))
    pe.make_launch(cfg, b, out)()
    ref = pe.reference(b, torch.float64)
    mad, rel = pe.compare(out, ref)
    assert rel < 1e-5, f"{cfg.label}: max|diff| {mad:.3e}, rel {rel:.3e}"


def test_work_list_heaviest_first():
    b = pe.PagedBatch([(40, 0), (10, 100), (70, 5)], num_heads=2, num_kv_heads=1, head_size=32, block_size=16,
                      dtype=torch.float32, device="cpu")
    work = b.work_list(16).tolist()
    keys = [b.seq_lens_host[s] - b.q_lens[s] + min((q + 1) * 16, b.q_lens[s]) for s, q in work]
    assert keys == sorted(keys, reverse=True)
    expected = {(s, q) for s, n in enumerate(b.q_lens) for q in range(-(-n // 16))}
    assert set(map(tuple, work)) == expected and len(work) == len(expected)


def test_family_configs_are_distinct_and_quick_is_first():
    for fam in "ABCDEFG":
        full = pe.family_configs(fam, quick=False)
        assert len({c.label for c in full}) == len(full)
        assert pe.family_configs(fam, quick=True) == full[:1]
    with pytest.raises(ValueError, match="family"):
        pe.family_configs("Z", quick=False)


def test_single_loop_kernel_rejects_cached_context():
    b = pe.PagedBatch([(8, 4)], num_heads=2, num_kv_heads=1, head_size=32, block_size=16, dtype=torch.float32,
                      device="cpu")
    with pytest.raises(ValueError, match="without cached context"):
        pe.make_launch(pe.Config("G", 32, 16, 4, 3, single_loop=True), b, torch.empty_like(b.query))
