"""Every MLA decode candidate of benchmarks/mla_explore.py on the GPU at DeepSeek-V3 dims (128 heads, latent 512 +
rope 64, page 64), compiled and checked against the float32 oracle: lengths around the tile and page edges, one
query per request and two, the config's own schedule and a forced 3-way split (the LSE merge), NaN in every
cache slot no request owns, outputs poisoned. Run with `pytest -m gpu tests/test_mla_explore_gpu.py` on the GPU
host; the timings are `python -m benchmarks.mla_explore --out DIR`.

Kernel crashes here take the test process down with them; the driver's probes run each config in a child
process instead.
"""

import pytest
import torch

from benchmarks import mla_explore as me

pytestmark = pytest.mark.gpu

FAMILIES = "FAGBCDE"


def _configs():
    out = []
    for fam in FAMILIES:
        try:
            out += me.family_configs(fam, quick=False)
        except ImportError:  # Gluon missing from this Triton: the Gluon test below says so
            pass
    return out


CONFIGS = _configs()


@pytest.fixture(scope="module")
def checks():
    me.set_tma_allocator()
    out = {}
    for fp8 in (False, True):
        batches = me.check_batches(me.DEEPSEEK, fp8, "cuda")
        out[fp8] = (batches, [me.reference(b) for b in batches])
    return out


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c.label.replace(" ", "_") for c in CONFIGS])
def test_candidate_matches_oracle_on_gpu(cfg, checks):
    if type(cfg).__name__ == "GluonConfig" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the Gluon candidate uses wgmma and TMA (sm_90+)")
    err = me.check_config(cfg, *checks[cfg.kv_fp8], me.num_sms())
    rel, lse = me.tolerance(cfg)
    assert err["rel"] < rel and err["lse_max_abs"] < lse, f"{cfg.label}: {err}"


def test_gluon_is_importable():
    pytest.importorskip("triton.experimental.gluon")
    from benchmarks import mla_explore_gluon  # noqa: F401
