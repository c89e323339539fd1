"""triton_mla_sparse on the GPU at DeepSeek-V3.2 dims (128 heads, kv_lora_rank 512, rope 64, 64 index heads of 128,
top-k 2048, page 64) against the float64 oracle (computed on the GPU): decodes at 32k context, a prefill chunk on
cached context, both latent formats; the selection a valid top-k of the oracle's scores."""

import pytest
import torch

from attnbackends import AttentionSpec, SparseIndexerSpec, select
from attnbackends.mla.sparse.backend import TritonSparseMLABackend
from attnbackends.testing import SequenceShape as S
from tests.mla.sparse_mla_support import (
    assert_valid_selection, make_random_sparse_mla_batch, run_sparse_mla_backend, sparse_mla_oracle,
)

pytestmark = pytest.mark.gpu


def deepseek_spec(latent_format):
    return AttentionSpec.mla(128, block_size=64, dtype="bfloat16",
                             sparse_indexer=SparseIndexerSpec(latent_format=latent_format))


def test_selected_on_hopper():
    assert select(deepseek_spec("auto")).name == "triton_mla_sparse"


@pytest.mark.parametrize("latent_format", ["auto", "fp8_ds_mla"])
def test_deepseek_dims_against_oracle(latent_format):
    spec = deepseek_spec(latent_format)
    shapes = [S(1, 32767), S(1, 1500), S(2, 9000), S(48, 4000)]
    batch = make_random_sparse_mla_batch(spec, shapes, seed=1, device="cuda", pad_tokens=3)
    out, _, meta = run_sparse_mla_backend(TritonSparseMLABackend, batch)
    torch.cuda.synchronize()
    want, scores, _ = sparse_mla_oracle(batch, device="cuda")
    n = batch.num_actual_tokens
    assert torch.isnan(out[n:].float()).all(), "padding rows must stay untouched"
    # every token's chosen slots: a valid top-2048 of the oracle's float64 scores (up to float32 rounding)
    slots = meta.slots.cpu()
    bs, t = spec.block_size, 0
    for r, (s, sc) in enumerate(zip(shapes, scores)):
        pages = batch.common.block_table[r].cpu().long()
        pos_of = torch.full(((int(pages.max()) + 1) * bs,), -1, dtype=torch.long)
        pos = torch.arange(s.seq_len)
        pos_of[pages[pos // bs] * bs + pos % bs] = pos
        for row in sc.cpu():
            chosen = slots[t].long()
            chosen = torch.where(chosen >= 0, pos_of[chosen.clamp_min(0)], chosen)
            assert_valid_selection(chosen[None], row[None], 2048, atol=1e-4 * float(row[torch.isfinite(row)].abs().max()))
            t += 1
    tol = 4e-2 if latent_format == "fp8_ds_mla" else 2e-2
    torch.testing.assert_close(out[:n].double(), want, atol=tol, rtol=tol)
