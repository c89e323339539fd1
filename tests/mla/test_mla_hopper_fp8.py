"""The Gluon Hopper MLA decode kernel (:mod:`attnbackends.mla.decode_hopper`) on fp8 e4m3 latent caches with 16-bit
queries, at DeepSeek-V3 dims (128 heads, Lkv 512 + R 64, pages of 64).

CPU: which caches and inputs the kernel admits (e5m2 refused, e4m3 admitted on compute capability 9.0), that
``mla_decode`` would dispatch an e4m3 cache to it, its TMA descriptors, and its sm_90 compile (no spills, shared
memory within one SM's, the designed wgmma shapes and barriers). GPU (``pytest -m gpu tests/mla/test_mla_hopper_fp8.py``
on the H100): against a float64 oracle on the dequantised cache, random data, poisoned outputs, k_scale != 1,
sequence lengths that are no multiple of the page, one and several splits with the LSE, NaN in every unused cache
slot and page ids outside the cache; and against the 16-bit kernel on the same values.
"""

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnbackends.mla import decode_hopper as dh
from attnbackends.mla import decode_kernel as dk
from attnbackends.mla.decode_kernel import decode_kernel_name, default_decode_config
from attnbackends.mla.decode_launch import mla_decode
from attnbackends.ops.quant import quantize_for_cache
from attnbackends.testing import Tolerance, assert_close_to_oracle, tolerance_for

ROOT = Path(__file__).resolve().parents[2]
H, LKV, R, PAGE = 128, 512, 64, 64
SCALE = 1 / math.sqrt(128 + 64)
E4M3 = torch.float8_e4m3fn
GLUON = "" if dh.gluon_available() else "triton.experimental.gluon is not installed"


# ------------------------------------------------------------------------------------------------ CPU: admission


@pytest.mark.parametrize("cache_dtype, kv_lora, page, cc, reason", [
    (E4M3, 512, 64, (9, 0), GLUON),
    (E4M3, 256, 128, (9, 0), GLUON),
    (torch.bfloat16, 512, 64, (9, 0), GLUON),
    (torch.float8_e5m2, 512, 64, (9, 0), "a float8_e5m2 latent cache (needs float16, bfloat16 or float8_e4m3fn)"),
    (torch.float32, 512, 64, (9, 0), "a float32 latent cache"),
    (E4M3, 384, 64, (9, 0), "latent width 384 with an fp8 cache (needs 256 or 512)"),
    (E4M3, 512, 16, (9, 0), "page size 16 (not a multiple of 64)"),
    (E4M3, 512, 64, (8, 9), "compute capability is not 9.0"),
    (E4M3, 512, 64, None, "compute capability is not 9.0"),
])
def test_hopper_reason_for_fp8_caches(cache_dtype, kv_lora, page, cc, reason):
    got = dh.hopper_reason(kv_lora, 64, page, cache_dtype, cc)
    assert got == reason if reason in ("", GLUON) else got.startswith(reason), got


def _inputs(cache_dtype=E4M3, q_dtype=torch.bfloat16, qpe_dtype=None, tokens=2, blocks=4, width=LKV + R):
    q_nope = torch.zeros(tokens, H, LKV, dtype=q_dtype)
    q_pe = torch.zeros(tokens, H, R, dtype=qpe_dtype or q_dtype)
    cache = torch.zeros(blocks, PAGE, width).to(cache_dtype)
    return q_nope, q_pe, cache


def test_hopper_inputs_reason_for_fp8_caches():
    """Device-free admission of concrete inputs (compute capability 9.0 given): e4m3 with bf16 or fp16 queries in,
    e5m2, 32-bit queries, mixed query dtypes, non-contiguous pages and tree masks out."""
    ok = GLUON
    assert dh.hopper_inputs_reason(*_inputs(), False, (9, 0)) == ok
    assert dh.hopper_inputs_reason(*_inputs(q_dtype=torch.float16), False, (9, 0)) == ok
    assert "float8_e5m2" in dh.hopper_inputs_reason(*_inputs(cache_dtype=torch.float8_e5m2), False, (9, 0))
    assert dh.hopper_inputs_reason(*_inputs(), True, (9, 0)) == "a tree mask"
    assert dh.hopper_inputs_reason(*_inputs(), False, (8, 0)) == "compute capability is not 9.0"
    if not ok:
        assert "queries in" in dh.hopper_inputs_reason(*_inputs(q_dtype=torch.float32), False, (9, 0))
        assert "queries in" in dh.hopper_inputs_reason(*_inputs(qpe_dtype=torch.float16), False, (9, 0))
        assert "query dtype" in dh.hopper_inputs_reason(*_inputs(torch.bfloat16, torch.float16), False, (9, 0))
        q_nope, q_pe, wide = _inputs(width=LKV + R + 64)
        assert "not contiguous" in dh.hopper_inputs_reason(q_nope, q_pe, wide[..., : LKV + R], False, (9, 0))


def test_mla_decode_would_launch_the_hopper_kernel_for_e4m3(monkeypatch):
    """:func:`decode_kernel_name` with the device check of compute capability 9.0 in place of the CUDA device:
    e4m3 at 128 heads (bf16 or fp16 queries) goes to the Hopper kernel; e5m2, 16 heads (tiles of 16 rows) and
    tree masks go to the portable Triton kernel; on the CPU nothing goes to the Hopper kernel."""
    q_nope, q_pe, cache = _inputs()
    config = default_decode_config(H)
    assert decode_kernel_name(q_nope, q_pe, cache, config, tree=False) == "pointer"  # a CPU cache
    monkeypatch.setattr(dk, "hopper_decode_applies",
                        lambda q, qp, c, tree: not dh.hopper_inputs_reason(q, qp, c, tree, (9, 0)))
    want = "pointer" if GLUON else "hopper"
    assert decode_kernel_name(q_nope, q_pe, cache, config, tree=False) == want
    assert decode_kernel_name(*_inputs(q_dtype=torch.float16), config, tree=False) == want
    assert decode_kernel_name(*_inputs(cache_dtype=torch.float8_e5m2), config, tree=False) == "pointer"
    assert decode_kernel_name(q_nope, q_pe, cache, config, tree=True) == "pointer"
    q16 = torch.zeros(2, 16, LKV, dtype=torch.bfloat16), torch.zeros(2, 16, R, dtype=torch.bfloat16)
    assert decode_kernel_name(*q16, cache, default_decode_config(16), tree=False) == "pointer"


@pytest.mark.skipif(bool(GLUON), reason=GLUON)
def test_fp8_scores_setting_is_checked():
    """The score-product mode is one of the two the kernel has; a typo is a ValueError naming the choices."""
    assert dk.MLADecodeConfig(fp8_scores="e4m3").fp8_scores == "e4m3"
    with pytest.raises(ValueError, match="fp8_scores must be one of"):
        dk.MLADecodeConfig(fp8_scores="fp8")


def test_hopper_descriptors_for_e4m3():
    """fp8 pages are copied as [64, 512] boxes (128-byte swizzle, four 128-byte rows per key) and [64, 64] rope
    boxes (64-byte swizzle) of 8-bit elements."""
    _, _, cache = _inputs(blocks=3)
    kv_desc, pe_desc = dh.hopper_descriptors(cache, LKV)
    assert kv_desc.block_shape == [64, LKV] and pe_desc.block_shape == [64, R]
    assert kv_desc.layout.element_bitwidth == 8 and kv_desc.layout.swizzle_byte_width == 128
    assert pe_desc.layout.element_bitwidth == 8 and pe_desc.layout.swizzle_byte_width == 64


# ------------------------------------------------------------------------------------------------ CPU: sm_90 compile

_COMPILE = r"""
import dataclasses, json, re, sys, torch
from attnbackends.mla import decode_hopper as dh
from attnbackends.mla.decode_kernel import default_decode_config
from attnbackends.mla.decode_launch import MLACacheState, decode_launch_args, plan_mla_decode
from benchmarks.offline_compile import SHARED_LIMIT, compile_call

def launch_args(cache_dtype, q_dtype, max_q, splits, scores="16-bit"):
    B, H, lkv, rope, page = 2, 128, 512, 64, 64
    cache = torch.zeros(16, page, lkv + rope, dtype=cache_dtype)
    qn, qp = torch.zeros(B * max_q, H, lkv, dtype=q_dtype), torch.zeros(B * max_q, H, rope, dtype=q_dtype)
    bt, sl = torch.zeros(B, 8, dtype=torch.int32), torch.full((B,), 300, dtype=torch.int32)
    qs = torch.arange(0, B * max_q + 1, max_q, dtype=torch.int32)
    partials = (torch.zeros(B * max_q, H, splits, lkv), torch.zeros(B * max_q, H, splits)) if splits > 1 else None
    plan = plan_mla_decode(num_tokens=B * max_q, num_heads=H, kv_lora=lkv, rope=rope, page=page,
                           cache_dtype=cache_dtype, q_dtype=q_dtype, block_table=bt, seq_lens=sl,
                           output=torch.zeros_like(qn), num_splits=splits,
                           config=dataclasses.replace(default_decode_config(H), fp8_scores=scores),
                           compute_capability=(9, 0), lse=torch.zeros(B * max_q, H), partials=partials,
                           query_start_loc=qs, max_query_len=max_q, kernel="hopper")
    # the arguments the launch path passes (the launcher's own assembly, not a copy of it)
    _, _, args, plan = decode_launch_args(plan, qn, qp, MLACacheState(cache), 0.1, 0.5)
    return dh.hopper_kernel(), (args, dict(zip(dh.HOPPER_CONSTEXPRS, plan.constexprs)))

reports = []
for label, cache_dtype, q_dtype, max_q, splits, bits, scores in [
        ("fp8 bf16", torch.float8_e4m3fn, torch.bfloat16, 1, 1, True, "16-bit"),
        ("fp8 bf16 multi-token split", torch.float8_e4m3fn, torch.bfloat16, 3, 4, True, "16-bit"),
        ("fp8 fp16", torch.float8_e4m3fn, torch.float16, 1, 1, True, "16-bit"),
        ("fp8 bf16 triton conversion", torch.float8_e4m3fn, torch.bfloat16, 1, 1, False, "16-bit"),
        ("fp8 bf16 e4m3 scores", torch.float8_e4m3fn, torch.bfloat16, 1, 1, True, "e4m3"),
        ("fp8 fp16 e4m3 scores multi-token split", torch.float8_e4m3fn, torch.float16, 3, 4, True, "e4m3"),
        ("bf16", torch.bfloat16, torch.bfloat16, 1, 1, True, "16-bit")]:
    dh.HOPPER_FP8_BITS = bits
    kernel, (args, kwargs) = launch_args(cache_dtype, q_dtype, max_q, splits, scores)
    rep = compile_call(kernel, args, kwargs, keep_asm=True)
    ptx = rep.pop("asm")["ptx"]
    rep["label"] = label
    rep["limit"] = SHARED_LIMIT[90]
    rep["expect_tx"] = sorted(set(int(x) for x in re.findall(r"expect_tx\.shared(?:::cta)?\.b64 _, \[%r\d+\], (\d+)", ptx)))
    rep["mbarrier_init_counts"] = sorted(
        int(x) for x in re.findall(r"mbarrier\.init\.shared(?:::cta)?\.b64 \[%r\d+\], (\d+)", ptx))
    rep["bf16x2_multiplies"] = len(re.findall(r"mul\.rn\.bf16x2", ptx))
    reports.append(rep)
print(json.dumps(reports))
"""


@pytest.mark.skipif(bool(GLUON), reason=GLUON)
def test_fp8_kernel_compiles_for_sm90():
    """The fp8 kernel (bf16 and fp16 queries, one and several query tokens and splits, both conversions, 16-bit
    and e4m3 score products) and the 16-bit one compile for Hopper (in a fresh process, without the interpreter) with no spill stack, within one
    SM's shared memory, no serialised wgmma, the score tile as m64n64k16 and each output half as m64n256k16 in the
    query dtype, one expect-tx per page (fp8: 64 x 576 bytes), kv_empty counting two releases per stage, and the
    fp8 widening by bit placement where asked for."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _COMPILE], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600, check=False)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for rep in json.loads(res.stdout.strip().splitlines()[-1]):
        fp8, qt = rep["label"].startswith("fp8"), "f16" if "fp16" in rep["label"] else "bf16"
        assert rep["stack"] == 0 and rep["local"] == 0, rep
        assert not rep["shared_over_limit"] and rep["shared"] <= rep["limit"], rep
        assert not [n for n in rep["ptxas_notes"] if "serialized" in n], rep
        if "e4m3 scores" in rep["label"]:  # the score tile from the e4m3 queries and pages: 18 k32 steps
            assert rep["wgmma"] == {"m64n64k32.f32.e4m3.e4m3": 18, f"m64n256k16.f32.{qt}.{qt}": 8}, rep
        else:
            assert rep["wgmma"] == {f"m64n64k16.f32.{qt}.{qt}": 36, f"m64n256k16.f32.{qt}.{qt}": 8}, rep
        assert rep["expect_tx"] == [64 * 576 * (1 if fp8 else 2)], rep
        assert rep["mbarrier_init_counts"].count(2) == 2, rep  # kv_empty x NBUF 2
        if fp8 and qt == "bf16":
            assert (rep["bf16x2_multiplies"] > 0) == ("triton conversion" not in rep["label"]), rep


# ------------------------------------------------------------------------------------------------ GPU

HAS_CUDA = torch.cuda.is_available()


@dataclasses.dataclass
class Fp8Case:
    q_nope: torch.Tensor  # [T, H, LKV]
    q_pe: torch.Tensor  # [T, H, R]
    cache: torch.Tensor  # [num_blocks, PAGE, LKV + R] e4m3, NaN in every slot no request owns (page 0 aside)
    table: torch.Tensor  # [B, W] int32, with page ids outside the cache
    substituted: torch.Tensor  # table with those read as page 0
    seq_lens: torch.Tensor  # [B] int32
    query_start: torch.Tensor  # [B + 1] int32
    max_q: int
    k_scale: float


def make_case(batch: int, seed: int, *, max_q: int = 1, q_dtype=torch.bfloat16, k_scale: float = 0.03) -> Fp8Case:
    """Random latents quantised with ``k_scale``; sequence lengths no multiple of the page (partial last tiles);
    shuffled pages; page 0 owned by no request (finite: it stands in for bad page ids); the slots past each
    request's end and every other unowned page hold e4m3 NaN (0x7F); bad page ids in a whole tile of the longest
    request and in the partial last tile of the shortest with two pages or more."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(max(max_q, 1), 1500, (batch,), generator=g, dtype=torch.int32)
    lens = torch.where(lens % PAGE == 0, lens + 1, lens)
    pages = (lens + PAGE - 1) // PAGE
    num_blocks = int(pages.sum()) + 3
    latent = torch.randn(num_blocks, PAGE, LKV + R, generator=g)
    cache = quantize_for_cache(latent, E4M3, k_scale)
    raw = cache.view(torch.uint8)
    table = torch.zeros(batch, int(pages.max()), dtype=torch.int32)
    order = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    for i, (n, p) in enumerate(zip(lens.tolist(), pages.tolist())):
        table[i, :p] = torch.tensor(order[:p], dtype=torch.int32)
        order = order[p:]
        raw[table[i, p - 1], n - (p - 1) * PAGE:] = 0x7F
    raw[torch.tensor(order, dtype=torch.long)] = 0x7F  # the unowned pages but page 0
    bad = table.clone()
    longest = int(pages.argmax())
    bad[longest, min(1, int(pages[longest]) - 1)] = num_blocks + 5
    two = [i for i, p in enumerate(pages.tolist()) if p >= 2 and i != longest]
    if two:
        short = min(two, key=lambda i: int(pages[i]))
        bad[short, int(pages[short]) - 1] = -1
    substituted = torch.where((bad >= 0) & (bad < num_blocks), bad, 0)
    tokens = batch * max_q
    return Fp8Case(
        q_nope=torch.randn(tokens, H, LKV, generator=g).to(q_dtype).cuda(),
        q_pe=torch.randn(tokens, H, R, generator=g).to(q_dtype).cuda(),
        cache=cache.cuda(), table=bad.cuda(), substituted=substituted.cuda(), seq_lens=lens.cuda(),
        query_start=torch.arange(0, tokens + 1, max_q, dtype=torch.int32).cuda(), max_q=max_q, k_scale=k_scale)


def oracle(case: Fp8Case, cache: "torch.Tensor | None" = None) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (output [T, H, LKV], LSE [T, H]) on the dequantised cache read through the substituted table; token t
    of a request with L keys and Q tokens sees keys up to L - Q + t."""
    deq = (cache if cache is not None else case.cache).double() * (case.k_scale if cache is None else 1.0)
    outs, lses = [], []
    for i, n in enumerate(case.seq_lens.tolist()):
        pages = case.substituted[i, : (n + PAGE - 1) // PAGE].long()
        kv = deq[pages].reshape(-1, LKV + R)[:n]  # [L, LKV + R]
        t0 = i * case.max_q
        q = torch.cat([case.q_nope[t0 : t0 + case.max_q], case.q_pe[t0 : t0 + case.max_q]], dim=-1).double()
        s = torch.einsum("qhc,lc->qhl", q, kv) * SCALE
        visible = torch.arange(n, device=s.device)[None, :] <= torch.arange(n - case.max_q, n, device=s.device)[:, None]
        s = s.masked_fill(~visible[:, None, :], float("-inf"))
        lses.append(torch.logsumexp(s, dim=-1))
        outs.append(torch.einsum("qhl,lc->qhc", torch.softmax(s, dim=-1), kv[:, :LKV]))
    return torch.cat(outs), torch.cat(lses)


def run_decode(case: Fp8Case, num_splits: int, *, table=None, cache=None, k_scale=None, scores: str = "16-bit"):
    """mla_decode on the Hopper kernel (skips unless it serves these inputs) into NaN-poisoned output and LSE;
    ``scores``: the fp8 cache's score products (``MLADecodeConfig.fp8_scores``)."""
    cache = case.cache if cache is None else cache
    config = dataclasses.replace(default_decode_config(H), fp8_scores=scores)
    if decode_kernel_name(case.q_nope, case.q_pe, cache, config, tree=False) != "hopper":
        pytest.skip(f"the Gluon Hopper kernel does not serve this cache here: "
                    f"{dh.hopper_reason(LKV, R, PAGE, cache.dtype, torch.cuda.get_device_capability())}")
    tokens = case.q_nope.shape[0]
    out = torch.full((tokens, H, LKV), float("nan"), dtype=case.q_nope.dtype, device="cuda")
    lse = torch.full((tokens, H), float("nan"), device="cuda")
    mla_decode(case.q_nope, case.q_pe, cache, case.table if table is None else table, case.seq_lens, out,
               scale=SCALE, k_scale=case.k_scale if k_scale is None else k_scale, num_splits=num_splits,
               config=config, lse=lse, query_start_loc=case.query_start, max_query_len=case.max_q)
    torch.cuda.synchronize()
    return out, lse


@pytest.mark.gpu
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("num_splits", [1, 5])
@pytest.mark.parametrize("batch", [1, 4, 33])
def test_hopper_fp8_against_oracle(batch, num_splits, q_dtype):
    case = make_case(batch, seed=100 + batch, q_dtype=q_dtype)
    out, lse = run_decode(case, num_splits)
    assert torch.isfinite(out.float()).all() and torch.isfinite(lse).all()
    want_out, want_lse = oracle(case)
    assert_close_to_oracle(out, want_out, tolerance_for(q_dtype, "fp8_e4m3"), what=f"hopper fp8 B={batch}")
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-3, rtol=1e-4)
    # page ids outside the cache are read as page 0, bit for bit
    same_out, same_lse = run_decode(case, num_splits, table=case.substituted)
    assert torch.equal(out, same_out) and torch.equal(lse, same_lse)


def e4m3_queries(case: Fp8Case) -> Fp8Case:
    """The case with the queries the e4m3 score products see, in float64: each row (token, head) over its
    LKV + R columns scaled by 448 / amax, rounded to e4m3 and scaled back (float32 arithmetic, as the kernel's)."""
    q = torch.cat([case.q_nope, case.q_pe], dim=-1).float()
    amax = q.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax * (1.0 / 448.0), torch.ones_like(amax))
    q8 = (q * (1.0 / scale)).clamp(-448.0, 448.0).to(E4M3)
    deq = q8.double() * scale.double()
    return dataclasses.replace(case, q_nope=deq[..., :LKV], q_pe=deq[..., LKV:])


#: e4m3 score products against the exact float64 oracle: the queries' e4m3 rounding (3 mantissa bits) moves the
#: scores by a few percent of their spread; the output stays within this (the measured errors: benchmarks/NOTES.md).
E4M3_SCORES_CLASS = Tolerance(atol=0.2, rtol=0.2, rel_fro=0.05)
#: LSE against the oracle of the quantised queries: sm_90's e4m3 wgmma accumulates in reduced precision.
E4M3_SCORES_LSE_ATOL = 1e-2


def e4m3_scores_tolerance(q_dtype: torch.dtype) -> Tolerance:
    """Output against the oracle of the quantised queries: the fp8 cache tolerance, doubled elementwise for the
    e4m3 wgmma's reduced-precision accumulation; the aggregate bound unchanged."""
    tol = tolerance_for(q_dtype, "fp8_e4m3")
    return Tolerance(atol=2 * tol.atol, rtol=2 * tol.rtol, rel_fro=tol.rel_fro)


@pytest.mark.gpu
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("num_splits", [1, 5])
@pytest.mark.parametrize("batch", [1, 4, 33])
def test_hopper_fp8_e4m3_scores_against_oracle(batch, num_splits, q_dtype):
    """e4m3 score products (queries quantised per row, pages read as stored): the float64 oracle of the quantised
    queries within :func:`e4m3_scores_tolerance`, the exact oracle within :data:`E4M3_SCORES_CLASS`; bad page ids
    read as page 0, bit for bit."""
    case = make_case(batch, seed=100 + batch, q_dtype=q_dtype)
    out, lse = run_decode(case, num_splits, scores="e4m3")
    assert torch.isfinite(out.float()).all() and torch.isfinite(lse).all()
    want_out, want_lse = oracle(e4m3_queries(case))
    assert_close_to_oracle(out, want_out, e4m3_scores_tolerance(q_dtype), what=f"e4m3 scores B={batch}")
    torch.testing.assert_close(lse.double(), want_lse, atol=E4M3_SCORES_LSE_ATOL, rtol=0)
    exact_out, _ = oracle(case)
    assert_close_to_oracle(out, exact_out, E4M3_SCORES_CLASS, what=f"e4m3 scores B={batch} against exact queries")
    same_out, same_lse = run_decode(case, num_splits, table=case.substituted, scores="e4m3")
    assert torch.equal(out, same_out) and torch.equal(lse, same_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 3])
def test_hopper_fp8_e4m3_scores_multi_token(num_splits):
    """Three query tokens per request with e4m3 score products, causal per row."""
    case = make_case(4, seed=7, max_q=3)
    out, lse = run_decode(case, num_splits, scores="e4m3")
    want_out, want_lse = oracle(e4m3_queries(case))
    assert_close_to_oracle(out, want_out, e4m3_scores_tolerance(torch.bfloat16), what="e4m3 scores multi-token")
    torch.testing.assert_close(lse.double(), want_lse, atol=E4M3_SCORES_LSE_ATOL, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 3])
def test_hopper_fp8_multi_token_against_oracle(num_splits):
    """Three query tokens per request (speculative verification), causal per row."""
    case = make_case(4, seed=7, max_q=3)
    out, lse = run_decode(case, num_splits)
    want_out, want_lse = oracle(case)
    assert_close_to_oracle(out, want_out, tolerance_for(torch.bfloat16, "fp8_e4m3"), what="hopper fp8 multi-token")
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-3, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_hopper_fp8_matches_the_16bit_kernel(num_splits, q_dtype):
    """With k_scale a power of two the dequantised cache is exact in the query dtype and every step of the fp8
    kernel is the 16-bit kernel's scaled by powers of two: the two agree to the last bit but for the rounding of
    the final division (one ulp), NaN slots (e4m3 NaN, 16-bit NaN) and bad page ids included."""
    case = make_case(6, seed=31, q_dtype=q_dtype, k_scale=2.0**-5)
    out8, lse8 = run_decode(case, num_splits)
    cache16 = (case.cache.float() * case.k_scale).to(q_dtype)
    out16, lse16 = run_decode(case, num_splits, cache=cache16, k_scale=1.0)
    assert torch.isfinite(out16.float()).all()
    torch.testing.assert_close(out8.float(), out16.float(), atol=1e-6, rtol=2.0**-7)
    torch.testing.assert_close(lse8, lse16, atol=1e-6, rtol=1e-6)
    want_out, _ = oracle(case, cache=cache16)
    assert_close_to_oracle(out16, want_out, tolerance_for(q_dtype), what="hopper 16-bit on the dequantised cache")


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 4])
def test_triton_mla_fp8_at_128_heads_on_gpu(num_splits):
    """DeepSeek-V3's 128 heads on an fp8 e4m3 cache through the backend: decodes on the Hopper kernel (compute
    capability 9.0), prefills behind them, against the oracle."""
    from attnbackends.mla.backends import TritonMLABackend
    from attnbackends.testing.mla import make_random_mla_batch, mla_oracle, run_mla_backend
    from attnbackends.spec import AttentionSpec
    from attnbackends.testing import SequenceShape as S

    spec = AttentionSpec.mla(128, dtype="bfloat16", kv_cache_dtype="fp8_e4m3", block_size=64)
    shapes = [S(1, 0), S(1, 63), S(1, 64), S(1, 1000), S(1, 3001), S(37, 0), S(200, 1500)]
    batch = make_random_mla_batch(spec, shapes, seed=12, device="cuda", pad_tokens=5)
    probe = (torch.zeros(1, 128, LKV, dtype=torch.bfloat16, device="cuda"),
             torch.zeros(1, 128, R, dtype=torch.bfloat16, device="cuda"))
    if decode_kernel_name(*probe, batch.kv_cache, default_decode_config(128), tree=False) != "hopper":
        pytest.skip("the Gluon Hopper kernel does not serve fp8 caches here (compute capability 9.0 and Gluon)")
    out, _ = run_mla_backend(TritonMLABackend, batch, builder_kwargs=dict(
        workspace_tokens=1536, **({"num_splits": num_splits} if num_splits else {})))
    n = batch.num_actual_tokens
    assert_close_to_oracle(out[:n], mla_oracle(batch), tolerance_for(torch.bfloat16, "fp8_e4m3"),
                           what="triton_mla fp8 128 heads")
    assert torch.isnan(out[n:].float()).all()
