"""The rule that decides whether, and on how many SMs, the cache write runs beside the Gluon prefill."""

from hypothesis import given, settings
from hypothesis import strategies as st

from attnbackends.triton import write_beside as wb


def _batch(num_seqs: int, length: int, heads=32, kv_heads=8, head=128):
    """(flops, write bytes, items) of ``num_seqs`` fresh causal prefills of ``length`` tokens, bf16."""
    flops = 4.0 * heads * head * num_seqs * length * (length + 1) / 2
    return flops, wb.cache_write_bytes(num_seqs * length, kv_heads, head, 2, 2), heads * num_seqs * -(-length // 128)


def _sms(num_seqs, length, num_sms=132, **kw):
    flops, nbytes, items = _batch(num_seqs, length, **kw)
    return wb.cache_write_sms(flops=flops, write_bytes=nbytes, items=items, num_sms=num_sms)


def test_bytes_count_reads_and_writes_of_keys_and_values():
    assert wb.cache_write_bytes(10, 8, 128, 2, 2) == 2 * 10 * 8 * 128 * 4
    assert wb.cache_write_bytes(10, 8, 128, 2, 1) == 2 * 10 * 8 * 128 * 3


def test_many_short_prefills_write_beside_and_long_or_tiny_ones_do_not():
    """The bench shapes: 16 x 1024 (the write a large share) beside, 4 x 4096 and 1 x 8192 (a small share) and a
    prefill too short to hide a second stream not."""
    assert _sms(16, 1024) == round(132 * wb.WRITE_SM_FRACTION) > 0
    assert _sms(64, 256) > 0
    assert _sms(4, 4096) == _sms(1, 8192) == 0
    assert _sms(1, 64) == _sms(2, 300) == 0
    assert _sms(16, 1024, num_sms=4) == 0


@settings(max_examples=200, deadline=None)
@given(num_seqs=st.integers(1, 256), length=st.integers(1, 16384), num_sms=st.integers(1, 200),
       kv_heads=st.sampled_from([1, 2, 4, 8, 16, 32]))
def test_the_choice_follows_the_share_rule(num_seqs, length, num_sms, kv_heads):
    flops, nbytes, items = _batch(num_seqs, length, kv_heads=kv_heads)
    k = wb.cache_write_sms(flops=flops, write_bytes=nbytes, items=items, num_sms=num_sms)
    assert k in (0, max(1, round(num_sms * wb.WRITE_SM_FRACTION)))
    assert k <= num_sms // 4
    prefill_us, share = wb.write_share(flops, nbytes, min(items, num_sms))
    if k:
        assert share >= wb.MIN_WRITE_SHARE and prefill_us >= wb.MIN_PREFILL_US
    elif num_sms >= 8:
        assert share < wb.MIN_WRITE_SHARE or prefill_us < wb.MIN_PREFILL_US


def test_more_write_per_flop_never_turns_the_overlap_off():
    """The same prefill work with a larger write (more KV heads) writes beside it at least as readily."""
    ks = [_sms(8, 2048, kv_heads=kv) for kv in (1, 2, 4, 8, 16, 32)]
    assert ks == sorted(ks) and ks[0] == 0 and ks[-1] > 0
