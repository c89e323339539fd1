"""attnbackends as an attention implementation of Hugging Face transformers' continuous batching.

::

    from attnbackends.integrations.transformers import register
    register()                      # or register(AttentionConfig(backend="triton"))
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="paged|attnbackends")
    outputs = model.generate_batch(inputs=prompts, generation_config=GenerationConfig(max_new_tokens=64))

:func:`register` adds the implementation to transformers' ``AttentionInterface`` (and its mask function to
``AttentionMaskInterface``) and installs the continuous-batching hooks of :mod:`attnbackends.compat`. In
``generate_batch`` every attention layer then runs on the backend :func:`attnbackends.select` picks for its layer
group (or the one an :class:`~attnbackends.AttentionConfig` or ``ATTNBACKENDS_BACKEND`` names):

- **Specs** come from the model config, one per layer: heads, KV heads, head size, the scale
  (``query_pre_attn_scalar ** -0.5`` where the config has it, else ``head_dim ** -0.5``), the sliding window of
  ``sliding_attention`` layers, gpt-oss's sinks, Gemma 2's soft-cap. Each layer's first call checks them against
  what the model's attention hands over (shapes, ``scaling``, ``sliding_window``, ``softcap``, ``s_aux``) and
  raises ValueError on any difference.
- **The cache** is transformers' own: ``PagedAttentionCache`` keeps every layer of a block side by side
  (``[block][layer][K|V][page_size, kv_heads, head_dim]``), so read from a layer's first row on, its tensor is a
  contiguous cache in the library's layout ``[num_pages, 2, page_size, kv_heads, head_dim]`` whose page
  ``b * num_layers`` is that layer's part of block b (:func:`attnbackends.compat` ``_layer_cache``): no copy, no
  second cache, one block table for every layer. The backend writes each step's new keys and values into it (transformers' own write and read-back are
  skipped for this implementation). Sliding-window layers are kept in the position-addressed full-attention
  allocator (transformers' ring buffer is not addressable by a block table); the backends apply the window.
- **Metadata** is built once per step for all layer groups (:class:`~attnbackends.GroupedMetadataBuilder`), on
  the step's first attention call, and reused by its other layers. A step is recognised by the identity of its
  ``cu_seq_lens_q`` tensor (transformers makes a new one per step; the runtime holds the previous one, so no new
  tensor can take its identity) or by the layer index not increasing. The block table and slot mapping come from
  the step's ``read_index`` / ``write_index`` (cache rows of every token, in order), the query and key lengths
  from ``cu_seq_lens_q`` / ``cu_seq_lens_k``: one host copy of the two small length tensors per step. Batches
  that are not decode-first (transformers' ``prefill_first`` scheduler) are permuted into that order and back.

**Image tokens** (Gemma 3 and other vision-language models whose image tokens attend to each other in both
directions): :func:`mark_image_tokens` makes every layer ``causal_spans`` (sliding layers keep their window on the
left only, as transformers' ``AND(sliding_window, OR(causal, blockwise))`` does) and each contiguous run of
``image_token_id`` in a step's tokens a bidirectional span: transformers' ``token_type_ids`` mask
(``token_type_ids == 1`` where the processor placed image tokens) served by the backend. A prefill chunk that ends
inside an image gives that image's tokens the image's keys up to the chunk's end only (docs/MASKS.md): size
``max_batch_tokens`` so that prompts are not split inside an image.

Outside continuous batching (plain ``generate`` or ``forward`` on a model loaded with this implementation) the
layers run transformers' SDPA, or a dense torch attention where the model needs sinks or a soft-cap.

What transformers lacks upstream for an external paged backend, and the hooks supply (:mod:`attnbackends.compat`,
``transformers_cb_*`` surfaces): (1) continuous batching refuses implementations other than "paged|eager", "sdpa"
and flash ones; (2) ``PagedAttentionCache.update`` always writes and gathers every layer's keys and values before
the attention function runs, and hands the function neither the cache tensor nor a block table (only its flash
decode path does); (3) sliding-window layers live in a ring buffer that a block table cannot address.
"""

from __future__ import annotations

import logging
import math
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from .. import compat
from ..layer_groups import GroupedMetadata, GroupedMetadataBuilder, group_layers
from ..masks import with_spans
from ..metadata import CommonAttentionMetadata, decode_first_order
from ..platform import DeviceInfo
from ..spec import AttentionConfig, AttentionMask, AttentionSpec, MaskKind

__all__ = ["ATTN_IMPLEMENTATION", "IMAGE_TOKENS_KWARG", "layer_groups_for", "mark_image_tokens", "register",
           "transformers_layer_specs"]

logger = logging.getLogger(__name__)

#: The name the implementation is registered under (``attn_implementation="paged|attnbackends"`` or
#: ``"attnbackends"``; transformers 5.x drops the ``paged|`` prefix with a FutureWarning).
ATTN_IMPLEMENTATION = "attnbackends"

#: Model types whose attention passes a logit soft-cap (``softcap=config.attn_logit_softcapping``).
_SOFT_CAP_MODEL_TYPES = frozenset({"gemma2"})
#: Model types whose attention passes learned sink logits (``s_aux``).
_SINK_MODEL_TYPES = frozenset({"gpt_oss"})


@dataclass(frozen=True)
class _Settings:
    config: AttentionConfig
    max_num_reqs: int


_SETTINGS: dict[str, _Settings] = {}

#: The model-forward keyword that carries a continuous-batching step's image-token flags ([T] bool, one per query
#: token in transformers' order) down to the attention function (:func:`mark_image_tokens` adds it).
IMAGE_TOKENS_KWARG = "attnbackends_image_tokens"
#: Attribute :func:`mark_image_tokens` sets on the model: the image token id it marks.
_IMAGE_TOKEN_ATTR = "_attnbackends_image_token_id"


def register(config: Optional[AttentionConfig] = None, *, name: str = ATTN_IMPLEMENTATION,
             max_num_reqs: int = 1024) -> str:
    """Register attnbackends with transformers under ``name``; returns ``name``.

    Parameters
    ----------
    config : the backend choice for every layer group (default ``AttentionConfig()``: the registry's choice);
        ``ATTNBACKENDS_BACKEND`` overrides its ``backend``.
    name : the implementation's name; load models with ``attn_implementation=name`` (or ``"paged|" + name``).
    max_num_reqs : the most requests one continuous-batching step may hold (sizes the builders' buffers; a larger
        step is a ValueError naming it). transformers' own default ``max_requests_per_batch`` is at most 1024.

    Raises
    ------
    ImportError : transformers is not installed (``pip install attnbackends[transformers]``).
    NotImplementedError : this transformers version lacks a name the continuous-batching hooks need.
    """
    if not isinstance(name, str) or not name or name.startswith("paged|") or "flash" in name:
        raise ValueError(f"name must be a non-empty implementation name without the 'paged|' prefix and without "
                         f"'flash' (transformers treats those as flash-attention), got {name!r}")
    if isinstance(max_num_reqs, bool) or not isinstance(max_num_reqs, int) or max_num_reqs < 1:
        raise ValueError(f"max_num_reqs must be a positive int, got {max_num_reqs!r}")
    if config is not None and not isinstance(config, AttentionConfig):
        raise ValueError(f"config must be an attnbackends.AttentionConfig or None, got {type(config).__name__}")
    try:
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask
    except ImportError as exc:
        raise ImportError("attnbackends.integrations.transformers needs transformers>=5.24 "
                          "(pip install 'attnbackends[transformers]')") from exc
    compat.install_transformers_cb_hooks(name)
    _SETTINGS[name] = _Settings(AttentionConfig.from_env(config), max_num_reqs)
    AttentionInterface.register(name, _attention_function(name))
    # Outside continuous batching the layers run SDPA (or the dense fallback), which take SDPA's masks.
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def layer_groups_for(model: Any, *, page_size: int = 256, dtype: "torch.dtype | None" = None,
                     device: "torch.device | str | None" = None, name: str = ATTN_IMPLEMENTATION) -> Any:
    """The layer groups and backends ``generate_batch`` will use for ``model`` (``str()`` of the result prints
    them): a check to run before generating. Errors raised inside transformers' continuous-batching loop end as
    failed requests that transformers logs, so an unservable spec is best found here.

    page_size : transformers' ``ContinuousBatchingConfig.page_size`` (its default 256).
    dtype, device : default: the model's.

    Raises
    ------
    BackendNotSupportedError : no backend (or not the configured one) serves a layer group, with every reason.
    ValueError : ``register`` was not called for ``name``.
    """
    if name not in _SETTINGS:
        raise ValueError(f"call register(name={name!r}) first")
    param = next(model.parameters())
    specs = transformers_layer_specs(model.config, dtype or param.dtype, page_size,
                                     image_spans=hasattr(model, _IMAGE_TOKEN_ATTR))
    return group_layers(specs, DeviceInfo.current(device or param.device), _SETTINGS[name].config)


def mark_image_tokens(model: Any, image_token_id: Optional[int] = None) -> Any:
    """Serve the image-token mask of Gemma 3-style models in ``generate_batch``: the tokens of one image (a
    contiguous run of ``image_token_id``) attend to each other in both directions, text stays causal, as
    transformers' ``token_type_ids`` mask (``get_block_sequence_ids_for_mask``) has it.

    Registers a forward pre-hook on ``model`` that hands each continuous-batching step's image-token flags to the
    attention layers (keyword :data:`IMAGE_TOKENS_KWARG`); every layer's spec becomes ``causal_spans``. Call it
    before ``generate_batch``; the returned handle's ``remove()`` undoes it.

    image_token_id : default ``model.config.image_token_id`` (Gemma 3's multimodal configs carry it).

    Raises
    ------
    ValueError : no image token id given and the config has none, or it is not a non-negative int.
    """
    if image_token_id is None:
        image_token_id = getattr(model.config, "image_token_id", None)
    if isinstance(image_token_id, bool) or not isinstance(image_token_id, int) or image_token_id < 0:
        raise ValueError(f"image_token_id must be a non-negative int (pass it where the config has none), got "
                         f"{image_token_id!r}")

    def add_image_flags(module: Any, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        implementation = str(getattr(module.config, "_attn_implementation", "")).removeprefix("paged|")
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if implementation in _SETTINGS and "cu_seq_lens_q" in kwargs and input_ids is not None:
            kwargs[IMAGE_TOKENS_KWARG] = input_ids.reshape(-1) == image_token_id
        return args, kwargs

    handle = model.register_forward_pre_hook(add_image_flags, with_kwargs=True)
    setattr(model, _IMAGE_TOKEN_ATTR, image_token_id)
    remove = handle.remove

    def remove_all() -> None:
        remove()
        if hasattr(model, _IMAGE_TOKEN_ATTR):
            delattr(model, _IMAGE_TOKEN_ATTR)

    handle.remove = remove_all
    return handle


# ------------------------------------------------------------------------------------------------------ specs
def _text_config(config: Any) -> Any:
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if callable(getter) else config


def transformers_layer_specs(config: Any, dtype: "torch.dtype | str", block_size: int, *,
                             image_spans: bool = False) -> list[AttentionSpec]:
    """One :class:`~attnbackends.AttentionSpec` per decoder layer of a transformers model config.

    Layer types come from ``config.layer_types`` ("full_attention", "sliding_attention"; without it every layer
    is a sliding one when ``config.sliding_window`` is set, as transformers' continuous batching reads it).
    ``image_spans``: every layer ``causal_spans`` (:func:`mark_image_tokens`); a sliding layer's window W then
    bounds the left only, ``window=(W - 1, max_position_embeddings)``, as transformers' image-token mask does.
    """
    text = _text_config(config)
    if getattr(text, "use_bidirectional_attention", False):
        raise NotImplementedError("use_bidirectional_attention is set: the paged path serves causal decoders only")
    num_layers = text.num_hidden_layers
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    window = getattr(text, "sliding_window", None)
    layer_types = getattr(text, "layer_types", None)
    if layer_types is None:
        layer_types = ["sliding_attention" if window else "full_attention"] * num_layers
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise NotImplementedError(f"layer types {unknown} are not served (full_attention, sliding_attention)")
    if "sliding_attention" in layer_types and not (isinstance(window, int) and window > 0):
        raise ValueError(f"sliding_attention layers need a positive int config.sliding_window, got {window!r}")
    scalar = getattr(text, "query_pre_attn_scalar", None)
    scale = float(scalar) ** -0.5 if scalar else float(head_dim) ** -0.5
    model_type = getattr(text, "model_type", "")
    soft_cap = getattr(text, "attn_logit_softcapping", None) if model_type in _SOFT_CAP_MODEL_TYPES else None
    reach = int(getattr(text, "max_position_embeddings", None) or 2 ** 24)

    def mask_and_window(kind: str) -> dict[str, Any]:
        sliding = window if kind == "sliding_attention" else None
        if not image_spans:
            return dict(sliding_window=sliding)
        return dict(mask=AttentionMask(kind=MaskKind.CAUSAL_SPANS,
                                       window=None if sliding is None else (sliding - 1, reach)))

    return [
        AttentionSpec(num_heads=heads, num_kv_heads=kv_heads, head_size=head_dim, dtype=dtype, block_size=block_size,
                      scale=scale, logits_soft_cap=soft_cap, has_sinks=model_type in _SINK_MODEL_TYPES,
                      **mask_and_window(kind))
        for kind in layer_types[:num_layers]
    ]


def _check_call(layer: int, spec: AttentionSpec, query: torch.Tensor, key: torch.Tensor, scaling: Optional[float],
                kwargs: dict[str, Any]) -> None:
    """A layer's first call against its spec: every difference is a ValueError naming the field."""
    facts = [("num_heads", query.shape[1], spec.num_heads), ("num_kv_heads", key.shape[1], spec.num_kv_heads),
             ("head_size", query.shape[-1], spec.head_size)]
    if scaling is not None and not math.isclose(float(scaling), spec.softmax_scale, rel_tol=1e-6):
        facts.append(("scaling", float(scaling), spec.softmax_scale))
    if "sliding_window" in kwargs:
        facts.append(("sliding_window", kwargs["sliding_window"], None if spec.window is None else spec.window[0] + 1))
    facts.append(("softcap", kwargs.get("softcap"), spec.logits_soft_cap))
    facts.append(("sinks (s_aux)", kwargs.get("s_aux") is not None, spec.has_sinks))
    wrong = [f"{name}: the call has {got!r}, the spec from the config {want!r}" for name, got, want in facts
             if got != want]
    if wrong:
        raise ValueError(f"layer {layer}: the model's attention call differs from the spec attnbackends derived "
                         f"from its config ({'; '.join(wrong)})")


# ---------------------------------------------------------------------------------------------------- one step
@dataclass
class _Step:
    """One continuous-batching step: the grouped metadata and, for batches that are not decode-first, the token
    permutation into that order (``order``) and back (``inverse``)."""

    metadata: GroupedMetadata
    num_actual_tokens: int
    order: Optional[torch.Tensor]
    inverse: Optional[torch.Tensor]


def _image_spans(flags: torch.Tensor, query_lens: list[int], seq_lens: list[int]) -> list[list[tuple[int, int]]]:
    """Per request, its image spans in this step: each run of flagged query tokens as absolute positions
    [start, end). flags: [sum query_lens] bool on the host, decode-first order. A run that continues an image begun
    in the cached context starts at the step's first token: the cached keys are causally visible anyway."""
    spans, start = [], 0
    for q, seq_len in zip(query_lens, seq_lens):
        padded = torch.cat([torch.zeros(1, dtype=torch.int8), flags[start:start + q].to(torch.int8),
                            torch.zeros(1, dtype=torch.int8)])
        edges = torch.nonzero(padded[1:] - padded[:-1]).flatten().tolist()  # alternating run starts and ends
        context = seq_len - q
        spans.append([(context + a, context + b) for a, b in zip(edges[0::2], edges[1::2])])
        start += q
    return spans


def _step_common(kwargs: dict[str, Any], layer_cache: compat.TransformersLayerCache, num_tokens: int,
                 decode_threshold: int) -> tuple[CommonAttentionMetadata, Optional[torch.Tensor]]:
    """The step's common metadata from transformers' kwargs, decode-first, and the token order it implies (None
    when the batch already is decode-first); with image-token flags (:func:`mark_image_tokens`) the step's image
    spans."""
    cu_q, cu_k = kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"]
    device = cu_q.device
    cu_q_cpu, cu_k_cpu = cu_q.to("cpu", torch.int64), cu_k.to("cpu", torch.int64)
    query_lens = cu_q_cpu[1:] - cu_q_cpu[:-1]
    num_reqs = int((query_lens > 0).sum())  # padded batches end with empty requests
    query_lens = query_lens[:num_reqs]
    seq_lens = (cu_k_cpu[1:] - cu_k_cpu[:-1])[:num_reqs]
    num_actual = int(cu_q_cpu[num_reqs])
    write = kwargs["write_index"][layer_cache.group]
    read = kwargs["read_index"][layer_cache.group]
    # Cache rows of every token of every request, in position order: the read index where the step reads the
    # cache, else (every request starts at position 0) the write index.
    rows, starts = (read, cu_k) if read.numel() else (write, cu_q)
    page, per_block, stride = layer_cache.page_size, layer_cache.rows_per_block, layer_cache.pages_per_block
    width = -(-int(seq_lens.max()) // page)
    firsts = starts[:num_reqs].long()[:, None] + torch.arange(width, device=device)[None, :] * page
    block_table = (rows[firsts.clamp_(max=rows.numel() - 1)] // per_block * stride).to(torch.int32)
    written = write[:num_actual]
    slots = (written // per_block) * (stride * page) + written % per_block
    order = decode_first_order(query_lens.tolist(), decode_threshold)
    token_order = None
    if order != list(range(num_reqs)):
        token_order = torch.cat([torch.arange(int(cu_q_cpu[r]), int(cu_q_cpu[r + 1])) for r in order]).to(device)
        reqs = torch.tensor(order)
        query_lens, seq_lens = query_lens[reqs], seq_lens[reqs]
        block_table = block_table[reqs.to(device)]
        slots = slots[token_order]
    slot_mapping = torch.full((num_tokens,), -1, dtype=torch.int64, device=device)
    slot_mapping[:num_actual] = slots
    qsl = torch.zeros(num_reqs + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(query_lens, 0)
    seq_lens = seq_lens.to(torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl.to(device), query_start_loc_cpu=qsl, seq_lens=seq_lens.to(device), seq_lens_cpu=seq_lens,
        block_table=block_table, slot_mapping=slot_mapping, num_reqs=num_reqs, num_actual_tokens=num_actual,
        max_query_len=int(query_lens.max()), max_seq_len=int(seq_lens.max()), causal=True)
    flags = kwargs.get(IMAGE_TOKENS_KWARG)
    if flags is not None:
        flags = flags[:num_actual] if token_order is None else flags[token_order]
        flags = flags.cpu()
        if bool(flags.any()):
            common = with_spans(common, _image_spans(flags, query_lens.tolist(), seq_lens.tolist()))
    return common, token_order


class _PagedRuntime:
    """The layer groups, builders and impls serving one ``PagedAttentionCache``, and the current step."""

    def __init__(self, model_config: Any, settings: _Settings, dtype: torch.dtype, device: torch.device,
                 layer_cache: compat.TransformersLayerCache, image_spans: bool = False) -> None:
        self.specs = transformers_layer_specs(model_config, dtype, layer_cache.page_size, image_spans=image_spans)
        self.groups = group_layers(self.specs, DeviceInfo.current(device), settings.config)
        self.debug = settings.config.debug
        # every layer's view of transformers' cache has the same page count: build() checks the page ids once
        self.builder = GroupedMetadataBuilder(self.groups, device, max_num_reqs=settings.max_num_reqs,
                                              max_num_tokens=layer_cache.max_num_tokens, debug=self.debug,
                                              num_blocks=layer_cache.kv_cache.shape[0])
        self.impls: list[Any] = [None] * len(self.specs)
        self._step: Optional[_Step] = None
        self._step_key: Optional[torch.Tensor] = None  # held so that no later tensor can be the same object
        self._last_layer = -1
        logger.info("transformers continuous batching on attnbackends: %s",
                    ", ".join(f"{g.name}={g.backend.name}" for g in self.groups.groups))

    def _impl(self, layer: int, query: torch.Tensor, key: torch.Tensor, scaling: Optional[float],
              kwargs: dict[str, Any]) -> Any:
        impl = self.impls[layer]
        if impl is None:
            spec = self.specs[layer]
            _check_call(layer, spec, query, key, scaling, kwargs)
            sinks = kwargs.get("s_aux")
            impl = self.groups.backend_of(layer).get_impl_cls()(
                spec, sinks=None if sinks is None else sinks.detach().float(), debug=self.debug)
            self.impls[layer] = impl
        return impl

    def _step_for(self, layer: int, kwargs: dict[str, Any], layer_cache: compat.TransformersLayerCache,
                  num_tokens: int) -> _Step:
        key = kwargs["cu_seq_lens_q"]
        if self._step is None or key is not self._step_key or layer <= self._last_layer:
            common, order = _step_common(kwargs, layer_cache, num_tokens, self.builder.reorder_batch_threshold)
            inverse = None
            if order is not None:
                inverse = torch.empty_like(order)
                inverse[order] = torch.arange(order.numel(), device=order.device)
            self._step = _Step(self.builder.build(common), common.num_actual_tokens, order, inverse)
            self._step_key = key
        self._last_layer = layer
        return self._step

    def forward(self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                scaling: Optional[float], kwargs: dict[str, Any],
                layer_cache: compat.TransformersLayerCache) -> torch.Tensor:
        """query [1, Hq, T, D], key / value [1, Hkv, T, D] (this step's new tokens) -> [1, T, Hq, Dv]."""
        layer = int(module.layer_idx)
        impl = self._impl(layer, query, key, scaling, kwargs)
        num_tokens = query.shape[2]
        step = self._step_for(layer, kwargs, layer_cache, num_tokens)
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D]
        n = step.num_actual_tokens
        if step.order is not None:
            q, k, v = q[step.order], k[step.order], v[step.order]
        elif n < num_tokens:
            q, k, v = q[:n], k[:n], v[:n]
        out = torch.empty(n, q.shape[1], v.shape[-1], dtype=query.dtype, device=query.device)
        impl.forward(q, k, v, layer_cache.kv_cache, step.metadata.per_layer[layer], out)
        if step.inverse is not None:
            out = out[step.inverse]
        if n < num_tokens:  # padding rows (CUDA-graph / compile padding) get zeros
            out = torch.cat([out, out.new_zeros(num_tokens - n, *out.shape[1:])])
        return out.unsqueeze(0)


_RUNTIMES: "weakref.WeakKeyDictionary[Any, _PagedRuntime]" = weakref.WeakKeyDictionary()


# ------------------------------------------------------------------------------------------- the function
def _dense_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: Optional[torch.Tensor], scaling: Optional[float], sliding_window: Optional[int],
                     softcap: Optional[float], sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """Attention over whole [B, H, L, D] tensors with sinks and a soft-cap (outside continuous batching)."""
    groups = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(groups, dim=1).float()
    v = value.repeat_interleave(groups, dim=1).float()
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    logits = torch.matmul(query.float(), k.transpose(-1, -2)) * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    q_len, kv_len = query.shape[2], key.shape[2]
    if attention_mask is None:
        pos_q = torch.arange(q_len, device=query.device)[:, None] + (kv_len - q_len)
        pos_k = torch.arange(kv_len, device=query.device)[None, :]
        visible = pos_k <= pos_q
        if sliding_window is not None:
            visible &= pos_k > pos_q - sliding_window
        logits = logits.masked_fill(~visible, float("-inf"))
    elif attention_mask.dtype == torch.bool:
        logits = logits.masked_fill(~attention_mask[..., :kv_len], float("-inf"))
    else:
        logits = logits + attention_mask[..., :kv_len].float()
    if sinks is not None:
        sink = sinks.float().reshape(1, -1, 1, 1).expand(logits.shape[0], -1, q_len, 1)
        probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(logits, dim=-1)
    out = torch.matmul(probs, v).to(query.dtype)
    return out.transpose(1, 2).contiguous()


def _attention_function(name: str) -> Callable[..., tuple[torch.Tensor, None]]:
    @torch.compiler.disable
    def attnbackends_attention_forward(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                       attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                                       scaling: Optional[float] = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
        """transformers' attention-function signature: query [B, Hq, Lq, D], key / value [B, Hkv, Lk, D] ->
        ([B, Lq, Hq, Dv], None)."""
        if dropout:
            raise NotImplementedError(f"attention dropout ({dropout}) is not served: use the model in eval mode")
        layer_cache = kwargs.pop(compat.TRANSFORMERS_LAYER_CACHE_KWARG, None)
        if layer_cache is None:
            kwargs.pop(IMAGE_TOKENS_KWARG, None)
            sinks, softcap = kwargs.get("s_aux"), kwargs.get("softcap")
            if sinks is None and softcap is None:
                from transformers import AttentionInterface

                return AttentionInterface()["sdpa"](module, query, key, value, attention_mask, dropout=dropout,
                                                    scaling=scaling, **kwargs)
            return _dense_attention(module, query, key, value, attention_mask, scaling, kwargs.get("sliding_window"),
                                    softcap, sinks), None
        runtime = _RUNTIMES.get(layer_cache.owner)
        if runtime is None:
            runtime = _PagedRuntime(module.config, _SETTINGS[name], query.dtype, query.device, layer_cache,
                                    image_spans=IMAGE_TOKENS_KWARG in kwargs)
            _RUNTIMES[layer_cache.owner] = runtime
        return runtime.forward(module, query, key, value, scaling, kwargs, layer_cache), None

    attnbackends_attention_forward.__name__ = f"{name}_attention_forward"
    return attnbackends_attention_forward
