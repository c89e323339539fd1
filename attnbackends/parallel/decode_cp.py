"""The context-parallel decode step: local attention with its log-sum-exp, an exchange, an exact merge.

Each rank of the group attends the (replicated) decode queries over the KV blocks it holds
(:func:`attnbackends.parallel.blocks.build_local_metadata`) and gets a partial output normalised over its own keys
plus the natural-log LSE of its logits. The partials of disjoint key sets merge exactly
(DESIGN.md, "merge_attn_states"); this module exchanges them through ``torch.distributed`` and merges with
:func:`attnbackends.ops.merge_attn_states`, so every rank ends with the single-rank answer.

Exchanges (``method``):

- ``"all_gather"``: all-gather the outputs ``[T, H, D]`` and the LSEs ``[H, T]`` of every rank, then merge the N
  partials with N - 1 pairwise ``merge_attn_states`` calls.
- ``"all_reduce"``: all-gather the LSEs only, rescale the local output by ``exp(lse_r - lse)`` and sum the outputs
  with one all-reduce: 1/N of the all-gather's traffic for the outputs (float32 sum).

Supported layer features: causal decode, GQA/MQA, logit soft-cap, attention sinks (merged once, after the
exchange), fp8 KV cache. ALiBi and sliding windows depend on global key positions, which the local kernels do
not see: :func:`check_context_parallel_spec` raises NotImplementedError for them.
"""

from __future__ import annotations

from typing import Literal, Optional, Sequence, Union

import torch
import torch.distributed as dist

from ..interface import AttentionImpl
from ..metadata import CommonAttentionMetadata
from ..ops.merge_attn_states import merge_attn_states
from ..selection.registry import get_backend_class
from ..spec import AttentionSpec

__all__ = [
    "check_context_parallel_spec",
    "cp_decode_attention",
    "exchange_and_merge",
    "local_decode_attention",
    "merge_attn_states_n",
]

Method = Literal["all_gather", "all_reduce"]
Scale = Union[float, torch.Tensor]


def check_context_parallel_spec(spec: AttentionSpec) -> None:
    """Raise if a layer cannot run context-parallel decode (call once at setup).

    Raises
    ------
    NotImplementedError
        ALiBi (``alibi_slopes``) or a sliding window: both need global key positions, the local kernels see
        local ones. MLA specs: use :func:`exchange_and_merge` on the (output, lse) of ``mla_decode`` instead.
    ValueError
        A layer without a KV cache (encoder attention): there is nothing to shard.
    """
    if spec.alibi_slopes is not None:
        raise NotImplementedError("context-parallel decode does not support ALiBi (alibi_slopes): the bias "
                                  "needs global key positions; supported: causal decode, soft-cap, sinks, fp8 KV")
    if spec.sliding_window is not None:
        raise NotImplementedError("context-parallel decode does not support sliding_window: the window needs "
                                  "global key positions; supported: causal decode, soft-cap, sinks, fp8 KV")
    if spec.is_mla:
        raise NotImplementedError("cp_decode_attention runs standard paged attention; for MLA call mla_decode "
                                  "with lse= on the local metadata and merge with exchange_and_merge")
    if not spec.attn_type.uses_kv_cache:
        raise ValueError(f"context parallelism shards the KV cache; attn_type {spec.attn_type.value} has none")


def _lse_impl(impl: "str | AttentionImpl", spec: AttentionSpec, k_scale: Scale, v_scale: Scale) -> AttentionImpl:
    """The impl that computes the local partial: ``impl`` itself, or a new one of the named backend's impl class."""
    if isinstance(impl, AttentionImpl):
        candidate = impl
    else:
        impl_cls = get_backend_class(impl).get_impl_cls()
        if not impl_cls.can_return_lse:
            raise ValueError(f"backend {impl!r} cannot serve context-parallel decode: its impl "
                             f"{impl_cls.__name__} does not return its log-sum-exp (can_return_lse is False)")
        # Sinks join the merged softmax once, after the exchange: the local partial never reads them.
        sinks = torch.zeros(spec.num_heads) if spec.has_sinks else None
        candidate = impl_cls(spec, sinks=sinks, k_scale=float(k_scale), v_scale=float(v_scale))
    if not candidate.can_return_lse:
        raise ValueError(f"{type(candidate).__name__} does not return its log-sum-exp (can_return_lse is False); "
                         "context-parallel decode needs an impl that does")
    return candidate


def local_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    local_common: CommonAttentionMetadata,
    spec: AttentionSpec,
    *,
    impl: "str | AttentionImpl" = "reference",
    k_scale: Scale = 1.0,
    v_scale: Scale = 1.0,
    out: Optional[torch.Tensor] = None,
    lse: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's partial attention: (output normalised over its keys, natural-log LSE).

    Sinks are left out here (they belong to the merged softmax once, not to every rank's partial).

    Parameters
    ----------
    query : [T, H, D] the decode queries (the same on every rank).
    kv_cache : [num_blocks, 2, block_size, Hkv, D] this rank's cache.
    local_common : from :func:`build_local_metadata` (local seq_lens, may be 0).
    impl : the layer's impl (an engine passes the one it keeps per layer), or a registered backend's name, whose
        impl class is then built from ``spec`` and the scales; either must have ``can_return_lse``
        (:meth:`AttentionImpl.forward_with_lse`), e.g. "reference", "triton", "flashinfer".
    k_scale, v_scale : fp8 scales, used when ``impl`` is a name.
    out : [T, H, D] float32 or the query dtype, optional; lse : [H, T] float32, optional.

    Returns
    -------
    (out [T, H, D], lse [H, T] float32); a request this rank holds no key of gets output 0 and lse -inf.
    """
    num_tokens, num_heads, head_size = query.shape
    if out is None:
        out = torch.empty(num_tokens, num_heads, head_size, dtype=torch.float32, device=query.device)
    if lse is None:
        lse = torch.empty(num_heads, num_tokens, dtype=torch.float32, device=query.device)
    return _lse_impl(impl, spec, k_scale, v_scale).forward_with_lse(query, kv_cache, local_common, out, lse)


def merge_attn_states_n(
    outputs: Sequence[torch.Tensor],
    lses: Sequence[torch.Tensor],
    output: Optional[torch.Tensor] = None,
    output_lse: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge N partial results over disjoint key sets by N - 1 pairwise :func:`merge_attn_states` calls.

    Parameters
    ----------
    outputs : N tensors [T, H, D]; lses : N tensors [H, T] float32 (natural log, -inf = no keys).
    output : [T, H, D] optional destination (default float32); output_lse : [H, T] float32 optional.

    Returns
    -------
    (output, output_lse). Exact up to rounding and independent of the order of the partials; every side -inf
    gives output 0 and lse -inf.
    """
    if len(outputs) != len(lses) or not outputs:
        raise ValueError(f"need the same positive number of outputs and lses, got {len(outputs)} and {len(lses)}")
    first = outputs[0]
    acc = torch.empty(first.shape, dtype=torch.float32, device=first.device)
    acc_lse = torch.empty(lses[0].shape, dtype=torch.float32, device=first.device)
    acc.copy_(first)
    acc_lse.copy_(lses[0])
    for o, l in zip(outputs[1:], lses[1:]):
        merge_attn_states(acc, acc, acc_lse, o, l, output_lse=acc_lse)
    if len(outputs) == 1:
        # One partial: the same convention as the merge (no keys -> 0, never garbage).
        acc.masked_fill_((acc_lse == float("-inf")).transpose(0, 1)[..., None], 0.0)
    if output is None:
        output = acc
    else:
        output.copy_(acc)
    if output_lse is None:
        output_lse = acc_lse
    else:
        output_lse.copy_(acc_lse)
    return output, output_lse


def exchange_and_merge(
    out: torch.Tensor,
    lse: torch.Tensor,
    group: Optional[dist.ProcessGroup] = None,
    *,
    method: Method = "all_gather",
    output: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Combine every rank's partial (out, lse) into the full attention output, on every rank.

    Works for any kernel that returns a normalised partial output and its LSE (Triton, FlashInfer, MLA latent).

    Parameters
    ----------
    out : [T, H, D] this rank's partial output (float32 recommended).
    lse : [H, T] float32 natural-log LSE, -inf where this rank saw no key.
    group : the context-parallel process group (default: the world).
    method : "all_gather" (gather outputs and LSEs, N-way merge) or "all_reduce" (gather LSEs, weighted sum).
    output : [T, H, D] destination in any float dtype (default: a new float32 tensor).
    sinks : [H] float32 sink logits or None; joins the merged softmax denominator once, carrying no value.

    Returns
    -------
    output : [T, H, D], identical on every rank.
    """
    world = dist.get_world_size(group)
    num_tokens, num_heads, head_size = out.shape
    if lse.shape != (num_heads, num_tokens):
        raise ValueError(f"lse has shape {tuple(lse.shape)}, expected ({num_heads}, {num_tokens})")
    lse = lse.float().contiguous()
    if output is None:
        output = torch.empty(out.shape, dtype=torch.float32, device=out.device)
    if method == "all_gather":
        local = out.float().contiguous()
        outs = [torch.empty_like(local) for _ in range(world)]
        lses = [torch.empty_like(lse) for _ in range(world)]
        dist.all_gather(outs, local, group=group)
        dist.all_gather(lses, lse, group=group)
        merged, merged_lse = merge_attn_states_n(outs, lses)
    elif method == "all_reduce":
        lses = [torch.empty_like(lse) for _ in range(world)]
        dist.all_gather(lses, lse, group=group)
        merged_lse = torch.logsumexp(torch.stack(lses), dim=0)  # [H, T]; -inf where no rank saw a key
        finite = merged_lse > float("-inf")
        weight = torch.where(finite & (lse > float("-inf")), torch.exp(lse - torch.where(finite, merged_lse, 0.0)),
                             torch.zeros_like(lse))  # [H, T]
        w = weight.transpose(0, 1)[..., None]  # [T, H, 1]
        # where(), not a multiply: a rank's unused partial may hold anything (NaN included).
        merged = torch.where(w > 0, out.float() * w, torch.zeros((), device=out.device)).contiguous()  # NCCL needs it
        dist.all_reduce(merged, group=group)
    else:
        raise ValueError(f"method must be 'all_gather' or 'all_reduce', got {method!r}")
    if sinks is not None:
        sink_lse = sinks.float().to(out.device)[:, None].expand(num_heads, num_tokens).contiguous()
        zero = torch.zeros_like(merged)
        merge_attn_states(merged, merged, merged_lse.contiguous(), zero, sink_lse)
    output.copy_(merged)
    return output


def cp_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    local_common: CommonAttentionMetadata,
    spec: AttentionSpec,
    *,
    group: Optional[dist.ProcessGroup] = None,
    impl: "str | AttentionImpl" = "reference",
    method: Method = "all_gather",
    output: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
    k_scale: "float | torch.Tensor" = 1.0,
    v_scale: "float | torch.Tensor" = 1.0,
) -> torch.Tensor:
    """One layer's context-parallel decode attention (call on every rank of ``group`` with the same queries).

    The new tokens' K/V must already be in the cache (write them with the impl's ``update_kv_cache`` and
    ``local_common.slot_mapping``: only the owning rank writes).

    Parameters
    ----------
    query : [T, H, D] decode queries, replicated on every rank.
    kv_cache : [num_blocks, 2, block_size, Hkv, D] this rank's cache.
    local_common : :func:`attnbackends.parallel.blocks.build_local_metadata` for this rank.
    spec : the layer (checked with :func:`check_context_parallel_spec`).
    impl : the local kernel, as in :func:`local_decode_attention`; method : see :func:`exchange_and_merge`.
    output : [T, H, D] destination (default float32); sinks : [H] float32 or None (the layer's sink logits).

    Returns
    -------
    output : [T, H, D], equal to single-rank attention over the whole cache up to rounding.
    """
    check_context_parallel_spec(spec)
    if spec.has_sinks and sinks is None:
        raise ValueError("spec.has_sinks is set: pass the layer's sink logits as sinks= ([num_heads] float32)")
    out, lse = local_decode_attention(query, kv_cache, local_common, spec, impl=impl, k_scale=k_scale,
                                      v_scale=v_scale)
    return exchange_and_merge(out, lse, group, method=method, output=output, sinks=sinks)
