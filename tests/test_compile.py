"""A model whose attention goes through the custom op compiles with fullgraph=True and matches eager."""

import itertools

import pytest
import torch

from attnbackends import AttentionSpec, build_common_metadata
from attnbackends.compile import AttentionLayer, forward_context
from attnbackends.reference.backend import ReferenceBackend

_ids = itertools.count()


class TinyAttentionModel(torch.nn.Module):
    def __init__(self, spec, layers):
        super().__init__()
        hidden = spec.num_heads * spec.head_size
        self.spec = spec
        self.qkv = torch.nn.Linear(hidden, (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_size)
        self.attn = torch.nn.ModuleList(layers)

    def forward(self, x):
        s = self.spec
        for attn in self.attn:
            q, k, v = self.qkv(x).split([s.num_heads * s.head_size, s.num_kv_heads * s.head_size, s.num_kv_heads * s.head_size], -1)
            o = attn(q.view(-1, s.num_heads, s.head_size), k.view(-1, s.num_kv_heads, s.head_size), v.view(-1, s.num_kv_heads, s.head_size))
            x = x + o.reshape(x.shape)
        return x


def _build(spec, num_layers=2):
    impl_cls = ReferenceBackend.get_impl_cls()
    layers = [
        AttentionLayer(f"compile-test-{next(_ids)}", impl_cls(spec), ReferenceBackend.allocate_kv_cache(8, spec).normal_())
        for _ in range(num_layers)
    ]
    torch.manual_seed(0)
    return TinyAttentionModel(spec, layers)


def test_fullgraph_compile_matches_eager():
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=16, dtype="float32", block_size=16)
    eager, compiled_src = _build(spec), _build(spec)
    compiled_src.load_state_dict(eager.state_dict())
    for a, b in zip(eager.attn, compiled_src.attn):
        b.kv_cache.copy_(a.kv_cache)
    compiled = torch.compile(compiled_src, fullgraph=True, backend="aot_eager")
    builder = ReferenceBackend.get_builder_cls()(spec)
    for step, (query_lens, context_lens) in enumerate([([5, 3], [0, 0]), ([1, 1], [5, 3])]):
        common = build_common_metadata(query_lens, context_lens, [[0, 1], [2, 3]], 16)
        x = torch.randn(sum(query_lens), spec.num_heads * spec.head_size, generator=torch.Generator().manual_seed(step))
        with forward_context(builder.build(common)):
            want = eager(x)
            got = compiled(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(eager.attn, compiled_src.attn):
        torch.testing.assert_close(b.kv_cache, a.kv_cache)  # the op's hidden cache writes happened


@pytest.mark.gpu
def test_fullgraph_inductor_compile_with_triton_matches_eager():
    """The Triton backend behind the custom op: inductor, fullgraph=True, on the GPU; equal to eager."""
    from attnbackends.triton.backend import TritonAttentionBackend

    device = "cuda"
    spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=64, dtype="bfloat16", block_size=16)

    def build():
        layers = [
            AttentionLayer(
                f"compile-test-{next(_ids)}",
                TritonAttentionBackend.get_impl_cls()(spec),
                TritonAttentionBackend.allocate_kv_cache(16, spec, device).normal_(),
            )
            for _ in range(2)
        ]
        torch.manual_seed(0)
        return TinyAttentionModel(spec, layers).to(device=device, dtype=torch.bfloat16)

    eager, compiled_src = build(), build()
    compiled_src.load_state_dict(eager.state_dict())
    for a, b in zip(eager.attn, compiled_src.attn):
        b.kv_cache.copy_(a.kv_cache)
    compiled = torch.compile(compiled_src, fullgraph=True, backend="inductor")
    builder = TritonAttentionBackend.get_builder_cls()(spec, device)
    steps = [([5, 30], [0, 0], [[0, 1], [2, 3]]), ([1, 1], [5, 30], [[0, 1], [2, 3]]), ([1, 17], [31, 0], [[2, 3, 6], [4, 5]])]
    for step, (query_lens, context_lens, tables) in enumerate(steps):
        common = build_common_metadata(query_lens, context_lens, tables, 16, device)
        x = torch.randn(sum(query_lens), spec.num_heads * spec.head_size, device=device, dtype=torch.bfloat16,
                        generator=torch.Generator(device).manual_seed(step))
        with forward_context(builder.build(common)):
            want = eager(x)
            got = compiled(x)
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    for a, b in zip(eager.attn, compiled_src.attn):
        torch.testing.assert_close(b.kv_cache, a.kv_cache)
