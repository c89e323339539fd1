"""Gemma 3's image-token mask through transformers' continuous batching on attnbackends
(:func:`attnbackends.integrations.transformers.mark_image_tokens`), judged by transformers on CPU in float32.

transformers' continuous batching takes no ``token_type_ids`` and its text-only ``Gemma3ForCausalLM`` builds no
image mask, so the peer is the tiny text model with eager attention over the masks transformers' own multimodal
Gemma 3 builds from ``token_type_ids`` (``create_masks_for_vision_model`` over ``get_block_sequence_ids_for_mask``:
full layers OR(causal, image block), sliding layers AND(window, OR(causal, image block))), recomputed without a cache
for every new token (generated tokens are text, as in transformers' ``generate``).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from attnbackends import AttentionConfig  # noqa: E402
from attnbackends.integrations import transformers as integration  # noqa: E402
from attnbackends.spec import MaskKind  # noqa: E402
from examples.transformers_generate_batch import generate_batch_tokens, random_prompts, tiny_model  # noqa: E402

IMAGE = 5  # the image token id of the test
NEW_TOKENS = 8
# Prompts are never split inside an image (max_batch_tokens covers every prompt of a step).
CB = dict(page_size=16, num_blocks=64, max_batch_tokens=64)


def _prompts(vocab: int) -> list[list[int]]:
    prompts = [[t if t != IMAGE else IMAGE + 1 for t in p] for p in random_prompts((12, 30, 20), vocab, seed=1)]
    prompts[0][2:9] = [IMAGE] * 7  # one image inside the window of every layer
    prompts[1][3:6] = [IMAGE] * 3  # two images, the second longer than the sliding window (8)
    prompts[1][10:22] = [IMAGE] * 12
    prompts[2][19:20] = [IMAGE]  # a one-token image ending the prompt: causal
    return prompts


@torch.inference_mode()
def _transformers_tokens(model, prompt: list[int], new_tokens: int) -> list[int]:
    from transformers.models.gemma3.modeling_gemma3 import (
        create_masks_for_vision_model,
        get_block_sequence_ids_for_mask,
    )

    model.set_attn_implementation("eager")
    seq = list(prompt)
    token_types = [int(t == IMAGE) for t in prompt]
    for _ in range(new_tokens):
        ids = torch.tensor([seq])
        types = torch.tensor([token_types + [0] * (len(seq) - len(token_types))])
        masks = create_masks_for_vision_model(
            config=model.config, inputs_embeds=model.model.embed_tokens(ids), attention_mask=None, cache=None,
            position_ids=torch.arange(len(seq))[None], block_sequence_ids=get_block_sequence_ids_for_mask(types))
        seq.append(int(model(input_ids=ids, attention_mask=masks).logits[0, -1].argmax()))
    return seq[len(prompt):]


def test_image_spans_match_transformers_token_type_ids_mask(monkeypatch):
    model = tiny_model("gemma3")
    prompts = _prompts(model.config.vocab_size)
    want = [_transformers_tokens(model, p, NEW_TOKENS) for p in prompts]

    spans_seen = []
    with_spans = integration.with_spans

    def recorded(common, spans):
        spans_seen.append(spans)
        return with_spans(common, spans)

    monkeypatch.setattr(integration, "with_spans", recorded)
    integration.register(AttentionConfig(backend="reference"))
    handle = integration.mark_image_tokens(model, IMAGE)
    try:
        groups = integration.layer_groups_for(model, page_size=16)
        assert {g.spec.mask.kind for g in groups.groups} == {MaskKind.CAUSAL_SPANS}
        ours = generate_batch_tokens(model, "paged|attnbackends", prompts, NEW_TOKENS, **CB)
    finally:
        handle.remove()
    assert ours == want, f"attnbackends {ours} vs transformers' token_type_ids mask {want}"
    # the prefill step carried the images as spans (absolute positions)
    seen = {tuple(s) for step in spans_seen for s in step if s}
    assert ((2, 9),) in seen and ((3, 6), (10, 22)) in seen, seen
    # the mask matters: plain causal attention gives other tokens
    causal = generate_batch_tokens(model, "paged|sdpa", prompts, NEW_TOKENS, **CB)
    assert causal != want


def test_image_span_specs_keep_the_sliding_window_on_the_left():
    config = tiny_model("gemma3").config
    specs = integration.transformers_layer_specs(config, torch.float32, 16, image_spans=True)
    assert all(s.mask.kind is MaskKind.CAUSAL_SPANS and s.sliding_window is None for s in specs)
    assert [s.window for s in specs] == [(7, config.max_position_embeddings)] * 3 + [None]
    q, k = torch.randn(1, 4, 3, 32), torch.randn(1, 2, 3, 32)
    integration._check_call(0, specs[0], q, k, None, {"sliding_window": 8})  # the call's window is the left side
    with pytest.raises(ValueError, match="sliding_window"):
        integration._check_call(0, specs[0], q, k, None, {"sliding_window": 4})


@pytest.mark.parametrize("bad", [None, -1, 2.0, True])
def test_mark_image_tokens_rejects_a_bad_token_id(bad):
    with pytest.raises(ValueError, match="image_token_id"):
        integration.mark_image_tokens(tiny_model("gemma3"), bad)


def test_image_spans_from_flags():
    flags = torch.tensor([0, 1, 1, 0, 1, 1, 1, 0, 0], dtype=torch.bool)
    # request 0: 4 new tokens after 10 cached; request 1: 5 new tokens from position 0; request 2: none flagged
    assert integration._image_spans(flags, [4, 5], [14, 5]) == [[(11, 13)], [(0, 3)]]
    assert integration._image_spans(torch.ones(3, dtype=torch.bool), [3], [7]) == [[(4, 7)]]
