"""The merge-by-log-sum-exp combine as a ``@triton.jit`` helper, shared by every kernel that merges partial
attention results over disjoint key sets (``merge_attn_states``, the Triton split-KV reduction and the decode
launch that merges its own segments, MLA decode).

For partials (o_s, lse_s): m = max lse_s, w_s = e^(lse_s - m) / sum_s e^(lse_s - m), o = sum_s w_s o_s,
lse = m + log(sum_s e^(lse_s - m)). A partial whose lse is -inf contributes nothing, whatever its output holds
(NaN included); when every lse is -inf the output is 0 and the lse -inf (DESIGN.md, "merge_attn_states").
"""

import triton
import triton.language as tl

__all__ = ["merge_by_lse"]


@triton.jit
def merge_by_lse(parts, lse, BASE2: tl.constexpr):
    """Merge ``parts`` [..., S, D] float32 (each normalised over its own keys) by ``lse`` [..., S] float32 (natural
    log, or base 2 when BASE2; -inf = no keys) over the S axis, independently for each leading index (none, or a
    block of rows). Returns (out [..., D] float32, lse [...] float32 in the same base)."""
    m = tl.max(lse, -1)
    # every lse -inf: keep the exponent arguments finite so no NaN appears; the weights are zeroed below.
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    if BASE2:
        w = tl.exp2(lse - tl.expand_dims(m_safe, -1))
    else:
        w = tl.exp(lse - tl.expand_dims(m_safe, -1))
    w = tl.where(lse == float("-inf"), 0.0, w)
    total = tl.sum(w, -1)
    safe_total = tl.where(total > 0.0, total, 1.0)
    w = w * tl.expand_dims(tl.where(total > 0.0, 1.0 / safe_total, 0.0), -1)
    w = tl.expand_dims(w, -1)  # [..., S, 1]
    # where(), not a multiply, so a NaN in an ignored partial cannot leak through 0 * NaN.
    out = tl.sum(tl.where(w > 0.0, parts * w, 0.0), -2)
    if BASE2:
        log_total = tl.log2(safe_total)
    else:
        log_total = tl.log(safe_total)
    return out, tl.where(total > 0.0, m_safe + log_total, float("-inf"))
