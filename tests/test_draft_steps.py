"""Draft steps: the metadata of every step built in one go (topk branches per request over shared prefix pages),
checked against the float64 oracle step by step on the reference backend and Triton (interpreted on the CPU);
the layout helper's shapes, page copies and refusals."""

import os

import pytest
import torch

from attnbackends.speculative.draft_steps import draft_pages_needed, draft_steps_metadata
from attnbackends.interface import AttentionMetadataBuilder
from attnbackends.reference.backend import ReferenceBackend
from attnbackends.testing.conformance import DraftStepCase, check_backend_draft_case, draft_step_cases
from attnbackends.testing.draft_steps import check_backend_draft_steps
from attnbackends.triton.backend import TritonAttentionBackend

TRITON_OK = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@pytest.mark.parametrize("case", draft_step_cases("float32", 32, 8) + draft_step_cases("float16", 32, 8), ids=str)
def test_reference_draft_steps(case):
    check_backend_draft_case(ReferenceBackend, case)


@pytest.mark.skipif(not TRITON_OK, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("case", draft_step_cases("float16", 32, 16), ids=str)
def test_triton_draft_steps(case):
    check_backend_draft_case(TritonAttentionBackend, case, device="cuda" if torch.cuda.is_available() else "cpu")


def test_layout_shapes_slots_and_copies():
    # request 0: 5 tokens in pages [7] (partial); request 1: 8 tokens in [3] (a full page), block_size 8
    branches = [[[7, 20], [11, 12]], [[4], [5]]]  # request 0 branch 0 writes in place; the others own pages
    assert draft_pages_needed(5, 8, 4) == 2 and draft_pages_needed(8, 8, 4) == 1
    draft = draft_steps_metadata([5, 8], [[7], [3]], branches, 8,
                                 topk=2, num_steps=4)
    assert draft.block_table_cpu.tolist() == [[7, 20], [11, 12], [3, 4], [3, 5]]
    assert draft.seq_lens_cpu.tolist() == [[6, 6, 9, 9], [7, 7, 10, 10], [8, 8, 11, 11], [9, 9, 12, 12]]
    assert draft.slot_mapping[0].tolist() == [7 * 8 + 5, 11 * 8 + 5, 4 * 8, 5 * 8]
    assert draft.slot_mapping[3].tolist() == [20 * 8, 12 * 8, 4 * 8 + 3, 5 * 8 + 3]
    assert draft.copy_src.tolist() == [7] and draft.copy_dst.tolist() == [11]
    assert [c.max_seq_len for c in draft.steps] == [9, 10, 11, 12]
    assert all(c.seq_lens.data_ptr() == draft.seq_lens[s].data_ptr() for s, c in enumerate(draft.steps))
    cache = torch.randn(24, 2, 8, 1, 4)
    before = cache.clone()
    draft.copy_prefix_pages(cache)
    assert torch.equal(cache[11], before[7]) and torch.equal(cache[:11], before[:11])


@pytest.mark.parametrize("bad,match", [
    (dict(branch_pages=[[[7, 20], [7, 12]]]), "already used by branch_pages\\[0\\]\\[0\\]"),
    (dict(branch_pages=[[[20, 7], [11, 12]]]), "already used by the prefix"),
    (dict(branch_pages=[[[7], [11, 12]]]), "has 1 pages; 4 draft tokens"),
    (dict(branch_pages=[[[7, 20]]]), "has 1 branches, topk is 2"),
    (dict(context_lens=[0]), "needs a cached prefix"),
    (dict(block_tables=[[]]), "has 0 pages; a prefix of 5 tokens needs 1"),
])
def test_layout_refuses_bad_input(bad, match):
    args = dict(context_lens=[5], block_tables=[[7]], branch_pages=[[[7, 20], [11, 12]]])
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        draft_steps_metadata(args["context_lens"], args["block_tables"], args["branch_pages"], 8, topk=2, num_steps=4)


def test_steps_built_before_running_must_not_share_a_plan():
    """A builder whose steps clobber one another's metadata fails the check (the check can fail)."""

    class SharedPlanBuilder(ReferenceBackend.get_builder_cls()):
        def build_draft_steps(self, draft):
            last = self.build(draft.steps[-1])
            return [last] * len(draft.steps)

    class SharedPlan(ReferenceBackend):
        name = "shared_plan"

        @classmethod
        def get_builder_cls(cls):
            return SharedPlanBuilder

    case = draft_step_cases("float32", 32, 8)[1]
    with pytest.raises(AssertionError, match="draft step 0"):
        check_backend_draft_steps(SharedPlan, case)


def test_default_build_draft_steps_builds_each_step():
    assert AttentionMetadataBuilder.build_draft_steps.__doc__
    case = DraftStepCase("x", dict(num_heads=2, num_kv_heads=1, head_size=16, dtype="float32", block_size=4),
                         (3, 9), topk=2, num_steps=2)
    assert check_backend_draft_steps(ReferenceBackend, case) is None


def test_a_strided_slot_mapping_is_refused_by_the_cache_write():
    from attnbackends.ops.kv_cache_write import check_reshape_and_cache_args

    key = torch.randn(2, 1, 16)
    slots = torch.tensor([[1, 2], [3, 4]]).T[0]  # [1, 3] with stride 2
    with pytest.raises(ValueError, match="slot_mapping must be contiguous"):
        check_reshape_and_cache_args(key, key, torch.zeros(4, 2, 4, 1, 16), slots)
