"""PersistentBatch: random add / append / truncate / finish / step sequences give the metadata
build_common_metadata gives for the same batch in the same (decode-first) order, every field, host and device
copies; the device buffers keep their addresses; a step's host copies survive the next step; bad updates are
ValueErrors naming the request; a reference forward on its metadata equals one on build_common_metadata's; the
step_host benchmark runs on the CPU."""

import dataclasses
import json
import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnbackends import AttentionSpec, DeviceInfo, PersistentBatch, build_common_metadata, split_decodes_and_prefills
from attnbackends.metadata import check_slots_match_block_table, validate_common_metadata
from attnbackends.reference.backend import ReferenceBackend
from attnbackends.testing import SequenceShape, make_random_batch
from attnbackends.testing.conformance import run_backend_on_batch
from attnbackends.triton.backend import TritonAttentionBackend

COMMON = dict(deadline=None, database=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
TENSORS = ("query_start_loc", "query_start_loc_cpu", "seq_lens", "seq_lens_cpu", "block_table", "block_table_cpu",
           "slot_mapping")
SCALARS = ("num_reqs", "num_actual_tokens", "max_query_len", "max_seq_len", "causal", "common_prefix_len",
           "block_size", "host_checked", "spec_tree_mask", "spec_tree_mask_indptr", "spec_tree_mask_indptr_cpu")
DEVICE_BUFFERS = ("query_start_loc", "seq_lens", "block_table", "slot_mapping")


def address(t: torch.Tensor) -> tuple[int, int]:
    """Where a tensor's data starts (its storage and offset: an empty view reports data_ptr() 0)."""
    return t.untyped_storage().data_ptr(), t.storage_offset() * t.element_size()


def assert_same_metadata(got, want):
    for name in TENSORS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.device == b.device and torch.equal(a, b), (name, a, b)
    for name in SCALARS:
        assert getattr(got, name) == getattr(want, name), name


class Model:
    """What the engine knows about its requests, in plain Python: pages, cached tokens, and how many leading
    tokens sit in pages shared with another request (read-only for both)."""

    def __init__(self, rng: random.Random, num_blocks: int, block_size: int, width: int, exclusive: bool):
        self.rng, self.bs, self.width, self.exclusive = rng, block_size, width, exclusive
        self.free = list(range(num_blocks))
        rng.shuffle(self.free)
        self.pages: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.shared_tokens: dict[int, int] = {}
        self.next_id = 0

    def take(self, n: int) -> list[int]:
        n = min(n, len(self.free))
        out, self.free = self.free[:n], self.free[n:]
        return out

    def need(self, tokens: int) -> int:
        return -(-tokens // self.bs)


def _apply(batch: PersistentBatch, model: Model, op: str, data) -> None:
    rng = model.rng
    live = list(model.pages)
    if op == "add" and len(live) < batch.max_num_reqs:
        computed = data.draw(st.sampled_from([0, 0, 1, model.bs, 2 * model.bs + 1]) | st.integers(0, 20))
        extra = data.draw(st.integers(0, 2))
        pages = model.take(min(model.need(computed) + extra, model.width))
        computed = min(computed, len(pages) * model.bs)
        req = model.next_id
        model.next_id += 1
        as_array = data.draw(st.booleans())
        batch.add_request(req, np.array(pages, dtype=np.int32) if as_array else pages, computed)
        model.pages[req], model.computed[req], model.shared_tokens[req] = list(pages), computed, 0
    elif op == "fork" and live and not model.exclusive and len(live) < batch.max_num_reqs:
        # a prefix-cache hit: the new request starts on the full pages another has computed
        src = rng.choice(live)
        full = min(model.computed[src] // model.bs, len(model.pages[src]))
        if full == 0:
            return
        shared = model.pages[src][:full]
        own = model.take(min(data.draw(st.integers(0, 2)), model.width - full))
        computed = full * model.bs
        req = model.next_id
        model.next_id += 1
        batch.add_request(req, shared + own, computed)
        model.pages[req], model.computed[req] = shared + own, computed
        model.shared_tokens[req] = computed
        model.shared_tokens[src] = max(model.shared_tokens[src], computed)
    elif op == "append" and live:
        req = rng.choice(live)
        room = model.width - len(model.pages[req])
        pages = model.take(min(data.draw(st.integers(0, 3)), room))
        batch.append_pages(req, pages)
        model.pages[req] += pages
    elif op == "truncate" and live:
        req = rng.choice(live)
        keep_min = max(model.need(model.computed[req]), model.need(model.shared_tokens[req]))
        keep = data.draw(st.integers(min(keep_min, len(model.pages[req])), len(model.pages[req])))
        dropped = batch.truncate_pages(req, keep)
        assert dropped.tolist() == model.pages[req][keep:]
        model.pages[req] = model.pages[req][:keep]
    elif op == "rollback" and live:
        req = rng.choice(live)
        back = data.draw(st.integers(model.shared_tokens[req], model.computed[req]))
        batch.set_num_computed_tokens(req, back)
        model.computed[req] = back
    elif op == "bad_step" and live:
        # a step the batch must refuse (a request without the pages its tokens need); it changes nothing
        req = rng.choice(live)
        over = len(model.pages[req]) * model.bs - model.computed[req] + 1
        with pytest.raises(ValueError, match=f"request {req!r} holds {len(model.pages[req])} pages"):
            batch.prepare({req: over})
    elif op == "finish" and live:
        req = rng.choice(live)
        pages = batch.finish_request(req)
        assert pages.tolist() == model.pages[req]
        del model.pages[req], model.computed[req], model.shared_tokens[req]


def _schedule(batch: PersistentBatch, model: Model, data) -> dict:
    """A step: some live requests, each with new tokens its pages hold (pages appended where short), within the
    token budget, and never writing into a page it shares with another request."""
    scheduled = {}
    budget = batch.max_num_tokens
    for req in list(model.pages):
        if not data.draw(st.booleans()) and data.draw(st.booleans()):
            continue
        q = data.draw(st.sampled_from([1, 1, 1, 2, 3, model.bs, model.bs + 1]) | st.integers(1, 12))
        q = min(q, budget, model.width * model.bs - model.computed[req])
        if q < 1:
            continue
        short = model.need(model.computed[req] + q) - len(model.pages[req])
        if short > 0:
            pages = model.take(short)
            if len(pages) < short:
                model.free = pages + model.free
                continue
            batch.append_pages(req, pages)
            model.pages[req] += pages
        scheduled[req] = q
        budget -= q
    return scheduled


def _expected(batch: PersistentBatch, model: Model, scheduled: dict, padded):
    order = batch.step_req_ids
    return build_common_metadata([scheduled[r] for r in order], [model.computed[r] for r in order],
                                 [model.pages[r] for r in order], batch.block_size, "cpu",
                                 num_padded_tokens=padded, max_blocks_per_req=batch.max_pages_per_req)


@st.composite
def op_sequences(draw):
    ops = st.sampled_from(["add", "add", "add", "fork", "append", "truncate", "rollback", "bad_step", "finish",
                           "finish", "step", "step", "step", "step"])
    return draw(st.lists(ops, min_size=10, max_size=60))


def _run_sequence(data, ops, exclusive: bool, counter):
    bs, width, max_reqs, max_tokens = 4, 6, 5, 24
    num_blocks = max_reqs * width + 8
    batch = PersistentBatch(max_reqs, max_tokens, width, bs, "cpu", num_blocks=num_blocks,
                            decode_threshold=data.draw(st.sampled_from([1, 1, 2])), exclusive_pages=exclusive)
    model = Model(random.Random(data.draw(st.integers(0, 2**16))), num_blocks, bs, width, exclusive)
    addresses = None
    previous = None  # the last step's metadata and what it must still hold
    for op in ops + ["step"]:
        if op != "step":
            _apply(batch, model, op, data)
            assert batch.req_ids == list(batch.req_ids) and sorted(batch.req_ids) == sorted(model.pages)
            continue
        scheduled = _schedule(batch, model, data)
        as_array = data.draw(st.booleans())
        tokens = sum(scheduled.values())
        padded = data.draw(st.sampled_from([None, None, tokens, min(tokens + 3, max_tokens)]))
        arg = np.array([scheduled.get(r, 0) for r in batch.req_ids]) if as_array else scheduled
        common = batch.prepare(arg, num_padded_tokens=padded)
        assert sorted(batch.step_req_ids) == sorted(scheduled)
        want = _expected(batch, model, scheduled, padded)
        assert_same_metadata(common, want)
        query_lens = [scheduled[r] for r in batch.step_req_ids]
        thr = batch.decode_threshold
        assert all(q <= thr for q in query_lens[: batch.num_decodes])
        assert all(q > thr for q in query_lens[batch.num_decodes :])
        assert split_decodes_and_prefills(common, thr).num_decodes == batch.num_decodes
        positions = [c + i for r in batch.step_req_ids for c in [model.computed[r]] for i in range(scheduled[r])]
        assert batch.step_positions.tolist() == positions
        validate_common_metadata(common, num_blocks=num_blocks, block_size=bs)
        check_slots_match_block_table(common, bs, common.block_table_cpu.numpy(), common.slot_mapping.numpy())
        now = tuple(address(getattr(common, name)) for name in DEVICE_BUFFERS)
        assert addresses is None or now == addresses, "the device buffers moved"
        addresses = now
        if previous is not None:  # the step before keeps its host copies (the other staging buffer)
            old, old_want = previous
            for name in ("query_start_loc_cpu", "seq_lens_cpu", "block_table_cpu"):
                assert torch.equal(getattr(old, name), getattr(old_want, name)), name
        previous = (common, want)
        for r, q in scheduled.items():
            model.computed[r] += q
        assert all(batch.num_computed_tokens(r) == c for r, c in model.computed.items())
        counter["persistent batch steps vs build_common_metadata"] += 1


@settings(max_examples=150, **COMMON)
@given(data=st.data(), ops=op_sequences())
def test_random_sequences_match_build_common_metadata(data, ops, case_counter):
    _run_sequence(data, ops, exclusive=False, counter=case_counter)


@settings(max_examples=50, **COMMON)
@given(data=st.data(), ops=op_sequences())
def test_random_sequences_with_exclusive_pages(data, ops, case_counter):
    _run_sequence(data, ops, exclusive=True, counter=case_counter)


def test_hand_made_step_and_order():
    batch = PersistentBatch(8, 64, 4, 4, "cpu", num_blocks=32)
    batch.add_request("a", [3, 4], 0)
    batch.add_request("b", [5], 2)
    batch.add_request("c", [9, 10], 5)
    common = batch.prepare({"a": 6, "b": 1, "c": 1})
    assert batch.step_req_ids == ["c", "b", "a"] and batch.num_decodes == 2  # decodes first
    assert common.query_start_loc_cpu.tolist() == [0, 1, 2, 8]
    assert common.seq_lens_cpu.tolist() == [6, 3, 6]
    assert common.slot_mapping.tolist() == [10 * 4 + 1, 5 * 4 + 2, 12, 13, 14, 15, 16, 17]
    assert common.block_table.tolist() == [[9, 10, 0, 0], [5, 0, 0, 0], [3, 4, 0, 0]]
    assert common.pages_checked_for == 32 and common.host_checked
    assert batch.num_computed_tokens("a") == 6
    batch.append_pages("b", [6])
    common = batch.prepare({"b": 2})  # a and c wait: b moves to the front, then the rows that did not run
    assert batch.step_req_ids == ["b"] and batch.req_ids[0] == "b"
    assert common.slot_mapping.tolist() == [5 * 4 + 3, 6 * 4]
    assert common.block_table_cpu.tolist() == [[5, 6, 0, 0]]


def test_device_buffers_keep_their_addresses_and_empty_steps():
    batch = PersistentBatch(4, 16, 4, 4, "cpu")
    batch.add_request(0, [1, 2], 3)
    first = batch.prepare({0: 1})
    empty = batch.prepare({})
    assert empty.num_reqs == 0 and empty.num_actual_tokens == 0 and empty.query_start_loc_cpu.tolist() == [0]
    batch.add_request(1, [3], 0)
    padded = batch.prepare({0: 2, 1: 3}, num_padded_tokens=8)
    assert padded.slot_mapping.tolist()[-3:] == [-1, -1, -1] and padded.num_actual_tokens == 5
    for name in DEVICE_BUFFERS:
        assert address(getattr(first, name)) == address(getattr(empty, name)) == address(getattr(padded, name))


@pytest.mark.parametrize("action, message", [
    (lambda b: b.add_request("a", [9]), "request 'a' is already in the batch"),
    (lambda b: b.append_pages("x", [9]), "request 'x' is not in the batch"),
    (lambda b: b.finish_request("x"), "request 'x' is not in the batch"),
    (lambda b: b.prepare({"x": 1}), "scheduled request 'x' is not in the batch"),
    (lambda b: b.add_request("n", [40]), r"pages\[0\] = 40 of request 'n' is outside \[0, 32\) \(num_blocks\)"),
    (lambda b: b.add_request("n", [1, -2]), r"pages\[1\] = -2 of request 'n' is outside"),
    (lambda b: b.add_request("n", [1.0]), "pages of request 'n' must be a 1-D sequence of int page ids"),
    (lambda b: b.add_request("n", [9], 5), "request 'n': 5 computed tokens need 2 pages, 1 given"),
    (lambda b: b.add_request("n", [9], -1), "num_computed_tokens of request 'n' must be an int >= 0"),
    (lambda b: b.append_pages("a", [10, 11, 12, 13]), "request 'a' would hold 6 pages; max_pages_per_req is 4"),
    (lambda b: b.prepare({"a": 9}), r"request 'a' holds 2 pages; its 10 tokens \(1 computed \+ 9 new\) need 3 "
                                    r"\(block_size 4\): append_pages first"),
    (lambda b: b.prepare({"a": 0}), r"scheduled\['a'\] must be an int >= 1"),
    (lambda b: b.prepare({"a": 1.5}), r"scheduled\['a'\] must be an int >= 1"),
    (lambda b: b.prepare({"a": "1"}), r"scheduled\['a'\] must be an int >= 1"),
    (lambda b: b.prepare(np.array([1])), r"an int array of shape \(2,\) in req_ids order"),
    (lambda b: b.prepare(np.array([1.0, 1.0])), r"an int array of shape \(2,\)"),
    (lambda b: b.prepare(np.array([1, -1])), r"scheduled\[1\] \(request 'b'\) is -1"),
    (lambda b: b.prepare({"a": 7, "b": 7}), "the step schedules 14 tokens; max_num_tokens is 12"),
    (lambda b: b.prepare({"a": 1}, num_padded_tokens=13), r"num_padded_tokens must be an int in \[1, 12\]"),
    (lambda b: b.prepare({"a": 2}, num_padded_tokens=1), r"num_padded_tokens must be an int in \[2, 12\]"),
    (lambda b: b.truncate_pages("a", 3), r"num_pages for request 'a' must be an int in \[0, 2\]"),
    (lambda b: b.set_num_computed_tokens("a", -3), "num_computed_tokens of request 'a' must be an int >= 0"),
])
def test_bad_updates_are_value_errors_naming_the_request(action, message):
    batch = PersistentBatch(3, 12, 4, 4, "cpu", num_blocks=32)
    batch.add_request("a", [0, 1], 1)
    batch.add_request("b", [2], 0)
    with pytest.raises(ValueError, match=message):
        action(batch)


def test_more_requests_than_rows():
    batch = PersistentBatch(2, 8, 2, 4, "cpu")
    batch.add_request(0, [0])
    batch.add_request(1, [1])
    with pytest.raises(ValueError, match=r"max_num_reqs \(2\) requests; finish one before adding request 2"):
        batch.add_request(2, [2])
    batch.finish_request(0)
    batch.add_request(2, [2])
    assert batch.req_ids == [1, 2]


def test_two_requests_writing_one_page_is_refused():
    batch = PersistentBatch(4, 16, 4, 4, "cpu")
    batch.add_request("a", [5, 6], 4)  # page 6 receives a's next tokens
    batch.add_request("b", [7, 6], 4)  # ... and b's
    with pytest.raises(ValueError, match=r"page 6 receives new tokens of request '(a|b)' \(its page 1\) and of "
                                         r"request '(a|b)' \(its page 1\) this step"):
        batch.prepare({"a": 1, "b": 1})
    with pytest.raises(ValueError, match="page 6 receives new tokens"):
        batch.prepare({"a": 2, "b": 3})
    batch.prepare({"a": 1})  # one at a time is fine
    batch.add_request("c", [5, 8], 4)  # a's full first page shared as a prefix: read by both, written by neither
    common = batch.prepare({"a": 1, "c": 1})
    assert sorted(common.slot_mapping.tolist()) == [6 * 4 + 1, 8 * 4]


def test_exclusive_pages_refuse_a_page_held_by_a_live_request():
    with pytest.raises(ValueError, match="exclusive_pages=True needs num_blocks"):
        PersistentBatch(2, 8, 4, 4, exclusive_pages=True)
    batch = PersistentBatch(4, 16, 4, 4, "cpu", num_blocks=16, exclusive_pages=True)
    batch.add_request("a", [1, 2])
    with pytest.raises(ValueError, match="page 2 of request 'b' is already held by request 'a'"):
        batch.add_request("b", [3, 2])
    with pytest.raises(ValueError, match="page 4 is given twice to request 'b'"):
        batch.add_request("b", [4, 4])
    with pytest.raises(ValueError, match="page 1 of request 'a' is already held by request 'a'"):
        batch.append_pages("a", [1])
    batch.add_request("b", [3])
    batch.finish_request("a")  # its pages are free again
    batch.add_request("c", [1, 2])
    assert batch.truncate_pages("c", 1).tolist() == [2]
    batch.append_pages("b", [2])


def test_constructor_arguments_are_checked():
    with pytest.raises(ValueError, match="max_num_reqs must be a positive int"):
        PersistentBatch(0, 8, 4, 4)
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        PersistentBatch(2, 8, 4, 4.0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cuda' was requested"):
            PersistentBatch(2, 8, 4, 4, "cuda")


@pytest.mark.parametrize("backend, dtype, pad", [(ReferenceBackend, "float32", 0), (ReferenceBackend, "float32", 3),
                                                 (TritonAttentionBackend, "float16", 3)])
def test_forward_on_its_metadata_equals_forward_on_build_common_metadata(backend, dtype, pad):
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=32, dtype=dtype, block_size=16)
    if backend.not_supported_reasons(spec, DeviceInfo.current(torch.device("cpu"))):
        pytest.skip(f"{backend.name} does not run here")
    shapes = [SequenceShape(1, 40), SequenceShape(1, 5), SequenceShape(7, 0), SequenceShape(20, 33)]
    rng = random.Random(3)
    pool = rng.sample(range(64), 64)
    tables = []
    for s in shapes:  # one spare page per request, as an engine reserves ahead
        n = -(-s.seq_len // spec.block_size) + 1
        tables.append(pool[:n])
        pool = pool[n:]
    batch = make_random_batch(spec, shapes, seed=5, num_blocks=64, block_tables=tables, pad_tokens=pad)
    persistent = PersistentBatch(8, 128, 8, spec.block_size, "cpu", num_blocks=64)
    for i, (s, table) in enumerate(zip(shapes, tables)):
        persistent.add_request(i, table, s.context_len)
    tokens = batch.query.shape[0]
    common = persistent.prepare({i: s.query_len for i, s in enumerate(shapes)}, num_padded_tokens=tokens)
    assert persistent.step_req_ids == [0, 1, 2, 3]  # already decodes first: no row moved
    want, want_cache = run_backend_on_batch(backend, batch)
    got, got_cache = run_backend_on_batch(backend, dataclasses.replace(batch, common=common))
    n = batch.num_actual_tokens
    assert torch.equal(got[:n], want[:n]) and torch.equal(got_cache, want_cache)
    # the builder's own slot check agrees with the batch's (as if it had not been checked on the host)
    unchecked = dataclasses.replace(common)
    assert not unchecked.host_checked
    backend.get_builder_cls()(spec, "cpu").build(unchecked)


def test_step_host_benchmark_smoke_on_cpu(tmp_path):
    from benchmarks.step_host import main

    out = tmp_path / "rows.json"
    assert main(["--device", "cpu", "--smoke", "--batch-size", "16", "--pages-per-req", "8", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["batch"] for r in rows} == {"decode", "mixed"}
    for row in rows:
        assert (row["case"], row["backend"], row["peer"], row["B"], row["pages"]) == (
            "step_host", "persistent", "build_common_metadata", 16, 128)
        assert row["us"] > 0 and row["peer_us"] > 0 and row["ratio"] == pytest.approx(row["us"] / row["peer_us"],
                                                                                       rel=1e-3)
        assert row["add_us"] > 0 and row["finish_us"] > 0 and row["device"] == "cpu"


@pytest.mark.gpu
def test_run_ahead_on_cuda_each_step_reads_its_own_metadata():
    from attnbackends.testing.run_ahead import put_host_ahead

    batch = PersistentBatch(8, 64, 8, 16, "cuda", num_blocks=128)
    rng = random.Random(0)
    pool = rng.sample(range(128), 128)
    for i in range(6):
        batch.add_request(i, pool[i * 8 : i * 8 + 4], rng.randrange(0, 40))
    steps = [{i: 1 for i in range(6)}, {0: 9, 2: 1, 5: 17}, {i: 1 for i in range(1, 6)}, {3: 20, 4: 1}]
    put_host_ahead("cuda")
    seen, want = [], []
    for scheduled in steps:
        computed = {r: batch.num_computed_tokens(r) for r in scheduled}
        common = batch.prepare(scheduled)
        order = batch.step_req_ids
        want.append(build_common_metadata([scheduled[r] for r in order], [computed[r] for r in order],
                                          [batch.pages(r).tolist() for r in order], 16, "cpu",
                                          max_blocks_per_req=8))
        # the step's "kernels": read the persistent buffers on the stream, after the step's copy
        seen.append({name: getattr(common, name).clone() for name in DEVICE_BUFFERS})
        seen[-1]["host"] = common
    torch.cuda.synchronize()
    for got, expected in zip(seen, want):
        for name in DEVICE_BUFFERS:
            assert torch.equal(got[name].cpu(), getattr(expected, name)), name
    for got, expected in zip(seen[-2:], want[-2:]):  # the last two steps' host copies are still theirs
        for name in ("query_start_loc_cpu", "seq_lens_cpu", "block_table_cpu"):
            assert torch.equal(getattr(got["host"], name), getattr(expected, name)), name


@pytest.mark.gpu
def test_run_ahead_on_cuda_forwards_match_build_common_metadata():
    from attnbackends import select
    from attnbackends.testing.run_ahead import RUN_AHEAD_STEPS, put_host_ahead

    spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=128, dtype="bfloat16", block_size=16)
    backend = select(spec, DeviceInfo.current(torch.device("cuda")))
    batches = [make_random_batch(spec, shapes, seed=100 + i, device="cuda", num_blocks=96)
               for i, shapes in enumerate(RUN_AHEAD_STEPS)]
    builder = backend.get_builder_cls()(spec, "cuda")
    impl = backend.get_impl_cls()(spec)

    def run(common, batch):
        out = batch.new_output()
        impl.forward(batch.query, batch.key, batch.value, batch.kv_cache.clone(), builder.build(common), out)
        return out

    expected = [run(b.common, b) for b in batches]  # compiles, then the reference outputs
    torch.cuda.synchronize()
    persistent = PersistentBatch(8, 256, 16, spec.block_size, "cuda", num_blocks=96)
    put_host_ahead("cuda")
    outputs = []
    for i, b in enumerate(batches):  # every step a new set of requests, prepared while the GPU is behind
        for r in persistent.req_ids:
            persistent.finish_request(r)
        for j, s in enumerate(b.shapes):
            need = -(-s.seq_len // spec.block_size)
            persistent.add_request((i, j), b.common.block_table_cpu[j, :need].numpy(), s.context_len)
        common = persistent.prepare({(i, j): s.query_len for j, s in enumerate(b.shapes)},
                                    num_padded_tokens=b.query.shape[0])
        assert persistent.step_req_ids == [(i, j) for j in range(len(b.shapes))]
        outputs.append(run(common, b))
    torch.cuda.synchronize()
    for i, (got, want) in enumerate(zip(outputs, expected)):
        n = batches[i].num_actual_tokens
        assert torch.equal(got[:n], want[:n]), f"step {i}"
