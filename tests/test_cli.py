from attnbackends.cli import main


def test_list(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in ("reference", "triton", "flashinfer"):
        assert name in out


def test_explain_names_chosen_and_rejections(capsys):
    assert main(["explain", "--head-size", "128", "--kv-cache-dtype", "fp8", "--compute-capability", "9.0"]) == 0
    out = capsys.readouterr().out
    assert "chosen" in out and "rejected" in out


def test_explain_explicit_choice_that_does_not_fit(capsys, monkeypatch):
    monkeypatch.delenv("ATTNBACKENDS_BACKEND", raising=False)
    assert main(["explain", "--cpu", "--backend", "flashinfer"]) == 1
    assert "no backend fits" in capsys.readouterr().out


def test_explain_invalid_spec_is_a_clear_error(capsys):
    assert main(["explain", "--num-heads", "6", "--num-kv-heads", "4"]) == 2
    assert "num_heads" in capsys.readouterr().out


def test_demo_on_cpu(capsys, monkeypatch):
    monkeypatch.delenv("ATTNBACKENDS_BACKEND", raising=False)
    assert main(["demo", "--device", "cpu", "--prompts", "3", "--new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "backend chosen: reference" in out and "100.0% of tokens identical" in out
