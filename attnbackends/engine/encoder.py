"""Encoder-only models (BERT-style embedders) served through layer groups.

Every layer's self-attention is bidirectional and has no KV cache (``AttentionType.ENCODER_ONLY``): a batch of
sequences is packed one after another without padding (varlen), each layer's impl gets the step's keys and values
directly, and every token sees every token of its own sequence. A sequence is never split across steps (its
attention needs all of it at once); several sequences share a step up to the token budget.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence, runtime_checkable

import torch

from ..layer_groups import GroupedMetadata, GroupedMetadataBuilder, LayerGroupsConfig, group_layers
from ..metadata import CommonAttentionMetadata, build_common_metadata
from ..platform import DeviceInfo
from ..spec import AttentionConfig, AttentionSpec, AttentionType
from .groups import GroupedStepAttention

__all__ = ["EncoderEngine", "EncoderEngineModel", "encoder_common_metadata"]

#: The page size encoder specs are made with: they have no cache, but a spec needs one (16 fits every backend).
ENCODER_BLOCK_SIZE = 16


@runtime_checkable
class EncoderEngineModel(Protocol):
    """What :class:`EncoderEngine` needs from an encoder-only model."""

    num_layers: int

    def layer_specs(self, dtype: torch.dtype, block_size: int) -> list[AttentionSpec]:
        """One ``encoder_only`` spec per attention layer, in layer order."""

    def impl_kwargs(self, layer: int) -> dict[str, Any]:
        """Extra keyword arguments of layer ``layer``'s impl ({} for most models)."""

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attn: GroupedStepAttention) -> torch.Tensor:
        """tokens, positions : [T] int64 (sequences one after another, positions from 0 in each) -> [T, hidden].
        Layer i calls ``attn(i, q, k, v)`` with q [T, Hq, D], k and v [T, Hkv, D]. A model taking segment ids
        accepts ``token_type_ids`` [T] too (passed when :meth:`EncoderEngine.encode` is given them)."""


def encoder_common_metadata(lengths: Sequence[int], device: "torch.device | str" = "cpu") -> CommonAttentionMetadata:
    """The common metadata of an encoder pass over sequences of ``lengths`` tokens packed one after another:
    query_start_loc [n + 1] their offsets, seq_lens [n] = lengths, no cache (empty block table, slots -1),
    non-causal."""
    return build_common_metadata(list(lengths), [0] * len(lengths), None, ENCODER_BLOCK_SIZE, device, causal=False)


class EncoderEngine:
    """Serves an :class:`EncoderEngineModel`: one backend per layer group, selected through the registry.

    Parameters
    ----------
    model : the model; moved to ``device`` and ``dtype`` in place.
    device, dtype : where and in which precision it runs.
    attention_config : a :class:`~attnbackends.LayerGroupsConfig` or one :class:`~attnbackends.AttentionConfig`
        for every group (the groups' explanations are in ``engine.groups``).
    max_num_batched_tokens : tokens per step (the longest sequence the engine takes).
    max_num_reqs : sequences per step.
    """

    def __init__(
        self,
        model: EncoderEngineModel,
        *,
        device: "torch.device | str" = "cpu",
        dtype: torch.dtype = torch.float32,
        attention_config: "LayerGroupsConfig | AttentionConfig | None" = None,
        max_num_batched_tokens: int = 512,
        max_num_reqs: int = 64,
    ) -> None:
        if max_num_batched_tokens < 1 or max_num_reqs < 1:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) and max_num_reqs ({max_num_reqs}) "
                             "must be >= 1")
        self.device = torch.device(device)
        self.model = model.to(device=self.device, dtype=dtype).eval()
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_reqs = max_num_reqs
        self.layer_specs = list(model.layer_specs(dtype, ENCODER_BLOCK_SIZE))
        if len(self.layer_specs) != model.num_layers:
            raise ValueError(f"layer_specs gave {len(self.layer_specs)} specs for {model.num_layers} layers")
        wrong = [i for i, s in enumerate(self.layer_specs) if s.attn_type is not AttentionType.ENCODER_ONLY]
        if wrong:
            raise ValueError(f"layers {wrong} are not encoder_only layers; EncoderEngine serves encoder-only models "
                             "(decoders: GroupedPagedEngine, encoder-decoder models: EncoderDecoderEngine)")
        self.groups = group_layers(self.layer_specs, DeviceInfo.current(self.device), attention_config)
        debug = any(g.config.debug for g in self.groups.groups)
        self.builder = GroupedMetadataBuilder(self.groups, self.device, max_num_reqs=max_num_reqs,
                                              max_num_tokens=max_num_batched_tokens, debug=debug)
        self.impls = self.groups.make_impls(model.impl_kwargs)
        self.kv_caches: list[None] = [None] * len(self.layer_specs)
        self.num_steps = 0

    @property
    def backend(self) -> str:
        """Every group's backend, ``"encoder=triton"``."""
        return ",".join(f"{g.name}={g.backend.name}" for g in self.groups.groups)

    def _batches(self, lengths: list[int]) -> list[list[int]]:
        """Sequence indices per step, in order, within the token budget and the request limit."""
        batches: list[list[int]] = []
        tokens = 0
        for i, n in enumerate(lengths):
            if n < 1:
                raise ValueError(f"sequence {i} is empty; every sequence needs at least one token")
            if n > self.max_num_batched_tokens:
                raise ValueError(f"sequence {i} has {n} tokens, more than max_num_batched_tokens = "
                                 f"{self.max_num_batched_tokens} (a sequence is encoded in one step)")
            if not batches or tokens + n > self.max_num_batched_tokens or len(batches[-1]) == self.max_num_reqs:
                batches.append([])
                tokens = 0
            batches[-1].append(i)
            tokens += n
        return batches

    def metadata(self, lengths: Sequence[int]) -> GroupedMetadata:
        """Every group's metadata for one step over sequences of ``lengths`` tokens."""
        return self.builder.build(encoder_common_metadata(lengths, self.device))

    @torch.inference_mode()
    def encode(self, sequences: Sequence[Sequence[int]], token_type_ids: Optional[Sequence[Sequence[int]]] = None
               ) -> list[torch.Tensor]:
        """The model's output for each sequence of token ids: a list of [len(sequence), hidden] tensors.

        token_type_ids : per sequence, one segment id per token (BERT's sentence A/B), passed to the model's
            ``forward`` as ``token_type_ids`` [T] when given.
        """
        lengths = [len(s) for s in sequences]
        if token_type_ids is not None and [len(t) for t in token_type_ids] != lengths:
            raise ValueError("token_type_ids must give one id per token of every sequence")
        outputs: list[Optional[torch.Tensor]] = [None] * len(sequences)
        for batch in self._batches(lengths):
            tokens = torch.tensor([t for i in batch for t in sequences[i]], dtype=torch.long, device=self.device)
            positions = torch.tensor([p for i in batch for p in range(lengths[i])], device=self.device)
            attn = GroupedStepAttention(self, self.metadata([lengths[i] for i in batch]))
            kwargs = {}
            if token_type_ids is not None:
                kwargs["token_type_ids"] = torch.tensor([t for i in batch for t in token_type_ids[i]],
                                                        dtype=torch.long, device=self.device)
            hidden = self.model.forward(tokens, positions, attn, **kwargs)
            for i, part in zip(batch, hidden.split([lengths[i] for i in batch])):
                outputs[i] = part
            self.num_steps += 1
        return outputs
