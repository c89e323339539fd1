"""The cost model that decides how many SMs the Gluon prefill leaves to the cache write beside it."""

from hypothesis import given, settings
from hypothesis import strategies as st

from attnbackends.triton import write_beside as wb


def _batch(num_seqs: int, length: int, heads=32, kv_heads=8, head=128):
    """(flops, write bytes, items) of ``num_seqs`` fresh causal prefills of ``length`` tokens, bf16."""
    flops = 4.0 * heads * head * num_seqs * length * (length + 1) / 2
    return flops, wb.cache_write_bytes(num_seqs * length, kv_heads, head, 2, 2), heads * num_seqs * -(-length // 128)


def test_bytes_count_reads_and_writes_of_keys_and_values():
    assert wb.cache_write_bytes(10, 8, 128, 2, 2) == 2 * 10 * 8 * 128 * 4
    assert wb.cache_write_bytes(10, 8, 128, 2, 1) == 2 * 10 * 8 * 128 * 3


def test_many_short_prefills_leave_sms_to_the_write_and_tiny_ones_do_not():
    flops, nbytes, items = _batch(16, 1024)
    k = wb.cache_write_sms(flops=flops, write_bytes=nbytes, items=items, num_sms=132)
    assert 0 < k <= 33
    assert wb.overlapped_us(flops, nbytes, items, 132, k) < wb.serial_us(flops, nbytes, items, 132) - wb.MIN_GAIN_US
    flops, nbytes, items = _batch(1, 64)
    assert wb.cache_write_sms(flops=flops, write_bytes=nbytes, items=items, num_sms=132) == 0
    assert wb.cache_write_sms(flops=flops, write_bytes=nbytes, items=items, num_sms=4) == 0


@settings(max_examples=200, deadline=None)
@given(num_seqs=st.integers(1, 256), length=st.integers(1, 16384), num_sms=st.integers(1, 200))
def test_the_choice_is_in_range_and_never_slower_in_the_model(num_seqs, length, num_sms):
    flops, nbytes, items = _batch(num_seqs, length)
    k = wb.cache_write_sms(flops=flops, write_bytes=nbytes, items=items, num_sms=num_sms)
    assert 0 <= k <= num_sms // 4
    if k:
        serial = wb.serial_us(flops, nbytes, items, num_sms)
        beside = wb.overlapped_us(flops, nbytes, items, num_sms, k)
        assert beside <= serial - max(wb.MIN_GAIN_US, wb.MIN_GAIN_FRACTION * serial)
        assert all(beside <= wb.overlapped_us(flops, nbytes, items, num_sms, j) for j in range(1, num_sms // 4 + 1))


def test_more_write_per_flop_wants_at_least_as_many_sms():
    """The same prefill work with a larger write (more KV heads) never gets fewer SMs for the write."""
    flops, _, items = _batch(16, 1024)
    ks = [wb.cache_write_sms(flops=flops, write_bytes=wb.cache_write_bytes(16 * 1024, kv, 128, 2, 2), items=items,
                             num_sms=132) for kv in (1, 2, 4, 8, 16, 32)]
    assert ks == sorted(ks) and ks[-1] > 0
