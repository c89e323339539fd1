"""The step's KV-cache write beside the persistent Gluon prefill: how many SMs the prefill leaves to it.

A batch of fresh prefills reads its keys and values from the forward's ``key``/``value``, not from the cache, so
the write into the cache need not come first. The prefill is compute-bound and keeps one program per SM (its
registers fill the SM: nothing else fits beside a program); the write is bandwidth-bound and needs few SMs to move
its bytes. The builder may therefore plan the prefill on ``num_sms - k`` SMs, on a high-priority stream, and the
write on the forward's stream, where the hardware runs it on the ``k`` SMs left free (and on every SM the prefill
gives back when it ends). :func:`cache_write_sms` picks ``k`` from a cost model:

- prefill on ``p`` programs: ``flops / (min(items, p) * PREFILL_FLOPS_PER_SM_US)``;
- write on ``k`` SMs: ``bytes / (k * WRITE_BYTES_PER_SM_US)`` until the prefill ends, the rest at
  ``WRITE_BYTES_PER_US`` (the whole GPU);
- one after the other: the prefill on every SM, then the write at ``WRITE_BYTES_PER_US``.

It returns 0 (the write first, on one stream) unless the overlap saves at least ``MIN_GAIN_US`` and
``MIN_GAIN_FRACTION``. The constants are the H100 measurements in ``benchmarks/NOTES-triton.md``; near the optimum
the time is flat in ``k`` (a quarter off in the prefill's estimate moves the result by about 1%).
"""

from __future__ import annotations

__all__ = ["cache_write_bytes", "cache_write_sms", "overlapped_us", "serial_us"]

#: Dense causal prefill work one SM of the Gluon kernel does per microsecond (FLOP), across the bench's shapes.
PREFILL_FLOPS_PER_SM_US = 3.8e6
#: Bytes the write kernel moves per microsecond on one SM when the rest of the GPU computes (read + written).
WRITE_BYTES_PER_SM_US = 1.5e5
#: Bytes the write kernel moves per microsecond on the whole GPU (read + written).
WRITE_BYTES_PER_US = 2.6e6
#: Least saving (us, and fraction of the serial time) for which the forward runs the write beside the prefill.
MIN_GAIN_US = 8.0
MIN_GAIN_FRACTION = 0.02


def cache_write_bytes(num_tokens: int, num_kv_heads: int, head_size: int, element_size: int,
                      cache_element_size: int) -> int:
    """Bytes the write of ``num_tokens`` tokens' keys and values reads (``element_size`` each) and writes
    (``cache_element_size`` each)."""
    return 2 * num_tokens * num_kv_heads * head_size * (element_size + cache_element_size)


def serial_us(flops: float, write_bytes: float, items: int, num_sms: int) -> float:
    """Modelled time of the write and then the prefill, one after the other."""
    return flops / (min(items, num_sms) * PREFILL_FLOPS_PER_SM_US) + write_bytes / WRITE_BYTES_PER_US


def overlapped_us(flops: float, write_bytes: float, items: int, num_sms: int, k: int) -> float:
    """Modelled time of the prefill on ``num_sms - k`` programs beside the write on the other ``k`` SMs."""
    prefill = flops / (min(items, num_sms - k) * PREFILL_FLOPS_PER_SM_US)
    beside = prefill * k * WRITE_BYTES_PER_SM_US  # bytes written while the prefill runs
    if beside >= write_bytes:
        return prefill
    return prefill + (write_bytes - beside) / WRITE_BYTES_PER_US


def cache_write_sms(*, flops: float, write_bytes: float, items: int, num_sms: int) -> int:
    """SMs the prefill leaves to the write (0: the write runs first, alone).

    Parameters
    ----------
    flops : the prefill's causal attention work (2 matmuls x 2 FLOP per query-key pair, head and dimension).
    write_bytes : what the write moves (:func:`cache_write_bytes`).
    items : the prefill's work items (query blocks x query heads); ``num_sms`` : the GPU's SMs.
    """
    if num_sms < 8 or flops <= 0 or write_bytes <= 0:
        return 0
    serial = serial_us(flops, write_bytes, items, num_sms)
    best_k, best = 0, serial
    for k in range(1, num_sms // 4 + 1):
        t = overlapped_us(flops, write_bytes, items, num_sms, k)
        if t < best:
            best_k, best = k, t
    gain = serial - best
    return best_k if gain >= MIN_GAIN_US and gain >= MIN_GAIN_FRACTION * serial else 0
