"""DirectLauncher: the JIT on the first launch per key, the compiled kernel's launcher afterwards (GPU), and the
JIT on every call where that cannot be trusted (interpreter, launch hooks)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from triton import knobs  # noqa: E402

from attnbackends import compat  # noqa: E402
from attnbackends.ops import launch as ops_launch  # noqa: E402
from attnbackends.testing import conformance_cases  # noqa: E402
from attnbackends.triton import launch  # noqa: E402
from attnbackends.triton.backend import TritonAttentionBackend  # noqa: E402


def test_no_launch_hooks_by_default():
    assert not compat.launch_hooks_set()


def test_an_installed_launch_hook_is_seen():
    hook = knobs.runtime.launch_enter_hook
    if not hasattr(hook, "add"):
        pytest.skip(f"this Triton keeps launch hooks as plain callables ({type(hook).__name__})")

    def noop(*args, **kwargs):
        pass

    hook.add(noop)
    try:
        assert compat.launch_hooks_set()
    finally:
        hook.remove(noop)


def _as_addresses(launch_args: tuple) -> tuple:
    """A C launcher's arguments with each tensor as the address its ``data_ptr()`` gives."""
    return tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in launch_args)


def test_a_prepared_launch_passes_what_the_cached_launch_passes(monkeypatch):
    """DescriptorLauncher.prepare on a compiled (descriptor-free) kernel: launch_prepared hands its C launcher the
    arguments a cached launch does, each planned tensor as its address (kept alive by the prepared launch) and the
    leading ones as the call gives them; nothing is prepared before the first launch, nothing launched under a
    hook."""
    received: list = []
    launcher = ops_launch.DescriptorLauncher(lambda: None, ("C",))
    monkeypatch.setattr(ops_launch, "_current_stream", lambda: 77)
    planned = torch.randn(2)
    args = (planned, 3, 0.5)
    assert launcher.prepare("k", args, (16,)) is None
    launcher._compiled["k"] = (lambda *a: received.append(a), "function", ("packed",))
    launcher("k", (3, 1, 2), args, (16,), 4, 2)
    prepared = launcher.prepare("k", args, (16,))
    assert prepared.keep == (planned,) and planned.data_ptr() in prepared.tail
    assert ops_launch.launch_prepared(prepared, (3, 1, 2))
    assert len(received) == 2 and received[1] == _as_addresses(received[0])
    # launch_keeping_prepared: the prepared launch where there is one, else the launcher, then prepared
    assert ops_launch.launch_keeping_prepared(prepared, launcher, "k", (3, 1, 2), args, (16,), 4, 2) is prepared
    fresh = ops_launch.launch_keeping_prepared(None, launcher, "k", (3, 1, 2), args, (16,), 4, 2)
    assert fresh == prepared and len(received) == 4 and _as_addresses(received[3]) == _as_addresses(received[0])
    # a leading argument is the call's: a new tensor there reaches the launcher, the rest stay prepared
    call_a, call_b = torch.randn(3), torch.randn(3)
    with_call = (call_a,) + args
    launcher("k", (3, 1, 2), with_call, (16,), 4, 2)
    lead = launcher.prepare("k", with_call, (16,), 1)
    assert lead.keep == (planned,)
    assert ops_launch.launch_prepared_sequence(((lead, (3, 1, 2), 0, 1),), (call_b,))
    expected = received[4][:9] + (call_b,) + _as_addresses(received[4][10:])
    assert received[-1][9] is call_b and received[-1][:9] == received[4][:9]
    assert received[-1][10:] == expected[10:]
    monkeypatch.setattr(ops_launch, "launch_hooks_set", lambda: True)
    count = len(received)
    assert not ops_launch.launch_prepared(prepared, (3, 1, 2)) and len(received) == count


@pytest.mark.gpu
def test_triton_forward_launches_directly_after_the_first_call():
    case = conformance_cases("bfloat16", 128, 16)[0]
    batch = case.batch("cuda")
    builder = TritonAttentionBackend.get_builder_cls()(case.spec(), "cuda")
    impl = TritonAttentionBackend.get_impl_cls()(case.spec())
    metadata = builder.build(batch.common)
    first = impl.forward(batch.query, batch.key, batch.value, batch.kv_cache, metadata, batch.new_output()).clone()
    assert launch._attention_launcher._compiled, "the first launch did not leave a compiled kernel to reuse"
    again = impl.forward(batch.query, None, None, batch.kv_cache, metadata, batch.new_output())
    torch.cuda.synchronize()
    assert torch.equal(first[: batch.num_actual_tokens], again[: batch.num_actual_tokens])
