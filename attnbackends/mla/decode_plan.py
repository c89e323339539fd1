"""The MLA decode's step plans: what a builder's ``build()`` decides for a batch's decode requests, carried as
:attr:`MLADecodeMetadata.plan <attnbackends.mla.common.MLADecodeMetadata.plan>` and only read by ``forward``.

- :class:`MLADecodeStepPlan`: the base every MLA builder's plan derives from (``writes_cache``).
- :class:`TritonMLADecodePlan`: triton_mla's (the planned launches, the buffers and views they read and write, the
  projections' choices with their reasons).
- :class:`FlashInferMLADecodePlan`: flashinfer_mla's (the planned wrapper and the page ids it reads).
- :class:`DecodePlanKey`: what a builder keeps a plan under for later batches, with the one rule that says when a
  kept plan is stale.
- :class:`PreparedStep`: one launch of an impl's prepared launch sequence
  (:func:`~attnbackends.ops.launch.launch_prepared_sequence`).

Plans are frozen and compare by identity (``eq=False``): an impl keeps what it derives from a plan (prepared
launches) under the plan object itself.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import torch

if TYPE_CHECKING:
    from ..ops.launch import PreparedLaunch
    from .decode_launch import MLAAbsorbPlan, MLADecodePlan

__all__ = [
    "Absorption",
    "DecodePlanKey",
    "FlashInferMLADecodePlan",
    "HeadMajor",
    "MLADecodeStepPlan",
    "PreparedStep",
    "TensorFacts",
    "TokenMajor",
    "TritonMLADecodePlan",
    "UpProjection",
]


class Absorption(enum.Enum):
    """How the decode's query absorption (q_nope [P] -> [Lkv] per head, through W_UK_T) runs."""

    #: One cached Triton launch that also copies the rotary queries into a planned buffer (and, in a decode-only
    #: batch, writes the new tokens into the cache).
    TRITON = "triton"
    #: ``torch.bmm`` into the planned query buffer.
    BMM = "bmm"


class UpProjection(enum.Enum):
    """How the decode's up-projection (latent [Lkv] -> [V] per head, through W_UV) runs."""

    #: One Triton launch that also merges the KV splits by their LSE.
    FUSED = "fused"
    #: The split reduction's launch (where split), then ``torch.bmm`` into the caller's output.
    BMM = "bmm"


class HeadMajor(NamedTuple):
    """The size of an [N, T, D] view: heads, tokens, width (``as_strided`` over a [>= T, N, D] tensor)."""

    heads: int
    tokens: int
    width: int


class TokenMajor(NamedTuple):
    """The size of a [T, N, D] view: tokens, heads, width (``as_strided`` over a [>= T, N, D] tensor)."""

    tokens: int
    heads: int
    width: int


@dataclass(frozen=True, eq=False, kw_only=True)
class MLADecodeStepPlan:
    """What an MLA builder planned for a batch's decode requests (a subclass per backend).

    Attributes
    ----------
    writes_cache : the decode's first launch writes the batch's new tokens into the cache (decode-only batches of
        builders that fold the write): a ``forward`` given kv_c_normed and k_pe hands them to the decode instead of
        calling ``update_kv_cache``.
    """

    writes_cache: bool = False


@dataclass(frozen=True, eq=False, kw_only=True)
class TritonMLADecodePlan(MLADecodeStepPlan):
    """triton_mla's decode plan (:class:`~attnbackends.mla.backends.TritonMLAMetadataBuilder`): T decode tokens,
    N heads, Lkv latent, R rope, P nope, V value dims.

    Attributes
    ----------
    num_splits : KV splits of the decode kernel (1: none).
    launch : the decode kernel's planned launch (kernel, grid, split partials; the fused up-projection's launch
        where ``up_projection`` is FUSED).
    absorption, absorption_reason : how the query absorption runs, and why (the builder's setting or its rule).
    absorb_launch : the Triton absorption's planned launch (with the cache write where ``writes_cache``); None
        where ``absorption`` is BMM.
    up_projection, up_projection_reason : how the up-projection runs, and why.
    ql : [N, T, Lkv] model dtype, the absorbed queries (the layout ``torch.bmm`` writes); ql_t : the same memory as
        [T, N, Lkv], as the decode kernel reads it; ql_key : ``tensor_key(ql_t)``.
    q_pe : [T, N, R] model dtype, the rotary queries as the Triton absorption copies them (unused with BMM);
        q_pe_key : ``tensor_key(q_pe)``.
    latent : [N, T, Lkv] model dtype, the decode kernel's latent output (the BMM up-projection reads it).
    q_nope_view : (N, T, P), the size of the BMM absorption's view of the call's queries.
    q_pe_view : (T, N, R), the size of the decode kernel's view of the call's rotary queries after a BMM absorption.
    out_view : (N, T, V), the size of the BMM up-projection's view of the call's output.
    """

    num_splits: int
    launch: "MLADecodePlan"
    absorption: Absorption
    absorption_reason: str
    absorb_launch: Optional["MLAAbsorbPlan"]
    up_projection: UpProjection
    up_projection_reason: str
    ql: torch.Tensor
    ql_t: torch.Tensor
    ql_key: tuple
    q_pe: torch.Tensor
    q_pe_key: tuple
    latent: torch.Tensor
    q_nope_view: HeadMajor
    q_pe_view: TokenMajor
    out_view: HeadMajor

    def __post_init__(self) -> None:
        assert (self.absorb_launch is not None) == (self.absorption is Absorption.TRITON)
        assert (self.launch.up_grid is not None) == (self.up_projection is UpProjection.FUSED)
        assert not self.writes_cache or (self.absorb_launch is not None and self.absorb_launch.write_grid is not None)


@dataclass(frozen=True, eq=False, kw_only=True)
class FlashInferMLADecodePlan(MLADecodeStepPlan):
    """flashinfer_mla's decode plan (:class:`~attnbackends.mla.backends.FlashInferMLAMetadataBuilder`).

    Attributes
    ----------
    wrapper : the planned ``BatchMLAPagedAttentionWrapper``.
    page_ids : [total pages] int32, the page ids ``wrapper`` was planned with.
    page_ids_bound : the cache size (pages, the builder's ``num_blocks``) ``page_ids`` gathered from a device-only
        block table were contained to in ``build()``; None where there was nothing to contain (a host table, checked
        before any kernel runs) or the builder did not know the cache size (see ``unchecked``).
    unchecked : ``page_ids`` come from a device-only block table and were not contained in ``build()`` (the
        builder's ``num_blocks`` unknown): ``forward`` contains them to its cache's size before ``run()``.
    """

    wrapper: Any
    page_ids: torch.Tensor
    page_ids_bound: Optional[int] = None
    unchecked: bool = False


class TensorFacts(NamedTuple):
    """What a decode plan takes of a metadata tensor: its device address, shape, strides and dtype (the kernels
    read its values on the device, at launch time)."""

    address: int
    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, t: Optional[torch.Tensor]) -> Optional["TensorFacts"]:
        return None if t is None else cls(t.data_ptr(), t.shape, t.stride(), t.dtype)


class DecodePlanKey(NamedTuple):
    """What a builder keeps a decode plan under for later batches (a typed tuple: hashed and compared as one).

    Staleness rule: a kept plan serves a later batch whose key is equal, and only that: the same host facts (token
    count, split count, longest query, decode-only) over the same metadata buffers with the same layout
    (:class:`TensorFacts`: address, shape, strides, dtype). The plan holds those buffers, not their values: its
    kernels read block tables, sequence lengths, query starts, tree masks and slots at launch time, so an engine
    that rewrites its persistent input buffers in place between steps keeps its plan, and one that hands over new
    tensors plans anew.
    """

    num_decode_tokens: int
    num_splits: int
    max_query_len: int
    decode_only: bool
    block_table: TensorFacts
    seq_lens: TensorFacts
    query_start_loc: Optional[TensorFacts]
    tree_mask: Optional[TensorFacts]
    tree_indptr: Optional[TensorFacts]
    slot_mapping: Optional[TensorFacts]  # decode-only batches, whose absorption launch writes the cache


class PreparedStep(NamedTuple):
    """One launch of a prepared sequence (:func:`~attnbackends.ops.launch.launch_prepared_sequence` takes these):
    the prepared launch, its grid, and the slice ``call[call_start:call_stop]`` of the call's tensor addresses it
    takes as its leading arguments."""

    prepared: "PreparedLaunch"
    grid: tuple[int, int, int]
    call_start: int
    call_stop: int
