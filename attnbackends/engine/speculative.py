"""Speculative decoding for the compact engine: drafters that propose token trees, and greedy acceptance of the
longest path the target model agrees with.

A draft is a tree hanging off the root (the last accepted token, not yet cached): ``DraftTree.tokens[a]`` with
parent ``DraftTree.parents[a]`` (an index into the same lists, -1 for the root). The engine verifies the root and
every draft token in one forward (query = [root] + tokens, tree mask from the parents), accepts the longest path
whose tokens equal the target's greedy choices, appends the target's token after it (the bonus token), and rolls
the KV cache back to the accepted path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import torch

__all__ = [
    "DraftModelDrafter",
    "DraftTree",
    "Drafter",
    "NgramDrafter",
    "SpeculativeConfig",
    "accept_greedy",
]


@dataclass
class DraftTree:
    """Draft tokens in a tree below the root: ``parents[a]`` indexes ``tokens`` (-1: a child of the root)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def add_path(self, path: Sequence[int], limit: int) -> None:
        """Merge a chain of tokens below the root into the tree (a trie), up to ``limit`` tokens in all."""
        node = -1
        for token in path:
            child = next((a for a, (t, p) in enumerate(zip(self.tokens, self.parents)) if p == node and t == token), None)
            if child is None:
                if len(self.tokens) >= limit:
                    return
                self.tokens.append(int(token))
                self.parents.append(node)
                child = len(self.tokens) - 1
            node = child

    def depths(self) -> list[int]:
        """Depth of each draft token below the root (children of the root: 1)."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def segment_parents(self) -> list[int]:
        """Parents of the verify segment [root] + tokens, as :mod:`attnbackends.speculative.tree_mask` takes them."""
        return [-1] + [p + 1 for p in self.parents]

    @property
    def num_branches(self) -> int:
        return sum(1 for p in self.parents if p < 0)


class Drafter(Protocol):
    def propose(self, tokens: Sequence[int], max_tokens: int) -> DraftTree:
        """A draft tree of at most ``max_tokens`` tokens continuing ``tokens`` (the prompt and the output so far)."""


@dataclass(frozen=True)
class NgramDrafter:
    """Prompt lookup: the continuations of earlier occurrences of the sequence's last n tokens (longest n first),
    up to ``num_branches`` different ones, each ``depth`` tokens long, merged into a tree."""

    min_ngram: int = 1
    max_ngram: int = 3
    num_branches: int = 2
    depth: int = 3

    def propose(self, tokens: Sequence[int], max_tokens: int) -> DraftTree:
        tree = DraftTree()
        tokens = list(tokens)
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            suffix = tokens[-n:]
            firsts: set[int] = set()
            for start in range(len(tokens) - n - 1, -1, -1):  # the most recent occurrence first
                if tokens[start : start + n] != suffix:
                    continue
                follow = tokens[start + n : start + n + self.depth]
                if follow[0] in firsts:
                    continue
                firsts.add(follow[0])
                tree.add_path(follow, max_tokens)
                if len(firsts) == self.num_branches:
                    break
            if len(tree):
                break
        return tree


@dataclass
class DraftModelDrafter:
    """A small model sharing the tokenizer: its top ``num_branches`` first tokens, each continued greedily to
    ``depth`` tokens. ``next_logits(tokens) -> [vocab]`` scores the next token after a sequence (e.g. a model's
    ``forward_dense(tokens)[-1]``)."""

    next_logits: Callable[[list[int]], torch.Tensor]
    num_branches: int = 2
    depth: int = 3

    @classmethod
    def from_model(cls, model: torch.nn.Module, device: "torch.device | str" = "cpu", **kwargs) -> "DraftModelDrafter":
        """A drafter over a model with ``forward_dense(tokens [L]) -> logits [L, vocab]`` (:class:`TinyLlama`)."""
        model = model.to(device).eval()

        @torch.inference_mode()
        def next_logits(tokens: list[int]) -> torch.Tensor:
            return model.forward_dense(torch.tensor(tokens, dtype=torch.long, device=device))[-1]

        return cls(next_logits, **kwargs)

    def propose(self, tokens: Sequence[int], max_tokens: int) -> DraftTree:
        tree = DraftTree()
        tokens = list(tokens)
        firsts = torch.topk(self.next_logits(tokens), self.num_branches).indices.tolist()
        for first in firsts:
            path = [first]
            while len(path) < self.depth:
                path.append(int(self.next_logits(tokens + path).argmax()))
            tree.add_path(path, max_tokens)
        return tree


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding in :class:`~attnbackends.engine.PagedEngine`.

    drafter : an :class:`NgramDrafter`, a :class:`DraftModelDrafter`, or anything with ``propose``.
    num_speculative_tokens : most draft tokens per request and step (the verify query is 1 + this many tokens; the
        attention spec asks the backend for it, with a tree mask).
    """

    drafter: Drafter
    num_speculative_tokens: int = 4

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")


def accept_greedy(tree: DraftTree, target: Sequence[int]) -> tuple[list[int], int]:
    """The longest path of draft tokens the target agrees with, and the target's token after it.

    target : the target's greedy token at each verify position, [1 + len(tree)]: index 0 after the root, index
        1 + a after draft token a.

    Returns
    -------
    (path, bonus): the accepted draft-token indices from the root down, and the target's next token.
    """
    path: list[int] = []
    node = -1
    while True:
        want = int(target[node + 1])
        child = next((a for a, (t, p) in enumerate(zip(tree.tokens, tree.parents)) if p == node and t == want), None)
        if child is None:
            return path, want
        path.append(child)
        node = child

