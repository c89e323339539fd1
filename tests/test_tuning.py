"""Measured selection from stored profiles (fabricated: the timing itself needs the GPU): the key, the ranking and
its reasons, select()/explain() under selection="measured", and the fall-back to the static list, never silent."""

import json

import pytest

from attnbackends import AttentionConfig, AttentionSpec, DeviceInfo, explain, select
from attnbackends.cli import main
from attnbackends.selection import phased_backend, phased_name
from attnbackends.selection.registry import environment_facts, get_backend_class
from attnbackends.selection.tune_timing import GRIDS, run_tune
from attnbackends.selection.tuning import Profile, choose, default_profile_dir, environment_key, load_profile, profile_path

SPEC = AttentionSpec(num_heads=32, num_kv_heads=8, head_size=128, dtype="bfloat16", block_size=16)
H100 = DeviceInfo.cuda(9, 0, name="NVIDIA H100 80GB HBM3")
SHAPES = [s.as_dict() for s in GRIDS["small"]]
PHASED = phased_name("triton", "reference")


def times(decode, prefill, mixed):
    by_phase = {"decode": decode, "prefill": prefill, "mixed": mixed}
    return {s["label"]: by_phase[s["phase"]] for s in SHAPES}


def store(tmp_path, times_us, spec=SPEC, device=H100, errors=None):
    profile = Profile(key=environment_key(spec, device, environment_facts()), shapes=SHAPES, times_us=times_us,
                      errors=errors or {})
    return profile.save(tmp_path)


def config(tmp_path, **kw):
    return AttentionConfig(selection="measured", profile_dir=str(tmp_path), **kw)


def test_profile_round_trip_and_key(tmp_path):
    path = store(tmp_path, {"triton": times(10, 20, 30)})
    facts = environment_facts()
    assert path == profile_path(environment_key(SPEC, H100, facts), tmp_path)
    assert path.name.startswith("nvidia-h100-80gb-hbm3-")
    found_path, profile = load_profile(SPEC, H100, tmp_path, facts)
    assert found_path == path and profile.times_us["triton"][SHAPES[0]["label"]] == 10
    key = json.loads(path.read_text())["key"]
    assert {"gpu", "driver", "torch", "triton", "flashinfer", "flash_attn", "attnbackends", "spec"} <= set(key)
    assert load_profile(SPEC.model_copy(update={"head_size": 64}), H100, tmp_path, facts) is None
    assert load_profile(SPEC, DeviceInfo.cuda(9, 0, name="NVIDIA H200"), tmp_path, facts) is None
    assert load_profile(SPEC, H100, tmp_path, {**facts, "flashinfer": "0.0-other"}) is None


def test_the_key_holds_what_the_backend_classes_report():
    """Selection learns what is installed behind a backend from its class (AttentionBackend.environment_facts),
    never from the backend's modules; a fact cannot replace one of the key's own entries."""
    from attnbackends.flash_attn.backend import FlashAttnBackend
    from attnbackends.flashinfer.backend import FlashInferBackend

    facts = environment_facts()
    assert facts["flashinfer"] == FlashInferBackend.environment_facts()["flashinfer"]
    assert facts["flash_attn"] == FlashAttnBackend.environment_facts()["flash_attn"]
    key = environment_key(SPEC, H100, {"gpu": "elsewhere", "mylib": "1.2"})
    assert key["gpu"] == H100.name and key["mylib"] == "1.2"


def test_default_profile_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_profile_dir() == tmp_path / "attnbackends" / "profiles"
    assert default_profile_dir(AttentionConfig(profile_dir="/x/y")) == __import__("pathlib").Path("/x/y")


def test_measured_winner_is_chosen_and_explained(tmp_path):
    store(tmp_path, {"triton": times(10, 40, 60), "reference": times(500, 30, 900), PHASED: times(10.2, 31, 45)})
    result = explain(SPEC, H100, config(tmp_path))
    assert result.chosen == PHASED
    assert result.measured.winner == PHASED and result.measured.ranking == [PHASED, "triton", "reference"]
    assert any("won: score" in note and "next triton" in note for note in result.notes)
    text = str(result)
    assert "measured (" in text and PHASED in text and "chosen" in text
    assert select(SPEC, H100, config(tmp_path)) is phased_backend("triton", "reference")


def test_candidates_that_do_not_fit_now_are_not_ranked(tmp_path):
    store(tmp_path, {"flashinfer": times(1, 1, 1), "triton": times(10, 40, 60)})
    result = explain(SPEC, H100, config(tmp_path))
    assert result.chosen == "triton"
    row = next(r for r in result.measured.rows if r.name == "flashinfer")
    assert row.score is None and row.status.startswith("does not fit now: flashinfer is not installed")


def test_failed_measurements_are_not_ranked(tmp_path):
    broken = times(1, 1, 1)
    broken[SHAPES[-1]["label"]] = None
    store(tmp_path, {"reference": broken, "triton": times(10, 40, 60)}, errors={"reference": "RuntimeError: boom"})
    result = explain(SPEC, H100, config(tmp_path))
    assert result.chosen == "triton"
    row = next(r for r in result.measured.rows if r.name == "reference")
    assert "not measured on" in row.status and "boom" in row.status


def test_no_profile_falls_back_to_the_static_list_and_says_so(tmp_path, caplog):
    result = explain(SPEC, H100, config(tmp_path))
    assert result.chosen == explain(SPEC, H100).chosen and result.measured is None
    assert any("no stored profile" in note and "attnbackends tune" in note for note in result.notes)
    assert "no stored profile" in caplog.text


def test_score_is_relative_per_shape_and_ties_follow_the_static_order():
    profile = Profile(key={}, shapes=SHAPES, times_us={"a": times(10, 20, 30), "b": times(20, 10, 30),
                                                       "c": times(10, 20, 30)})
    choice = choose(profile, {"a": [], "b": [], "c": []}, ["c", "b", "a"])
    scores = {r.name: r.score for r in choice.rows}
    assert scores["a"] == pytest.approx(scores["c"]) and choice.ranking[0] == "c"
    n_decode = sum(s["phase"] == "decode" for s in SHAPES)
    n_prefill = sum(s["phase"] == "prefill" for s in SHAPES)
    assert scores["a"] == pytest.approx((2 ** n_prefill) ** (1 / len(SHAPES)))
    assert scores["b"] == pytest.approx((2 ** n_decode) ** (1 / len(SHAPES)))


@pytest.mark.parametrize("gain, composition_wins", [(0.99, False), (0.95, True)])
def test_a_composition_must_win_by_the_margin(gain, composition_wins):
    """A composition within COMPOSITION_MARGIN of the best single backend is ranked after it, and the explanation
    says why; one that wins by more is chosen."""
    single = times(10, 20, 30)
    composition = {label: t * gain for label, t in single.items()}
    profile = Profile(key={}, shapes=SHAPES, times_us={"triton": single, PHASED: composition})
    choice = choose(profile, {"triton": [], PHASED: []}, ["triton", PHASED])
    assert choice.winner == (PHASED if composition_wins else "triton")
    assert ("as a phase composition, ranks at its score" in choice.why) == (not composition_wins)


def test_tune_times_whole_steps_and_reports_per_layer(monkeypatch):
    """One timed step = one build on a fresh metadata object + layers_per_step forwards; the profile holds the
    step's time divided by the layer count."""
    from attnbackends.selection import tune_timing
    from attnbackends.reference.backend import ReferenceBackend

    calls = {"build": [], "forward": 0}
    builder_cls, impl_cls = ReferenceBackend.get_builder_cls(), ReferenceBackend.get_impl_cls()
    build, forward = builder_cls.build, impl_cls.forward

    def counting_build(self, common):
        calls["build"].append(common)
        return build(self, common)

    def counting_forward(self, *args, **kwargs):
        calls["forward"] += 1
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(builder_cls, "build", counting_build)
    monkeypatch.setattr(impl_cls, "forward", counting_forward)
    monkeypatch.setattr(tune_timing, "time_us", lambda fn, device: (fn(), 120.0)[1])
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=32, dtype="float32")
    profile = run_tune(spec, DeviceInfo.cpu(), grid="tiny", candidates=["reference"], layers_per_step=3, rounds=1)
    shapes = len(GRIDS["tiny"])
    assert profile.layers_per_step == 3 and profile.errors == {}
    assert all(t == pytest.approx(40.0) for t in profile.times_us["reference"].values())
    assert len(calls["build"]) == 2 * shapes and calls["forward"] == 3 * 2 * shapes  # first call + timed call
    assert len({id(c) for c in calls["build"]}) == len(calls["build"])  # a fresh metadata object every step
    with pytest.raises(ValueError, match="layers_per_step"):
        run_tune(spec, DeviceInfo.cpu(), grid="tiny", candidates=["reference"], layers_per_step=0)


def test_tune_keeps_each_pairs_fastest_round_and_rotates_the_order(monkeypatch):
    """Every (candidate, shape) is timed once per round, rounds start at different pairs, and the profile holds
    each pair's fastest round (a host that slows down during the tune does not decide the ranking)."""
    from attnbackends.selection import tune_timing

    real_batch_for = tune_timing.batch_for

    def tagged_batch_for(spec, shape, device, seed=0):
        batch = real_batch_for(spec, shape, device, seed)
        batch.common.tune_label = shape.label  # read back from the timed step's closure below
        return batch

    timed: list = []

    def fake_time_us(fn, device):
        batch = next(c.cell_contents for c in fn.__closure__ if hasattr(c.cell_contents, "common"))
        us = 100.0 + (len(timed) * 37) % 11  # a host whose speed wanders
        timed.append((batch.common.tune_label, us))
        return us

    monkeypatch.setattr(tune_timing, "batch_for", tagged_batch_for)
    monkeypatch.setattr(tune_timing, "time_us", fake_time_us)
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=32, dtype="float32")
    profile = run_tune(spec, DeviceInfo.cpu(), grid="tiny", candidates=["reference"], layers_per_step=1, rounds=3)
    labels = [shape.label for shape in GRIDS["tiny"]]
    assert sorted(label for label, _ in timed) == sorted(labels * 3)
    firsts = [timed[r * len(labels)][0] for r in range(3)]
    assert len(set(firsts)) > 1 or len(labels) == 1  # each round starts elsewhere
    for label in labels:
        assert profile.times_us["reference"][label] == min(us for lab, us in timed if lab == label)
    with pytest.raises(ValueError, match="rounds"):
        run_tune(spec, DeviceInfo.cpu(), grid="tiny", candidates=["reference"], rounds=0)


def test_explain_cli_shows_the_measured_table(tmp_path, capsys):
    store(tmp_path, {"triton": times(10, 40, 60), PHASED: times(10, 30, 45)}, device=DeviceInfo.cuda(9, 0))
    code = main(["explain", "--compute-capability", "9.0", "--selection", "measured", "--profile-dir", str(tmp_path)])
    out = " ".join(capsys.readouterr().out.split())  # rich wraps at the terminal width
    assert code == 0
    assert f"chosen: {PHASED}" in out and "measured (" in out and f"{PHASED} won: score 1.000" in out


def test_tune_runs_on_the_cpu_with_the_tiny_grid():
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=32, dtype="float16")
    profile = run_tune(spec, DeviceInfo.cpu(), grid="tiny", candidates=["reference", phased_name("reference", "triton")],
                       layers_per_step=2)
    labels = [s["label"] for s in profile.shapes]
    assert set(profile.times_us) == {"reference", phased_name("reference", "triton")}
    assert all(profile.times_us[name][label] > 0 for name in profile.times_us for label in labels)
    assert profile.errors == {}
    assert get_backend_class(phased_name("reference", "triton")).name == phased_name("reference", "triton")
