"""Selection over compute capability x head size x KV-cache dtype, with and without FlashInfer installed.

The expected choice is written out as the rules the backends promise (their docs and README), not read back from
their capability data, so a changed capability shows up here as a failure to look at.
"""

import itertools

import pytest

import attnbackends.platform as platform
from attnbackends import AttentionSpec, DeviceInfo, explain, select

CCS = [(7, 5), (8, 0), (9, 0), (10, 0)]
HEADS = [64, 80, 128, 256, "mla"]
KV_DTYPES = ["auto", "fp8_e4m3", "fp8_e5m2"]


def expected_choice(cc, head, kv, flashinfer_installed):
    """Without a profile Triton comes first on CUDA (fast and compiled in seconds); FlashInfer serves what it
    cannot."""
    triton_fp8_ok = not (kv == "fp8_e4m3" and cc < (8, 9))  # Triton's e4m3 conversion needs sm_89+
    if head == "mla":
        if cc >= (8, 0) and triton_fp8_ok:
            return "triton_mla"
        if flashinfer_installed and cc >= (9, 0) and kv == "auto":
            return "flashinfer_mla"
        return "reference_mla"
    if cc >= (8, 0) and triton_fp8_ok:
        return "triton"
    if flashinfer_installed and cc >= (8, 0) and head in (64, 128, 256):
        return "flashinfer"
    return "reference"


def expected_reason_fragments(cc, head, kv, flashinfer_installed):
    """A fragment each rejected backend's reasons must contain."""
    fragments = {}
    mla = head == "mla"
    fi, tr = ("flashinfer_mla", "triton_mla") if mla else ("flashinfer", "triton")
    if not flashinfer_installed:
        fragments[fi] = "flashinfer is not installed"
    elif cc < ((9, 0) if mla else (8, 0)):
        fragments[fi] = f"compute capability {cc[0]}.{cc[1]} <"
    elif not mla and head not in (64, 128, 256):
        fragments[fi] = f"head_size {head} not supported"
    elif mla and kv != "auto":
        fragments[fi] = f"kv_cache_dtype {kv} not supported"
    if cc < (8, 0):
        fragments[tr] = "compute capability 7.5 < 8.0"
    elif kv == "fp8_e4m3" and cc < (8, 9):
        fragments[tr] = "fp8 e4m3"
    fragments["reference_mla" if not mla else "reference"] = "MLA"
    return fragments


def make_spec(head, kv):
    if head == "mla":
        return AttentionSpec.mla(num_heads=16, kv_cache_dtype=kv, block_size=64)
    return AttentionSpec(num_heads=32, num_kv_heads=8, head_size=head, kv_cache_dtype=kv, block_size=16)


@pytest.mark.parametrize("flashinfer_installed", [True, False], ids=["with_flashinfer", "without_flashinfer"])
@pytest.mark.parametrize("cc, head, kv", list(itertools.product(CCS, HEADS, KV_DTYPES)))
def test_selection_matrix(cc, head, kv, flashinfer_installed, monkeypatch):
    monkeypatch.delenv("ATTNBACKENDS_BACKEND", raising=False)
    real = platform.package_available
    monkeypatch.setattr(
        platform, "package_available", lambda name: flashinfer_installed if name == "flashinfer" else real(name)
    )
    spec, device = make_spec(head, kv), DeviceInfo.cuda(*cc)
    want = expected_choice(cc, head, kv, flashinfer_installed)
    result = explain(spec, device)
    assert result.chosen == want, str(result)
    assert select(spec, device).name == want
    rows = {name: reasons for name, _, reasons in result.as_table()}
    for backend, fragment in expected_reason_fragments(cc, head, kv, flashinfer_installed).items():
        assert fragment in rows[backend], (backend, rows[backend])
