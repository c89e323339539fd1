"""reshape_and_cache: the Triton kernel (interpreted on CPU) against a plain-python per-slot reference."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from attnbackends.ops.kv_cache_write import (  # noqa: E402
    check_reshape_and_cache_args,
    reshape_and_cache,
    reshape_and_cache_torch,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _expected(key, value, cache, slots, k_scale, v_scale):
    cache = cache.clone()
    block_size = cache.shape[2]
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        for i, (x, scale) in enumerate(((key[t], k_scale), (value[t], v_scale))):
            if cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                limit = torch.finfo(cache.dtype).max
                x = (x.float() / float(scale)).clamp(-limit, limit)
            cache[s // block_size, i, s % block_size] = x.to(cache.dtype)
    return cache


def _inputs(cache_dtype, num_kv_heads=3, head_size=80, block_size=16, num_tokens=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_blocks = 6
    # Keys as a strided view of a fused projection, as engines pass them.
    fused = torch.randn(num_tokens, 3, num_kv_heads, head_size, generator=g).to(torch.bfloat16) * 4
    key, value = fused[:, 1], fused[:, 2]
    cache = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_size, generator=g).to(cache_dtype)
    perm = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots = perm.to(torch.int64)
    slots[1] = -1
    slots[-1] = -1
    return key.to(DEVICE), value.to(DEVICE), cache.to(DEVICE), slots.to(DEVICE)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("scales_as_tensors", [False, True])
@pytest.mark.parametrize("tokens_per_program", [None, 4])
def test_reshape_and_cache(cache_dtype, scales_as_tensors, tokens_per_program):
    key, value, cache, slots = _inputs(cache_dtype)
    k_scale, v_scale = (0.02, 0.05) if cache_dtype != torch.bfloat16 else (1.0, 1.0)
    expected = _expected(key.cpu(), value.cpu(), cache.cpu(), slots.cpu(), k_scale, v_scale)
    if scales_as_tensors:
        k_scale = torch.tensor([k_scale], dtype=torch.float32, device=DEVICE)
        v_scale = torch.tensor([v_scale], dtype=torch.float32, device=DEVICE)
    reshape_and_cache(key, value, cache, slots, k_scale, v_scale, tokens_per_program=tokens_per_program)
    # Bit-exact, padding slots (-1) untouched: every other slot keeps its random old contents.
    assert torch.equal(cache.cpu().view(torch.uint8) if cache.element_size() == 1 else cache.cpu(),
                       expected.view(torch.uint8) if expected.element_size() == 1 else expected)


@pytest.mark.parametrize("block_size,num_kv_heads,head_size,tokens_per_program",
                         [(32, 1, 32, 1), (16, 8, 64, 2), (16, 2, 256, 1), (16, 2, 256, 8)])
def test_reshape_and_cache_shapes(block_size, num_kv_heads, head_size, tokens_per_program):
    """Token counts that are not a multiple of the tokens per program: the last program's tail is masked."""
    key, value, cache, slots = _inputs(torch.bfloat16, num_kv_heads, head_size, block_size, num_tokens=7, seed=1)
    expected = _expected(key.cpu(), value.cpu(), cache.cpu(), slots.cpu(), 1.0, 1.0)
    reshape_and_cache(key, value, cache, slots, tokens_per_program=tokens_per_program)
    assert torch.equal(cache.cpu(), expected)


def test_torch_fallback_matches():
    key, value, cache, slots = _inputs(torch.float8_e4m3fn)
    expected = _expected(key.cpu(), value.cpu(), cache.cpu(), slots.cpu(), 0.03, 0.04)
    reshape_and_cache_torch(key, value, cache, slots, 0.03, 0.04)
    assert torch.equal(cache.cpu().view(torch.uint8), expected.view(torch.uint8))


def test_saturates():
    key, value, cache, slots = _inputs(torch.float8_e4m3fn)
    key = key * 1e4
    reshape_and_cache(key, value, cache, slots, 1.0, 1.0)
    written = cache[slots[0] // 16, 0, slots[0] % 16].float()
    assert torch.isfinite(written).all() and written.abs().max() == 448.0


@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(slot_mapping=a["slot_mapping"].int()), "slot_mapping"),
    (lambda a: a.update(key=a["key"][:, :1]), "key"),
    (lambda a: a.update(kv_cache=a["kv_cache"][:, 0]), "kv_cache"),
    (lambda a: a.update(k_scale=-1.0), "k_scale"),
    (lambda a: a.update(value=a["value"].half()), "dtype"),
])
def test_validation(change, match):
    key, value, cache, slots = _inputs(torch.bfloat16)
    a = dict(key=key, value=value, kv_cache=cache, slot_mapping=slots)
    change(a)
    with pytest.raises(ValueError, match=match):
        check_reshape_and_cache_args(**a)


@pytest.mark.parametrize("tokens_per_program", [1, 4])
def test_slot_outside_the_cache_is_skipped_and_reported(tokens_per_program):
    """A slot past the cache (or below -1) is not written, the other tokens of its program are, and the first bad
    token of the program is reported."""
    from attnbackends.ops.page_guard import PageTableError, raise_pending_faults

    key, value, cache, slots = _inputs(torch.bfloat16, num_tokens=9, seed=2)
    slots[5] = cache.shape[0] * cache.shape[2] + 3
    good = slots.clone()
    good[5] = -1
    expected = _expected(key.cpu(), value.cpu(), cache.cpu(), good.cpu(), 1.0, 1.0)
    with pytest.raises(PageTableError, match=r"slot_mapping\[5\]"):
        reshape_and_cache(key, value, cache, slots, tokens_per_program=tokens_per_program)
        raise_pending_faults(cache.device)
    assert torch.equal(cache.cpu(), expected)


def test_tokens_per_program_must_be_a_power_of_two():
    key, value, cache, slots = _inputs(torch.bfloat16)
    with pytest.raises(ValueError, match="tokens_per_program"):
        reshape_and_cache(key, value, cache, slots, tokens_per_program=3)


def test_finish_cache_write_writes_flagged_and_uncovered_tokens_only():
    """After a kernel that wrote the first ``num_covered`` tokens itself: only its flagged tokens and every token
    from ``num_covered`` on are written (the others keep what the cache held), and the flags are cleared."""
    from attnbackends.ops.kv_cache_write import finish_cache_write

    key, value, cache, slots = _inputs(torch.bfloat16, num_tokens=9, seed=3)
    todo = torch.zeros(12, dtype=torch.int8, device=DEVICE)
    todo[[0, 4]] = 1
    num_covered = 6
    written = torch.full_like(slots, -1)
    written[[0, 4]] = slots[[0, 4]]
    written[num_covered:] = slots[num_covered:]
    expected = _expected(key.cpu(), value.cpu(), cache.cpu(), written.cpu(), 1.0, 1.0)
    finish_cache_write(key, value, cache, slots, todo, num_covered)
    assert torch.equal(cache.cpu(), expected)
    assert not todo.any()
