"""benchmarks/spec_engine.py runs end to end on the CPU (--smoke): the speculative runs' greedy tokens equal the
plain run's, acceptance and speed are reported per drafter, the JSON lands under --out."""

import json

import pytest

pytest.importorskip("transformers")


def test_spec_engine_smoke(tmp_path):
    from benchmarks.spec_engine import main

    assert main(["--smoke", "--out", str(tmp_path), "--num-prompts", "2", "--new-tokens", "6"]) == 0
    report = json.loads((tmp_path / "spec_engine.json").read_text())
    rows = report["rows"]
    assert report["command"].startswith("python -m benchmarks.spec_engine --smoke")
    assert [r["drafter"] for r in rows] == [None, "ngram", "draft_model"]
    for row in rows[1:]:
        assert row["tokens_identical"] is True
        assert row["verify_steps"] > 0 and row["acceptance_length"] > 1.0  # the quoted chain / same successors
        assert row["tokens_per_s"] > 0 and row["speedup_vs_plain"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_spec_engine_gpu_tokens_identical(tmp_path, backend):
    """bf16 on the GPU, the wide-margin Llama: both drafters' speculative tokens equal the plain run's, on each
    backend that declares tree verification (one that does not is a row naming its reasons)."""
    import torch

    from benchmarks.spec_engine import main

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    assert main(["--out", str(tmp_path), "--backends", backend, "--num-prompts", "3", "--new-tokens", "16"]) == 0
    rows = json.loads((tmp_path / "spec_engine.json").read_text())["rows"]
    if rows[0].get("skipped"):
        pytest.skip(f"{backend} declines speculative trees: {rows[0]['skipped']}")
    assert [r["drafter"] for r in rows] == [None, "ngram", "draft_model"]
    for row in rows[1:]:
        assert row["tokens_identical"] is True and row["verify_steps"] > 0
