"""The conformance suite as a third party meets it: declined cases skip with the backend's reasons, a backend that
is off by a 1% scale fails the fp8 cases (and at 5% every case), string dtypes work, and the README's snippet runs as
written."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnbackends.reference.backend import ReferenceBackend, ReferenceImpl
from attnbackends.testing import (
    CaseNotSupported,
    check_backend_case,
    check_backend_case_or_raise,
    conformance_cases,
    sweep,
    tolerance_for,
)

README = Path(__file__).resolve().parents[1] / "README.md"


def scaled_backend(factor: float) -> type:
    """The reference backend with its output multiplied by ``factor`` (a systematic scale error)."""

    class ScaledImpl(ReferenceImpl):
        def forward(self, query, key, value, kv_cache, metadata, output):
            super().forward(query, key, value, kv_cache, metadata, output)
            n = metadata.common.num_actual_tokens
            output[:n] *= factor
            return output

    class ScaledBackend(ReferenceBackend):
        name = f"scaled_{factor}"

        @classmethod
        def get_impl_cls(cls):
            return ScaledImpl

    return ScaledBackend


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_scale_errors_fail_the_cases(dtype):
    cases = conformance_cases(dtype, 32, 16)
    fp8 = {c.name for c in cases if c.name.startswith("fp8")}
    assert len(fp8) == 2
    exact = sweep(ReferenceBackend, cases)
    assert all(r == "ok" for r in exact.values()), exact  # the control: the unscaled backend passes every case
    one_percent = sweep(scaled_backend(1.01), cases)
    assert all(one_percent[name].startswith("FAILED") for name in fp8), one_percent
    five_percent = sweep(scaled_backend(1.05), cases)
    assert all(r.startswith("FAILED") for r in five_percent.values()), five_percent


def test_declined_case_is_skipped_with_the_backends_reasons():
    case = next(c for c in conformance_cases("float16", 32, 16) if c.name.startswith("sinks"))

    class NoSinks(ReferenceBackend):
        name = "no_sinks"
        supports_sinks = False

    with pytest.raises(pytest.skip.Exception, match="no_sinks declines sinks-float16-h32-b16: attention sinks not supported"):
        check_backend_case(NoSinks, case)
    with pytest.raises(CaseNotSupported, match="attention sinks not supported"):
        check_backend_case_or_raise(NoSinks, case)
    assert sweep(NoSinks, [case])[case.name].startswith("unsupported: attention sinks")


def test_case_declined_at_run_time_is_skipped():
    class DecliningImpl(ReferenceImpl):
        def forward(self, *args):
            raise CaseNotSupported(["this build has no fp8 path"])

    class Declining(ReferenceBackend):
        name = "declining"

        @classmethod
        def get_impl_cls(cls):
            return DecliningImpl

    with pytest.raises(pytest.skip.Exception, match="this build has no fp8 path"):
        check_backend_case(Declining, conformance_cases()[0])


def test_string_dtypes():
    assert tolerance_for("bfloat16") == tolerance_for(torch.bfloat16) == tolerance_for("bf16")
    assert tolerance_for("float16", "fp8") == tolerance_for(torch.float16, "fp8")
    assert [c.name for c in conformance_cases(torch.bfloat16)] == [c.name for c in conformance_cases("bfloat16")]
    with pytest.raises(ValueError, match="dtype 'int8' has no tolerance; allowed: float16, bfloat16"):
        tolerance_for("int8")


def test_absent_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ValueError, match="device='cuda' was requested but .*; use device='cpu'"):
        check_backend_case(ReferenceBackend, conformance_cases()[0], device="cuda")


def readme_snippet() -> str:
    section = README.read_text().split("## Testing your own backend", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "README's 'Testing your own backend' section has no python snippet"
    return match.group(1)


def test_readme_snippet_runs_as_written(tmp_path):
    path = tmp_path / "test_readme_snippet.py"
    path.write_text(readme_snippet())
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(path)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    passed = re.search(r"\b(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= 15 and "failed" not in proc.stdout, proc.stdout[-2000:]


def test_readme_links_only_to_files_in_the_repository():
    root = README.parent
    text = README.read_text()
    links = re.findall(r"\]\(([^)#]+)\)", text)
    paths = re.findall(r"`((?:docs|examples|tests|attnbackends|benchmarks)/[\w./-]+\.(?:md|py|yaml|sh))`", text)
    assert links, "README links to nothing"
    missing = [p for p in links + paths if not p.startswith("http") and not (root / p).exists()]
    assert not missing, f"README points to files that are not in the repository: {missing}"
    assert not re.search(r"(?<![/\w])DESIGN\.md", text.replace("docs/DESIGN.md", "")), "bare DESIGN.md reference"
