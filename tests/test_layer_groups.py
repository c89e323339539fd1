"""Layer groups: grouping by spec, per-group selection and pins (config and YAML), the window trim of a sliding
group's pages, and every group's backend against the oracle on one batch with layers of different specs."""

import dataclasses
import random
import textwrap

import pytest
import torch

from attnbackends import (
    AttentionConfig,
    AttentionSpec,
    BackendNotSupportedError,
    DeviceInfo,
    GroupedMetadataBuilder,
    LayerGroupsConfig,
    build_common_metadata,
    explain_layers,
    group_layers,
    trim_to_window,
)
from attnbackends.layer_groups import parse_layer_ranges, window_pages_per_request
from attnbackends.testing import LAYER_GROUP_SHAPES, check_layer_groups

CPU = DeviceInfo.cpu()
BS = 16


def _spec(**kw):
    base = dict(num_heads=4, num_kv_heads=2, head_size=32, dtype="float32", block_size=BS)
    return AttentionSpec(**{**base, **kw})


def gemma_like(window=20, pattern=6, num_layers=12, **kw):
    """Gemma 3's layout: every ``pattern``-th layer global, the others sliding."""
    return [_spec(**kw) if (i + 1) % pattern == 0 else _spec(sliding_window=window, **kw) for i in range(num_layers)]


def gpt_oss_like(window=24, num_layers=4, **kw):
    """gpt-oss: sinks everywhere, sliding and full layers alternating (sliding first)."""
    return [_spec(has_sinks=True, sliding_window=window if i % 2 == 0 else None, **kw) for i in range(num_layers)]


def test_groups_by_spec_with_names_and_layers():
    groups = group_layers(gemma_like(window=1024), CPU)
    assert [g.name for g in groups.groups] == ["sliding_1024", "full"]
    assert groups["sliding_1024"].layers == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10)
    assert groups["full"].layers == (5, 11)
    assert groups.layer_group == [0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 1]
    assert all(g.backend.name == "reference" for g in groups.groups)
    assert groups["full"].explanation.chosen == "reference"
    text = str(groups)
    assert "group sliding_1024: layers 0-4,6-10, backend reference" in text
    assert "group full: layers 5,11" in text
    with pytest.raises(KeyError, match="no layer group 'global'"):
        groups["global"]


def test_names_tell_apart_groups_of_one_kind():
    specs = [_spec(head_size=32), _spec(head_size=64), _spec(head_size=32, num_kv_heads=4), _spec(head_size=64)]
    names = [g.name for g in group_layers(specs, CPU).groups]
    assert len(set(names)) == 3
    assert names[1] == "full_1" or names[1].startswith("full")  # a distinct name per distinct spec
    two_heads = [g.name for g in group_layers([_spec(head_size=32), _spec(head_size=512)], CPU).groups]
    assert two_heads == ["full_h32", "full_h512"]
    enc = group_layers([_spec(attn_type="encoder_only")], CPU)
    assert enc.groups[0].name == "encoder"


def test_pins_by_name_and_by_layer_range():
    specs = gemma_like(window=20)
    cfg = LayerGroupsConfig(groups={"full": "reference"}, layers=[{"layers": "0-2", "backend": "reference"}])
    groups = group_layers(specs, CPU, cfg)
    # the range pin splits the sliding group (layers 0-2 pinned, the rest by the default): two sliding groups
    names = {g.name: g.layers for g in groups.groups}
    assert names == {"sliding_20:reference": (0, 1, 2), "sliding_20:auto": (3, 4, 6, 7, 8, 9, 10), "full": (5, 11)}
    assert groups["full"].config.backend == "reference"


def test_pins_reject_unknown_groups_layers_and_conflicts():
    specs = gemma_like(window=20)
    with pytest.raises(ValueError, match="unknown groups \\['global'\\].*sliding_20, full"):
        group_layers(specs, CPU, LayerGroupsConfig(groups={"global": "reference"}))
    with pytest.raises(ValueError, match="pins layer 12; the model has layers 0-11"):
        group_layers(specs, CPU, LayerGroupsConfig(layers=[{"layers": "10-12", "backend": "reference"}]))
    with pytest.raises(ValueError, match="pinned to two backends"):
        group_layers(specs, CPU, LayerGroupsConfig(layers=[{"layers": [1], "backend": "reference"},
                                                            {"layers": "0-1", "backend": "triton"}]))
    with pytest.raises(ValueError, match="pinned by range to 'triton' and by name to 'reference'"):
        group_layers(specs, CPU, LayerGroupsConfig(groups={"full": "reference"},
                                                   layers=[{"layers": "5", "backend": "triton"}]))
    with pytest.raises(ValueError, match="not 'N' or 'N-M'"):
        parse_layer_ranges("0-x")
    with pytest.raises(ValueError, match="ends before it starts"):
        parse_layer_ranges("3-1")
    assert parse_layer_ranges("0-2, 5,1") == (0, 1, 2, 5)


def test_explicit_backend_that_does_not_fit_names_the_group():
    specs = [_spec(sliding_window=8), _spec(attn_type="encoder_only")]
    cfg = LayerGroupsConfig(groups={"sliding_8": "flashinfer"})
    with pytest.raises(BackendNotSupportedError,
                       match="layer group 'sliding_8' \\(layers 0\\): the requested backend 'flashinfer' cannot serve"):
        group_layers(specs, CPU, cfg)
    explained = explain_layers(specs, CPU, cfg)  # never raises
    assert explained["sliding_8"].chosen is None
    assert explained["encoder"].chosen == "reference"


def test_yaml_config(tmp_path):
    path = tmp_path / "model.yaml"
    path.write_text(textwrap.dedent("""
        attention:
          backend: reference
        layer_groups:
          groups:
            full: {backend: reference, debug: true}
          layers:
            - {layers: "0-1", backend: reference}
    """))
    cfg = LayerGroupsConfig.from_file(path)
    assert cfg.default.backend == "reference"
    assert cfg.groups["full"].debug is True
    assert cfg.layers[0].layers == (0, 1)
    groups = group_layers(gemma_like(window=20), CPU, cfg)
    assert groups["full"].config.debug is True
    path.write_text("layer_groups: [1, 2]\n")
    with pytest.raises(ValueError, match="layer_groups in .* must be a mapping"):
        LayerGroupsConfig.from_file(path)


def test_one_attention_config_for_every_group():
    groups = group_layers(gpt_oss_like(), CPU, AttentionConfig(backend="reference"))
    assert [g.name for g in groups.groups] == ["sliding_24", "full"]
    assert all(g.config.backend == "reference" for g in groups.groups)


def _random_common(rng, num_reqs, width_extra=2):
    query_lens, contexts, tables = [], [], []
    next_page = 0
    for _ in range(num_reqs):
        q = rng.choice([1, 1, 1, rng.randint(2, 40)])
        c = rng.randint(0, 200)
        pages = -(-(q + c) // BS) + rng.randint(0, width_extra)
        tables.append(list(range(next_page, next_page + pages)))
        next_page += pages
        query_lens.append(q)
        contexts.append(c)
    return build_common_metadata(query_lens, contexts, tables, BS), query_lens, contexts, tables


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("window", [1, 7, 16, 17, 50])
def test_trim_keeps_exactly_the_pages_some_query_may_see(seed, window):
    rng = random.Random(seed)
    common, query_lens, contexts, tables = _random_common(rng, 7)
    trimmed = trim_to_window(common, window, BS)
    for r, (q, c, table) in enumerate(zip(query_lens, contexts, tables)):
        first_visible = c - window + 1  # the first query (position c) sees keys j > c - window
        drop = (common.seq_lens_cpu[r] - trimmed.seq_lens_cpu[r]) // BS * 1
        drop = int(drop)
        assert int(common.seq_lens_cpu[r] - trimmed.seq_lens_cpu[r]) == drop * BS
        # every dropped page ends before the first visible key; the first kept page holds it (or it is negative)
        assert drop * BS <= max(first_visible, 0)
        assert (drop + 1) * BS > first_visible
        kept = -(-(q + c) // BS) - drop
        assert trimmed.block_table_cpu[r, :kept].tolist() == table[drop : drop + kept]
        assert trimmed.block_table[r, :kept].tolist() == table[drop : drop + kept]
        assert int(trimmed.seq_lens[r]) == int(trimmed.seq_lens_cpu[r])
        assert kept <= window_pages_per_request(window, BS, q)
    assert trimmed.max_seq_len == int(trimmed.seq_lens_cpu.max())
    assert trimmed.block_table.shape[1] <= window_pages_per_request(window, BS, common.max_query_len)
    assert torch.equal(trimmed.slot_mapping, common.slot_mapping)
    assert torch.equal(trimmed.query_start_loc, common.query_start_loc)


@pytest.mark.parametrize("window", [16, 1000])
def test_trim_drops_the_common_prefix_once_pages_are_dropped(window):
    """Requests sharing a prefix drop different page counts, so their trimmed tables no longer share leading pages."""
    shared = [100, 101, 102, 103]
    tables = [shared + [200, 201], shared + [300]]
    common = dataclasses.replace(build_common_metadata([5, 3], [80, 60], tables, BS), common_prefix_len=4 * BS)
    trimmed = trim_to_window(common, window, BS)
    dropped = bool((common.seq_lens_cpu - trimmed.seq_lens_cpu).any())
    assert dropped == (window < 60)
    assert trimmed.common_prefix_len == (0 if dropped else 4 * BS)


def test_trim_into_persistent_buffers_and_their_limit():
    rng = random.Random(3)
    common, *_ = _random_common(rng, 5)
    decode_common = build_common_metadata([1] * 4, [3, 40, 90, 200], [list(range(i * 20, i * 20 + 20)) for i in range(4)], BS)
    width = window_pages_per_request(30, BS, 1)
    buffers = (torch.full((8,), -5, dtype=torch.int32), torch.full((8, width), -5, dtype=torch.int32))
    trimmed = trim_to_window(decode_common, 30, BS, out=buffers)
    assert trimmed.seq_lens.data_ptr() == buffers[0].data_ptr()
    assert trimmed.block_table.data_ptr() == buffers[1].data_ptr()
    fresh = trim_to_window(decode_common, 30, BS)
    assert torch.equal(buffers[0][:4], fresh.seq_lens)
    kept = (fresh.seq_lens_cpu + BS - 1) // BS
    for r in range(4):
        assert torch.equal(buffers[1][r, : kept[r]], fresh.block_table[r, : kept[r]])
    with pytest.raises(ValueError, match="trim buffer holds"):
        trim_to_window(common, 30, BS, out=buffers)


def test_grouped_builder_uses_buffers_for_short_queries_only():
    groups = group_layers(gemma_like(window=30), CPU)
    builder = GroupedMetadataBuilder(groups, "cpu", max_num_reqs=8, cudagraph_max_query_len=1)
    decode = build_common_metadata([1] * 3, [3, 90, 200], [list(range(i * 20, i * 20 + 20)) for i in range(3)], BS)
    step = builder.build(decode)
    sliding = groups["sliding_30"].index
    assert step.commons[sliding].block_table.data_ptr() == builder._trim_buffers[sliding][1].data_ptr()
    assert step.per_layer[5] is step.per_group[groups["full"].index]
    assert step.commons[groups["full"].index] is decode
    prefill = build_common_metadata([5, 1], [90, 7], [list(range(20)), list(range(20, 40))], BS)
    step = builder.build(prefill)
    assert step.commons[sliding].block_table.data_ptr() != builder._trim_buffers[sliding][1].data_ptr()
    with pytest.raises(ValueError, match="without CUDA-graph support"):
        builder.build_for_cudagraph_capture(decode)
    with pytest.raises(ValueError, match="got 1 common metadata; the model has 2 groups"):
        builder.build([decode])


@pytest.mark.parametrize("seed", [0, 1])
def test_reference_groups_against_the_oracle(seed):
    check_layer_groups(gemma_like(window=20, num_layers=6), shapes=LAYER_GROUP_SHAPES, seed=seed)
    check_layer_groups(gpt_oss_like(window=24), seed=seed)


def test_groups_of_different_head_sizes_and_features():
    specs = [_spec(head_size=32, sliding_window=9), _spec(head_size=64), _spec(head_size=16, logits_soft_cap=5.0),
             _spec(head_size=32, sliding_window=9, kv_cache_dtype="fp8_e4m3", dtype="bfloat16")]
    groups = check_layer_groups(specs, shapes=LAYER_GROUP_SHAPES)
    assert len(groups.groups) == 4


def test_the_check_fails_when_a_window_is_ignored(monkeypatch):
    """The check reads NaN from pages outside the window if a group's metadata keeps them."""
    import attnbackends.layer_groups.builder as lg

    import attnbackends.testing.layer_groups as tlg

    monkeypatch.setattr(lg, "trim_to_window", lambda common, window, block_size, out=None: common)
    with pytest.raises(AssertionError, match="group sliding_20: block table 5 pages wide, the window needs <= 4"):
        check_layer_groups(gemma_like(window=20, num_layers=6), shapes=LAYER_GROUP_SHAPES)
    monkeypatch.setattr(tlg, "window_pages_per_request", lambda *args: 1000)
    with pytest.raises(AssertionError, match="layer 0 \\(group sliding_20, backend reference\\).*NaN"):
        check_layer_groups(gemma_like(window=20, num_layers=6), shapes=LAYER_GROUP_SHAPES)


def test_triton_and_reference_groups_in_one_step():
    """Sliding layers on interpreted Triton, global layers on the reference backend."""
    specs = gemma_like(window=20, num_layers=3, pattern=3, dtype="float16")
    cfg = LayerGroupsConfig(groups={"sliding_20": "triton", "full": "reference"})
    shapes = (LAYER_GROUP_SHAPES[1], LAYER_GROUP_SHAPES[3], LAYER_GROUP_SHAPES[5])
    groups = check_layer_groups(specs, config=cfg, shapes=shapes)
    assert {g.name: g.backend.name for g in groups.groups} == {"sliding_20": "triton", "full": "reference"}
    sinks = LayerGroupsConfig(default=AttentionConfig(backend="triton"))
    check_layer_groups(gpt_oss_like(window=20, num_layers=2, dtype="float16"), config=sinks, shapes=shapes)
