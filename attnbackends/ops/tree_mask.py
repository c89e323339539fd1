"""The tree-verification mask as a ``@triton.jit`` helper, shared by the kernels that verify draft trees (the Triton
unified kernel, MLA decode).

A request's last ``draft_len`` tokens, from position ``draft_start`` on, are a draft segment: inside it a query sees
only its ancestors, read from the request's packed [draft_len, draft_len] mask (row = query, column = key, nonzero =
visible; :attr:`~attnbackends.metadata.CommonAttentionMetadata.spec_tree_mask`). Keys before the segment are
untouched.
"""

import triton
import triton.language as tl

__all__ = ["tree_visible"]


@triton.jit
def tree_visible(vis, offs_n, pos, draft_start, draft_len, tree_ptr):
    """``vis`` [M, N] bool (query rows at positions ``pos`` [M], keys ``offs_n`` [N]) with the draft segment's
    entries restricted to the tree: ``tree_ptr`` points at the request's packed mask."""
    in_tree = ((pos[:, None] >= draft_start) & (pos[:, None] < draft_start + draft_len)
               & (offs_n[None, :] >= draft_start) & vis)
    t_idx = (pos[:, None] - draft_start) * draft_len + (offs_n[None, :] - draft_start)
    allowed = tl.load(tree_ptr + t_idx, mask=in_tree, other=1)
    return vis & (allowed != 0)
