"""Speculative decoding support: the packed tree masks of verify steps (:mod:`.tree_mask`) and the metadata of a
draft model's steps (:mod:`.draft_steps`)."""

from .draft_steps import DraftSteps, draft_pages_needed, draft_steps_metadata
from .tree_mask import (
    chain_parents,
    check_parents,
    expand_tree_mask,
    request_tree_mask,
    tree_mask_from_parents,
    with_tree_mask,
)

__all__ = [
    "DraftSteps",
    "chain_parents",
    "check_parents",
    "draft_pages_needed",
    "draft_steps_metadata",
    "expand_tree_mask",
    "request_tree_mask",
    "tree_mask_from_parents",
    "with_tree_mask",
]
