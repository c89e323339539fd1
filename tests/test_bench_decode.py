"""The decode suite (benchmarks/decode.py) on the CPU: its batches follow issue 42, it is registered, and its
--cpu-smoke run builds every batch, drives ours through the public API and a torch stand-in for FlashInfer's
wrappers through the same plan()/run() calls the GPU run makes, and writes rows in the PERF.md format whose outputs
agree. The timings themselves need the H100 (python -m benchmarks.run --suite decode)."""

import json
import statistics

import pytest
import torch

from attnbackends import DeviceInfo, get_backend_class
from attnbackends.reference.backend import ReferenceBackend, ReferenceMetadataBuilder
from benchmarks import decode
from benchmarks.decode import SMOKE_LAYER, Case, batch_defs, construct_builder, main, torch_paged_wrappers
from benchmarks.suites import SUITES, module_present


def _rows(tmp_path, *argv, **kw):
    out = tmp_path / "rows.json"
    assert main(["--cpu-smoke", "--out", str(out), *argv], **kw) == 0
    return json.loads(out.read_text())["rows"]


def test_registered_as_a_default_suite():
    suite = SUITES["decode"]
    assert suite.module == "benchmarks.decode" and suite.default and module_present("decode")


def test_the_batches_of_issue_42():
    b = {d.name: d for d in batch_defs(seed=0)}
    assert list(b) == ["lognormal_1500", "lognormal_12k", "two_mode", "uniform_8192", "uniform_lognormal_mean",
                       "uniform_4096", "b1_16384", "b4_32768", "mixed_chunks", "mixed_prompts"]
    ln = b["lognormal_1500"].decodes
    assert len(ln) == 128 and all(16 <= L <= 32768 for L in ln) and 1000 < statistics.median(ln) < 2200
    assert b["lognormal_1500"].params["decodes"] == dict(dist="lognormal", n=128, median=1500, sigma=0.9, floor=16,
                                                         cap=32768)
    long = b["lognormal_12k"].decodes
    assert len(long) == 32 and max(long) <= 32768 and 7000 < statistics.median(long) < 20000
    two = b["two_mode"].decodes
    assert sorted(two) == [600] * 96 + [24000] * 8 and list(two) != sorted(two)  # shuffled
    assert b["uniform_lognormal_mean"].decodes == (round(statistics.fmean(ln)),) * 128
    for name, (n, L) in {"uniform_8192": (128, 8192), "uniform_4096": (64, 4096), "b1_16384": (1, 16384),
                         "b4_32768": (4, 32768)}.items():
        assert b[name].decodes == (L,) * n and b[name].decode_only
    chunks = b["mixed_chunks"]
    assert len(chunks.decodes) == 96 and len(chunks.prefills) == 4
    assert all(q == 512 and 1024 <= c <= 8192 for q, c in chunks.prefills)
    prompts = b["mixed_prompts"]
    assert len(prompts.decodes) == 64 and len(prompts.prefills) == 32
    assert all(64 <= q <= 512 and c == 0 for q, c in prompts.prefills)
    # decodes first, one new token each on L - 1 cached
    assert chunks.shapes[:96] == [(1, L - 1) for L in chunks.decodes] and chunks.shapes[96:] == list(chunks.prefills)
    assert {n for n, d in b.items() if d.fp8} == {"lognormal_1500", "uniform_8192", "uniform_4096"}


def test_batches_are_seeded_and_the_options_pick_subsets():
    assert batch_defs(seed=3) == batch_defs(seed=3)
    assert batch_defs(seed=3)[0].decodes != batch_defs(seed=4)[0].decodes
    quick = batch_defs(quick=True)
    assert 0 < len(quick) < len(batch_defs()) and [d.name for d in quick if d.fp8] == ["uniform_4096"]
    assert [d.name for d in batch_defs(names=["two_mode"])] == ["two_mode"]
    with pytest.raises(ValueError, match="unknown batch nope; allowed: lognormal_1500"):
        batch_defs(names=["nope"])
    assert [d.name for d in batch_defs(smoke=True)] == [d.name for d in batch_defs()]


def test_the_cache_and_flashinfer_page_table_describe_the_same_batch():
    bdef = batch_defs(smoke=True, names=["mixed_chunks"])[0]
    case = Case(bdef, SMOKE_LAYER, torch.device("cpu"))
    assert case.kv.shape == (case.num_blocks, 2, 16, SMOKE_LAYER.num_kv_heads, SMOKE_LAYER.head_size)
    assert sorted(case.kv_indices.tolist()) == list(range(case.num_blocks))  # every page once
    assert case.kv_indices.tolist() != list(range(case.num_blocks))  # in random order
    table = case.common.block_table.tolist()
    for i, pages in enumerate(case.tables):
        assert table[i][: len(pages)] == pages
    p = case.plan_inputs(case.num_decodes, case.num_reqs)  # the chunks
    assert p.qo_indptr.tolist() == [0, 24, 48] and p.num_reqs == 2
    assert p.kv_indices.tolist() == [x for t in case.tables[case.num_decodes:] for x in t]
    assert p.seq_lens.tolist() == case.seq_lens[case.num_decodes:]
    fp8 = Case(bdef, SMOKE_LAYER, torch.device("cpu"), "fp8_e4m3", source=case)
    assert fp8.kv.dtype == torch.float8_e4m3fn and fp8.tables is case.tables
    torch.testing.assert_close(fp8.kv.float() * fp8.kv_scale, case.kv.float(), rtol=0.07, atol=1e-3)


def test_cpu_smoke_rows(tmp_path):
    """Every batch through the suite with the reference backend as ours (fast): the rows PERF.md names, with the
    peer's outputs agreeing."""
    rows = _rows(tmp_path, ours_backend=get_backend_class("reference"))
    names = [d.name for d in batch_defs(smoke=True)]
    assert rows[0]["case"] == "copy_roof" and rows[0]["GBps"] > 0
    ragged = [r for r in rows if r["case"] == "decode_ragged"]
    for r in ragged:
        assert {"batch", "B", "L", "L_mean", "kv_tokens", "us", "peer_us", "ratio", "GBps", "mode", "kv_in_forward",
                "params"} <= set(r), r
        assert r["peer"] == "flashinfer_wrappers" and r["diff_ok"] and r["max_abs_diff"] <= 2e-3, r
        assert r["ratio"] == pytest.approx(r["us"] / r["peer_us"], rel=1e-3)  # us / peer_us, before rounding
    for name in names:
        mine = [(r["backend"], r["kv_in_forward"]) for r in ragged if r["batch"] == name]
        assert sorted(mine) == sorted([("reference", True), ("reference", False), ("reference_as_adapter", True),
                                       ("reference_as_adapter", False)]), name
        assert [r["batch"] for r in rows if r["case"] == "decode_host"].count(name) == 1
    host = next(r for r in rows if r["case"] == "decode_host")
    assert all(host[k] > 0 for k in ("build_host_us", "forward_host_us", "peer_plan_host_us", "peer_run_host_us"))
    decode_only = {d.name for d in batch_defs(smoke=True) if d.decode_only}
    roof = [r for r in rows if r["case"] == "decode_roof"]
    assert {r["batch"] for r in roof} == decode_only
    assert all(r["roof_GBps"] == rows[0]["GBps"] and r["peer"] == "copy_roof" for r in roof)
    fp8 = [r for r in rows if r["case"] == "decode_fp8"]
    assert {r["batch"] for r in fp8} == {"lognormal_1500", "uniform_8192", "uniform_4096"} and len(fp8) == 6
    for r in fp8:
        assert r["kv_dtype"] == "fp8_e4m3" and r["peer"] == "reference_bf16" and r["diff_ok"], r
        assert r["flashinfer_fp8_us"] > 0 and r["max_abs_diff_vs_bf16"] < 0.2
    assert {r["kv_dtype"] for r in roof} == {"auto", "fp8_e4m3"}
    json.dumps(rows)  # plain JSON


def test_cpu_smoke_drives_triton_through_its_api(tmp_path):
    """Ours is the triton backend (interpreted on the CPU, the conftest's TRITON_INTERPRET=1) on a ragged batch with
    fp8 rows and a step with fresh prompts."""
    triton = get_backend_class("triton")
    reasons = triton.not_supported_reasons(SMOKE_LAYER.spec(), DeviceInfo.current(torch.device("cpu")))
    if reasons:
        pytest.skip("; ".join(reasons))
    rows = _rows(tmp_path, "--batches", "lognormal_1500", "mixed_prompts", "--no-adapter")
    ragged = [r for r in rows if r["case"] == "decode_ragged"]
    assert {(r["batch"], r["backend"], r["kv_in_forward"]) for r in ragged} == {
        (b, backend, kv) for b in ("lognormal_1500", "mixed_prompts") for kv in (True, False)
        for backend in ("triton", "triton_balanced", "triton_uniform")}
    assert all(r["diff_ok"] for r in ragged), ragged
    fp8 = [r for r in rows if r["case"] == "decode_fp8"]
    assert len(fp8) == 2 and all(r["diff_ok"] and r["peer"] == "triton_bf16" for r in fp8)


class _ScheduledBuilder(ReferenceMetadataBuilder):
    """A builder with a decode_schedule option that knows "balanced" alone."""

    def __init__(self, spec, device="cpu", *, decode_schedule="auto", **kw):
        if decode_schedule not in ("auto", "balanced"):
            raise ValueError(f"decode_schedule must be 'auto' or 'balanced', got {decode_schedule!r}")
        super().__init__(spec, device, **kw)
        self.decode_schedule = decode_schedule


class _ScheduledBackend(ReferenceBackend):
    @classmethod
    def get_builder_cls(cls):
        return _ScheduledBuilder


def test_decode_schedule_rows_where_the_builder_has_the_option(tmp_path):
    rows = _rows(tmp_path, "--batches", "two_mode", "--no-adapter", ours_backend=_ScheduledBackend)
    backends = {r["backend"] for r in rows if r["case"] == "decode_ragged"}
    assert backends == {"reference", "reference_balanced"}  # "uniform" refused: no rows
    plain = _rows(tmp_path, "--batches", "two_mode", "--no-adapter", ours_backend=ReferenceBackend)
    assert {r["backend"] for r in plain if r["case"] == "decode_ragged"} == {"reference"}


def test_optional_builder_keywords_are_dropped_where_refused():
    spec = SMOKE_LAYER.spec()
    builder, took = construct_builder(ReferenceMetadataBuilder, spec, "cpu", dict(num_blocks=10, max_model_len=99),
                                      max_num_reqs=4)
    assert took == {"num_blocks": 10} and builder.num_blocks == 10 and builder.max_num_reqs == 4

    class Paged(ReferenceMetadataBuilder):
        def __init__(self, spec, device="cpu", *, num_blocks=None, **kw):
            super().__init__(spec, device, **kw)
            self.num_blocks = num_blocks

    builder, took = construct_builder(Paged, spec, "cpu", dict(num_blocks=10, max_model_len=99))
    assert took == {"num_blocks": 10} and builder.num_blocks == 10
    with pytest.raises(TypeError, match="decode_schedule"):
        construct_builder(Paged, spec, "cpu", dict(num_blocks=10), decode_schedule="balanced")


def test_a_wrong_page_table_for_the_peer_is_flagged(tmp_path, monkeypatch):
    """The correctness check has teeth: page ids handed to the peer in the wrong order give flagged rows."""
    plan_inputs = Case.plan_inputs

    def rolled(self, lo, hi):
        p = plan_inputs(self, lo, hi)
        p.kv_indices = p.kv_indices.roll(1)
        return p

    monkeypatch.setattr(Case, "plan_inputs", rolled)
    rows = _rows(tmp_path, "--batches", "uniform_4096", "--no-adapter", ours_backend=ReferenceBackend)
    ragged = [r for r in rows if r["case"] == "decode_ragged"]
    assert ragged and all(r["diff_ok"] is False and r["max_abs_diff"] > 2e-2 for r in ragged)


def test_the_stand_in_checks_what_it_is_handed():
    fi = torch_paged_wrappers()
    w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(8, dtype=torch.uint8), "NHD", use_tensor_cores=True)
    indptr, last = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    with pytest.raises(TypeError, match="int32"):
        w.plan(indptr.long(), torch.tensor([0, 1], dtype=torch.int32), last, 8, 2, 64, 16)
    with pytest.raises(ValueError, match="seq_lens"):
        w.plan(indptr, torch.tensor([0, 1], dtype=torch.int32), last, 8, 2, 64, 16,
               seq_lens=torch.tensor([30], dtype=torch.int32))
    with pytest.raises(TypeError):  # optional arguments are keyword-only, as the suite passes them
        w.plan(indptr, torch.tensor([0, 1], dtype=torch.int32), last, 8, 2, 64, 16, "NONE")


def test_needs_a_gpu_without_cpu_smoke(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert main([]) == 2
    assert "--cpu-smoke" in capsys.readouterr().err
    assert decode.DIFF_LIMIT == 2e-2


@pytest.mark.parametrize("gpus", [1, 2])
def test_run_py_keeps_the_suite_rows(tmp_path, monkeypatch, gpus):
    """benchmarks.run's path for the suite (rows file, result JSON, markdown table, RESULTS.md), with --cpu-smoke
    standing in for the GPU run; a suite of several GPUs names its files and header by their count."""
    import dataclasses

    from benchmarks import run
    from benchmarks.report import gpu_slug

    monkeypatch.setitem(run.SUITES, "decode", dataclasses.replace(
        SUITES["decode"], args=("--cpu-smoke", "--batches", "b1_16384", "--no-adapter"), gpus=gpus))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    complete, line = run.run_suite("decode", tmp_path)
    assert complete, line
    slug = "h100" if gpus == 1 else f"h100x{gpus}"
    data = json.loads(next(tmp_path.glob(f"{slug}-decode-*.json")).read_text())
    assert gpu_slug(data["gpu"], data.get("world_size", 1)) == slug
    assert data["suite"] == "decode" and data["complete"] and {r["case"] for r in data["rows"]} == {
        "copy_roof", "decode_ragged", "decode_host", "decode_roof"}
    assert "| decode_ragged" in next(tmp_path.glob(f"{slug}-decode-*.md")).read_text()
    assert "## decode (H100" in run.write_index(tmp_path).read_text()
