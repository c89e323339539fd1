"""transformers' continuous batching on attnbackends (:mod:`attnbackends.integrations.transformers`), judged by
transformers itself on CPU: greedy ``generate_batch`` with ``paged|attnbackends`` gives the same tokens as
transformers' own paged attention (``paged|sdpa``; ``paged|eager`` for gpt-oss) and as plain ``generate`` one
prompt at a time, for tiny seeded Llama, Qwen2, Gemma 3 (sliding and global layers) and gpt-oss (sinks, alternating
windows) in float32, with chunked prefill, prefix reuse and prefill-first batches; the Triton backend (interpreted,
float16) on the wide-margin Llama. Every run checks that the backend's impl served every layer and that the
metadata was built once per step.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from attnbackends import AttentionConfig, GroupedMetadataBuilder, get_backend_class  # noqa: E402
from attnbackends.integrations import transformers as integration  # noqa: E402
from examples.transformers_generate_batch import (  # noqa: E402
    generate_batch_tokens,
    generate_tokens,
    peer_implementation,
    random_prompts,
    tiny_model,
)

# A single token, shorter than a page, longer than the step budget (chunked prefill), a page boundary.
PROMPT_LENGTHS = (1, 5, 23, 40, 16)
MAX_NEW_TOKENS = 8
# Pages of 16 tokens and 32 tokens per step: the 40-token prompt is prefilled in chunks, requests join late.
CB = dict(page_size=16, num_blocks=64, max_batch_tokens=32)


class _Spy:
    """Counts the backend impl's forwards per layer, the metadata builds and the model's forward passes (steps)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, model: torch.nn.Module, backend: str) -> None:
        self.layers: list[int] = []
        self.builds = 0
        self.steps = 0
        impl_cls = get_backend_class(backend).get_impl_cls()
        forward, build = impl_cls.forward, GroupedMetadataBuilder.build
        spy = self

        def counted_forward(impl, query, key, value, kv_cache, metadata, output):
            spy.layers.append(kv_cache.data_ptr())
            return forward(impl, query, key, value, kv_cache, metadata, output)

        def counted_build(builder, common):
            spy.builds += 1
            return build(builder, common)

        monkeypatch.setattr(impl_cls, "forward", counted_forward)
        monkeypatch.setattr(GroupedMetadataBuilder, "build", counted_build)
        self._hook = model.model.register_forward_pre_hook(lambda *_: setattr(spy, "steps", spy.steps + 1))

    def close(self) -> None:
        self._hook.remove()


def _run(monkeypatch, model, backend: str, prompts, max_new_tokens: int = MAX_NEW_TOKENS, **cb):
    integration.register(AttentionConfig(backend=backend))
    spy = _Spy(monkeypatch, model, backend)
    try:
        tokens = generate_batch_tokens(model, "paged|attnbackends", prompts, max_new_tokens, **{**CB, **cb})
    finally:
        spy.close()
    assert spy.steps > 0 and spy.builds == spy.steps, f"{spy.builds} metadata builds for {spy.steps} steps"
    assert len(spy.layers) == spy.steps * model.config.num_hidden_layers
    # Every layer's cache is its own view of transformers' one cache tensor.
    assert len(set(spy.layers)) == model.config.num_hidden_layers
    return tokens


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma3", "gpt_oss"])
def test_generate_batch_matches_transformers(monkeypatch, kind):
    model = tiny_model(kind)
    prompts = random_prompts(PROMPT_LENGTHS, model.config.vocab_size, seed=1)
    ours = _run(monkeypatch, model, "reference", prompts)
    peer = generate_batch_tokens(model, peer_implementation(kind), prompts, MAX_NEW_TOKENS, **CB)
    plain = generate_tokens(model, prompts, MAX_NEW_TOKENS)
    assert all(len(t) == MAX_NEW_TOKENS for t in ours)
    assert ours == peer, f"{kind}: attnbackends {ours} vs {peer_implementation(kind)} {peer}"
    assert ours == plain, f"{kind}: attnbackends {ours} vs generate {plain}"


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_prefix_reuse(monkeypatch, kind):
    """Prompts sharing two pages: later requests take the first one's pages from transformers' prefix cache (the
    sliding layers too: they live in the full-attention allocator) and start with a cached context."""
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    model = tiny_model(kind)
    shared = random_prompts((32,), model.config.vocab_size, seed=2)[0]
    tails = random_prompts((3, 9, 1), model.config.vocab_size, seed=3)
    prompts = [shared + tails[0] + [7] * 8] + [shared + t for t in tails]
    hits = []
    search = PagedAttentionCache.search_prefix_match

    def counted_search(cache, request_id, prompt_ids):
        hits.append(search(cache, request_id, prompt_ids))
        return hits[-1]

    monkeypatch.setattr(PagedAttentionCache, "search_prefix_match", counted_search)
    ours = _run(monkeypatch, model, "reference", prompts)
    assert max(hits) >= 16, f"no prefix reuse (matched tokens per request: {hits})"
    assert ours == generate_tokens(model, prompts, MAX_NEW_TOKENS)


def test_prefill_first_batches_are_reordered(monkeypatch):
    """transformers' prefill_first scheduler puts chunked prefills before decodes; the integration permutes them
    decode-first for the backend and back."""
    model = tiny_model("gemma3")
    prompts = random_prompts(PROMPT_LENGTHS, model.config.vocab_size, seed=4)
    orders = []
    step_common = integration._step_common

    def recorded(*args, **kwargs):
        common, order = step_common(*args, **kwargs)
        orders.append(order)
        return common, order

    monkeypatch.setattr(integration, "_step_common", recorded)
    ours = _run(monkeypatch, model, "reference", prompts, scheduler_type="prefill_first", max_batch_tokens=24)
    assert any(o is not None for o in orders), "no batch needed reordering"
    assert ours == generate_tokens(model, prompts, MAX_NEW_TOKENS)


def test_triton_interpreted_matches_transformers(monkeypatch):
    """The Triton backend (TRITON_INTERPRET=1 on the CPU; float16: Triton has no float32 path) on the wide-margin
    Llama, whose greedy choices survive float16 rounding."""
    import os

    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs Triton interpreted on the CPU (the GPU twin covers CUDA)")
    model = tiny_model("llama", successor_logit=48.0, dtype=torch.float16, num_hidden_layers=1)
    prompts = random_prompts((3, 20), model.config.vocab_size, seed=5)
    ours = _run(monkeypatch, model, "triton", prompts, max_new_tokens=4)
    assert ours == generate_batch_tokens(model, "paged|sdpa", prompts, 4, **CB)


@pytest.mark.parametrize("kind", ["llama", "gpt_oss"])
def test_plain_generate_with_the_implementation(kind):
    """Outside continuous batching a model loaded with the implementation runs SDPA (or, for sinks, the dense
    fallback) and gives transformers' eager tokens."""
    integration.register(AttentionConfig(backend="reference"))
    model = tiny_model(kind)
    prompts = random_prompts((9,), model.config.vocab_size, seed=6)
    assert generate_tokens(model, prompts, 6, "attnbackends") == generate_tokens(model, prompts, 6, "eager")


def test_layer_specs_from_configs():
    gemma = tiny_model("gemma3").config
    specs = integration.transformers_layer_specs(gemma, torch.float32, 16)
    assert [s.sliding_window for s in specs] == [8, 8, 8, None]
    assert specs[0].scale == pytest.approx(gemma.query_pre_attn_scalar ** -0.5)
    oss = integration.transformers_layer_specs(tiny_model("gpt_oss").config, torch.bfloat16, 16)
    assert all(s.has_sinks for s in oss) and [s.sliding_window for s in oss] == [8, None, 8, None]
    llama = integration.transformers_layer_specs(tiny_model("llama").config, torch.float32, 16)
    assert {(s.num_heads, s.num_kv_heads, s.head_size, s.sliding_window) for s in llama} == {(4, 2, 32, None)}


def test_a_call_that_differs_from_the_spec_is_refused():
    spec = integration.transformers_layer_specs(tiny_model("llama").config, torch.float32, 16)[0]
    q, k = torch.randn(1, 4, 3, 32), torch.randn(1, 2, 3, 32)
    integration._check_call(0, spec, q, k, 32 ** -0.5, {})
    with pytest.raises(ValueError, match="scaling"):
        integration._check_call(0, spec, q, k, 0.5, {})
    with pytest.raises(ValueError, match="sliding_window"):
        integration._check_call(0, spec, q, k, None, {"sliding_window": 4})
    with pytest.raises(ValueError, match="sinks"):
        integration._check_call(0, spec, q, k, None, {"s_aux": torch.zeros(4)})
    with pytest.raises(ValueError, match="num_kv_heads"):
        integration._check_call(0, spec, q, torch.randn(1, 4, 3, 32), None, {})


@pytest.mark.parametrize("bad", [dict(name="paged|x"), dict(name="my_flash"), dict(name=""), dict(max_num_reqs=0),
                                 dict(config="triton")])
def test_register_rejects_bad_arguments(bad):
    with pytest.raises(ValueError):
        integration.register(**bad)


def test_layer_groups_for_reports_an_unservable_backend_before_generating():
    from attnbackends import BackendNotSupportedError

    integration.register(AttentionConfig(backend="flashinfer"))
    with pytest.raises(BackendNotSupportedError, match="flashinfer"):
        integration.layer_groups_for(tiny_model("llama"), page_size=16)
    integration.register(AttentionConfig(backend="reference"))
    groups = integration.layer_groups_for(tiny_model("gemma3"), page_size=16)
    assert {g.name: g.backend.name for g in groups.groups} == {"sliding_8": "reference", "full": "reference"}
