"""Per-group pins of a model's layer groups (:class:`LayerGroupsConfig`, by group name or layer index range, from
YAML or JSON) and the layer specs of a model file (:func:`read_layer_specs`)."""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping, Sequence, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..spec import AttentionConfig, AttentionSpec, read_config_file

logger = logging.getLogger(__name__)


def parse_layer_ranges(text: Union[str, int, Sequence[int]]) -> tuple[int, ...]:
    """Layer indices of ``"0-3,8"`` (ranges inclusive), an int or a list of ints, sorted and unique."""
    if isinstance(text, int):
        values = [text]
    elif isinstance(text, str):
        values = []
        for part in (p.strip() for p in text.split(",")):
            if not part:
                continue
            lo, sep, hi = part.partition("-")
            try:
                start, stop = int(lo), int(hi) if sep else int(lo)
            except ValueError:
                raise ValueError(f"layer range {part!r} is not 'N' or 'N-M' (inclusive), in {text!r}") from None
            if stop < start:
                raise ValueError(f"layer range {part!r} ends before it starts")
            values += range(start, stop + 1)
    else:
        values = [int(v) for v in text]
    if not values or min(values) < 0:
        raise ValueError(f"layers {text!r} must name at least one layer index >= 0")
    return tuple(sorted(set(values)))


def _as_attention_config(value: Any) -> Any:
    return {"backend": value} if isinstance(value, str) else value


class LayerRangePin(BaseModel):
    """A backend choice for the layers ``layers`` ("0-3,8": inclusive ranges, or a list of indices)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    layers: tuple[int, ...]
    backend: AttentionConfig

    @field_validator("layers", mode="before")
    @classmethod
    def _parse_layers(cls, value: Any) -> tuple[int, ...]:
        return parse_layer_ranges(value)

    @field_validator("backend", mode="before")
    @classmethod
    def _backend(cls, value: Any) -> Any:
        return _as_attention_config(value)


class LayerGroupsConfig(BaseModel):
    """Backend choices of a model with layer groups.

    ``default`` applies to every group; ``groups`` pins a group by name (``{"sliding_1024": "triton"}`` or a full
    :class:`~attnbackends.AttentionConfig` mapping); ``layers`` pins layer index ranges. Layers of one spec that
    different range pins send to different backends form separate groups. Pinning a layer both by range and by its
    group's name to different backends is an error. ``kv_cache_16bit_layers`` ("0,31" or a list) keeps those layers'
    KV caches in 16 bits (``kv_cache_dtype`` auto) whatever their specs ask for: they form their own groups (named
    like ``full``, the quantised ones ``full_int8_per_token_head``). YAML (see :meth:`from_file`)::

        attention: {backend: auto}          # the default
        layer_groups:
          groups: {sliding_1024: triton, full: reference}
          layers:
            - {layers: "0-3", backend: triton}
          kv_cache_16bit_layers: "0,31"
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    default: AttentionConfig = Field(default_factory=AttentionConfig)
    groups: dict[str, AttentionConfig] = Field(default_factory=dict)
    layers: tuple[LayerRangePin, ...] = ()
    kv_cache_16bit_layers: tuple[int, ...] = ()

    @field_validator("kv_cache_16bit_layers", mode="before")
    @classmethod
    def _parse_16bit_layers(cls, value: Any) -> tuple[int, ...]:
        return parse_layer_ranges(value) if value not in ((), [], None, "") else ()

    def apply_kv_cache_overrides(self, specs: Sequence[AttentionSpec]) -> list[AttentionSpec]:
        """``specs`` with the layers of ``kv_cache_16bit_layers`` set to a 16-bit cache (ValueError for a layer the
        model does not have)."""
        out = list(specs)
        for layer in self.kv_cache_16bit_layers:
            if layer >= len(out):
                raise ValueError(f"layer_groups.kv_cache_16bit_layers names layer {layer}; the model has layers "
                                 f"0-{len(out) - 1}")
            if out[layer].kv_cache_dtype not in ("auto", "float16", "bfloat16"):
                out[layer] = out[layer].model_copy(update={"kv_cache_dtype": "auto"})
        return out

    @field_validator("default", mode="before")
    @classmethod
    def _default(cls, value: Any) -> Any:
        return _as_attention_config(value)

    @field_validator("groups", mode="before")
    @classmethod
    def _groups(cls, value: Any) -> Any:
        if not isinstance(value, Mapping):
            raise ValueError(f"groups must map group names to backends, got {type(value).__name__}")
        return {str(k): _as_attention_config(v) for k, v in value.items()}

    @classmethod
    def from_file(cls, path: "str | os.PathLike") -> "LayerGroupsConfig":
        """Read the ``attention:`` section (the default) and the ``layer_groups:`` section of a YAML/JSON file."""
        data = read_config_file(path)
        groups = data.get("layer_groups") or {}
        if not isinstance(groups, dict):
            raise ValueError(f"layer_groups in {path} must be a mapping, got {type(groups).__name__}")
        return cls.model_validate({"default": data.get("attention", {}), **groups})


def read_layer_specs(path: "str | os.PathLike") -> list[AttentionSpec]:
    """A model's per-layer specs from the ``layers:`` list of a ``.yaml``/``.yml``/``.json`` file (the file may
    also hold the ``attention:`` and ``layer_groups:`` sections :meth:`LayerGroupsConfig.from_file` reads)::

        layer_defaults: {num_heads: 8, num_kv_heads: 8, head_size: 64, dtype: bfloat16}
        layers:
          - {attn_type: encoder, count: 4}      # layers 0-3
          - {attn_type: decoder, count: 4}      # layers 4-7
          - {attn_type: encoder_decoder, count: 4}

    Each entry is an :class:`~attnbackends.AttentionSpec` mapping over ``layer_defaults`` (its own fields win);
    ``count`` (default 1) repeats it. ValueError names the entry and the field for anything invalid."""
    data = read_config_file(path)
    entries, defaults = data.get("layers"), data.get("layer_defaults") or {}
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{path} needs a non-empty `layers:` list of layer specs (mappings)")
    if not isinstance(defaults, dict):
        raise ValueError(f"layer_defaults in {path} must be a mapping of AttentionSpec fields")
    specs: list[AttentionSpec] = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ValueError(f"layers[{i}] in {path} must be a mapping of AttentionSpec fields, got {entry!r}")
        fields = {**defaults, **entry}
        count = fields.pop("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"layers[{i}].count in {path} must be a positive integer, got {count!r}")
        try:
            spec = AttentionSpec.model_validate(fields)
        except ValidationError as exc:
            why = "; ".join(f"{'.'.join(str(x) for x in e['loc'])}: {e['msg'].removeprefix('Value error, ')}"
                            if e["loc"] else e["msg"].removeprefix("Value error, ") for e in exc.errors())
            raise ValueError(f"layers[{i}] in {path}: {why}") from None
        specs += [spec] * count
    return specs
