"""The step's KV-cache write beside the persistent Gluon prefill: whether, and on how many SMs.

Used where the kernel does not write the cache itself (:func:`.prefill_hopper.cache_write_reason`, or the
builder's ``hopper_cache_write=False``). A batch of fresh prefills reads its keys and values from the forward's
``key``/``value``, not from the cache, so the write into the cache need not come first. The prefill is
compute-bound and keeps one program per SM (its registers fill the SM: nothing else fits beside a program); the
write is bandwidth-bound. The builder may therefore plan the prefill on ``num_sms - k`` SMs, on a high-priority
stream, and the write on the forward's stream, where the hardware runs it on the ``k`` SMs left free and then on
every SM the prefill gives back (the step plan's ``WritePolicy.BESIDE``, :mod:`.step_plan`).

Why a rule and not always: a few SMs move the write at well under their share of the GPU's bandwidth, and the
write streaming through L2 beside a prefill of long sequences slows that prefill by more than the write saves. The
overlap pays where the write is a large share of the step (many short prefills) and costs where it is small (long
ones). :func:`cache_write_sms` encodes that: ``k`` SMs (:data:`WRITE_SM_FRACTION` of the GPU) when the write is at
least :data:`MIN_WRITE_SHARE` of the write-then-prefill time and the prefill is long enough to hide the second
stream's host cost, else 0 (the write first, one stream). The model's constants come from the write-beside
measurements in ``benchmarks/NOTES.md``.
"""

from __future__ import annotations

__all__ = ["cache_write_bytes", "cache_write_sms", "write_share"]

#: Dense causal prefill work one SM of the Gluon kernel does per microsecond (FLOP), at its slowest shape.
PREFILL_FLOPS_PER_SM_US = 3.5e6
#: Bytes the write kernel moves per microsecond on the whole GPU (read + written).
WRITE_BYTES_PER_US = 2.6e6
#: SMs left to the write, as a fraction of the GPU's (at least one).
WRITE_SM_FRACTION = 0.03
#: Least share of the write in the write-then-prefill time for which it runs beside the prefill.
MIN_WRITE_SHARE = 0.10
#: Least modelled prefill time (us) for which a second stream pays its host cost.
MIN_PREFILL_US = 50.0


def cache_write_bytes(num_tokens: int, num_kv_heads: int, head_size: int, element_size: int,
                      cache_element_size: int) -> int:
    """Bytes the write of ``num_tokens`` tokens' keys and values reads (``element_size`` each) and writes
    (``cache_element_size`` each)."""
    return 2 * num_tokens * num_kv_heads * head_size * (element_size + cache_element_size)


def write_share(flops: float, write_bytes: float, num_sms: int) -> tuple[float, float]:
    """(modelled prefill us on ``num_sms`` SMs, the write's share of the write-then-prefill time)."""
    prefill_us = flops / (num_sms * PREFILL_FLOPS_PER_SM_US)
    write_us = write_bytes / WRITE_BYTES_PER_US
    return prefill_us, write_us / (prefill_us + write_us)


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
    k = max(1, round(num_sms * WRITE_SM_FRACTION))
    prefill_us, share = write_share(flops, write_bytes, min(items, num_sms))
    return k if prefill_us >= MIN_PREFILL_US and share >= MIN_WRITE_SHARE else 0
