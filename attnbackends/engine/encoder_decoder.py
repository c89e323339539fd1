"""Encoder-decoder models (Whisper-, T5-, BART-style) on the grouped paged engine: one layer group per attention
type, each with its own backend.

- ``encoder`` (``AttentionType.ENCODER``): the encoder's bidirectional self-attention, no KV cache. A request's
  encoder runs once, when the request is admitted (requests admitted together share one encoder pass, packed
  varlen within the step's token budget).
- the decoder's causal self-attention (``AttentionType.DECODER``) over its paged cache, as in
  :class:`~attnbackends.engine.GroupedPagedEngine` (continuous batching, chunked prefill).
- ``cross`` (``AttentionType.ENCODER_DECODER``): decoder queries over the encoder's keys and values. Right after
  the encoder pass, every cross layer's keys and values of the encoder output are written once into the cross
  group's pages of that request (:func:`~attnbackends.metadata.encoder_slot_mapping`); every decoder step then
  reads them through :func:`~attnbackends.metadata.build_cross_attention_metadata` (``seq_lens`` = encoder
  lengths, non-causal, nothing written), and cross layers are called with ``key = value = None``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence, runtime_checkable

import torch

from ..layer_groups import LayerGroupsConfig
from ..metadata import build_cross_attention_metadata, encoder_slot_mapping
from ..spec import AttentionConfig, AttentionSpec, AttentionType
from .encoder import encoder_common_metadata
from .engine import EngineConfig, GenerationResult, _Request
from .groups import GroupedPagedEngine, GroupedStepAttention

__all__ = ["EncoderDecoderEngine", "EncoderDecoderEngineModel"]


@runtime_checkable
class EncoderDecoderEngineModel(Protocol):
    """What :class:`EncoderDecoderEngine` needs from an encoder-decoder model. Its attention layers (encoder
    self-attention, decoder self-attention, cross-attention) are numbered 0 .. num_layers - 1 in any order the
    model chooses; ``attn(layer, ...)`` takes that number."""

    num_layers: int

    def layer_specs(self, dtype: torch.dtype, block_size: int) -> list[AttentionSpec]:
        """One spec per attention layer: ``encoder``, ``decoder`` and ``encoder_decoder`` (cross) layers."""

    def impl_kwargs(self, layer: int) -> dict[str, Any]:
        """Extra keyword arguments of layer ``layer``'s impl ({} for most models)."""

    def encoder_len(self, encoder_input: Any) -> int:
        """Tokens the encoder makes of one request's input (the keys its cross-attention sees)."""

    def encode(self, encoder_inputs: Sequence[Any], attn: GroupedStepAttention) -> torch.Tensor:
        """The encoder over several requests' inputs -> [sum of encoder_len, hidden], requests one after another.
        Encoder layers call ``attn(layer, q, k, v)`` with q [S, Hq, D], k and v [S, Hkv, D] over the whole pass."""

    def cross_key_value(self, layer: int, encoder_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross layer ``layer``'s keys and values of encoder output [S, hidden] -> k, v [S, Hkv, D]."""

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attn: GroupedStepAttention,
                logits_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The decoder: tokens, positions [T] int64 -> logits [len(logits_rows) or T, vocab] float32. Self-attention
        layers call ``attn(layer, q, k, v)``, cross layers ``attn(layer, q, None, None)``."""


@dataclass
class _EncoderDecoderRequest(_Request):
    encoder_input: Any = None
    encoder_len: int = 0
    encoded: bool = False


class EncoderDecoderEngine(GroupedPagedEngine):
    """Serves an :class:`EncoderDecoderEngineModel` (see the module docstring).

    Parameters
    ----------
    model, config, device, dtype, attention_config : as for :class:`~attnbackends.engine.GroupedPagedEngine`;
        groups are named ``encoder``, ``full`` (decoder self-attention) and ``cross``, so a
        :class:`~attnbackends.LayerGroupsConfig` can pin each (``groups: {cross: triton}``). A request's encoder
        output must fit one step (``encoder_len <= config.max_num_batched_tokens``).
    """

    served_attn_types = frozenset({AttentionType.ENCODER, AttentionType.DECODER, AttentionType.ENCODER_DECODER})

    def __init__(
        self,
        model: EncoderDecoderEngineModel,
        config: EngineConfig = EngineConfig(),
        *,
        device: "torch.device | str" = "cpu",
        dtype: torch.dtype = torch.float32,
        attention_config: "LayerGroupsConfig | AttentionConfig | None" = None,
    ) -> None:
        super().__init__(model, config, device=device, dtype=dtype, attention_config=attention_config)
        missing = [t.value for t in self.served_attn_types if not any(s.attn_type is t for s in self.layer_specs)]
        if missing:
            raise ValueError(f"an encoder-decoder model needs encoder, decoder and encoder_decoder (cross) layers; "
                             f"this one has no {', '.join(sorted(missing))} layers")
        by_type = {t: [g.index for g in self.groups.groups if g.spec.attn_type is t] for t in self.served_attn_types}
        self.encoder_groups = by_type[AttentionType.ENCODER]
        self.cross_groups = by_type[AttentionType.ENCODER_DECODER]
        self.num_encoder_passes = 0

    def _group_need(self, g: int, req: _Request) -> int:
        if g in self.encoder_groups:
            return 0
        if g in self.cross_groups:
            return self._pages(req.encoder_len)
        return super()._group_need(g, req)

    def _admit(self, waiting: deque, running: list[_Request]) -> None:
        """Admit like the base engine, then run the encoder of every newly admitted request."""
        super()._admit(waiting, running)
        new = [r for r in running if not r.encoded]
        budget = self.config.max_num_batched_tokens
        while new:
            take, tokens = [], 0
            for req in new:
                if tokens + req.encoder_len > budget:
                    break
                take.append(req)
                tokens += req.encoder_len
            self._encode(take)
            new = new[len(take):]

    @torch.inference_mode()
    def _encode(self, reqs: list[_EncoderDecoderRequest]) -> None:
        """One encoder pass over ``reqs``; writes every cross layer's keys and values of its output into the cross
        caches (pages allocated here, released with the request's other pages)."""
        lengths = [r.encoder_len for r in reqs]
        commons: list = [None] * len(self.pools)
        for g in self.encoder_groups:
            commons[g] = encoder_common_metadata(lengths, self.device)
        attn = GroupedStepAttention(self, self.builder.build(commons))
        states = self.model.encode([r.encoder_input for r in reqs], attn)
        if states.dim() != 2 or states.shape[0] != sum(lengths):
            raise ValueError(f"the model's encode returned shape {tuple(states.shape)}; expected [{sum(lengths)}, "
                             "hidden] (the sum of its encoder_len over the pass's requests)")
        for g in self.cross_groups:
            tables = []
            for req in reqs:
                pages = self._pages_of.setdefault(req.index, [[] for _ in self.pools])[g]
                pages += self.pools[g].allocate(self._pages(req.encoder_len))
                tables.append(pages)
            slots = encoder_slot_mapping(lengths, tables, self.config.block_size, self.device)
            for layer in self.groups.groups[g].layers:
                key, value = self.model.cross_key_value(layer, states)
                self.impls[layer].update_kv_cache(key, value, self.kv_caches[layer], slots)
        for req in reqs:
            req.encoded = True
        self.num_encoder_passes += 1

    def _step_commons(self, batch: list[tuple], common) -> list:
        """The decoder groups' metadata (base engine) and the cross groups': this step's decoder queries over each
        request's encoder keys."""
        commons = super()._step_commons(batch, common)
        reqs = [entry[0] for entry in batch]
        query_lens = [entry[1] for entry in batch]
        encoder_lens = [req.encoder_len for req in reqs]
        for g in self.cross_groups:
            tables = [self._pages_of[req.index][g] for req in reqs]
            commons[g] = build_cross_attention_metadata(query_lens, encoder_lens, tables, self.config.block_size,
                                                        self.device)
        return commons

    def generate(  # type: ignore[override]
        self,
        encoder_inputs: Sequence[Any],
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        eos_token_id: Optional[int] = None,
    ) -> GenerationResult:
        """Greedy generation: request i encodes ``encoder_inputs[i]`` and continues the decoder prompt ``prompts[i]``
        (at least the decoder start token) by up to ``max_new_tokens`` tokens, with continuous batching."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if len(encoder_inputs) != len(prompts):
            raise ValueError(f"got {len(encoder_inputs)} encoder inputs for {len(prompts)} decoder prompts")
        requests = []
        for i, (x, prompt) in enumerate(zip(encoder_inputs, prompts)):
            if not prompt:
                raise ValueError(f"decoder prompt {i} is empty; it needs at least the decoder start token")
            n = int(self.model.encoder_len(x))
            if not 1 <= n <= self.config.max_num_batched_tokens:
                raise ValueError(f"encoder input {i} makes {n} encoder tokens; an encoder pass takes 1 to "
                                 f"max_num_batched_tokens = {self.config.max_num_batched_tokens}")
            requests.append(_EncoderDecoderRequest(i, list(prompt), max_new_tokens, eos_token_id,
                                                   encoder_input=x, encoder_len=n))
        self.num_encoder_passes = 0
        return self._run(requests)
