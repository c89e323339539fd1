"""Greedy-token agreement between two runs of a model: the share of generated positions where one run's greedy
choice equals the other's, teacher-forced (each run sees the same tokens, so one early disagreement does not
change what follows). ``attnbackends demo`` compares the engine with a dense recompute this way; the
``kv_quant_accuracy`` benchmark compares a quantised KV cache with a 16-bit one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

if TYPE_CHECKING:
    from .engine import PagedEngine

__all__ = ["TokenAgreement", "teacher_forced_agreement", "token_agreement"]


@dataclass(frozen=True)
class TokenAgreement:
    """How often two runs' greedy choices agree.

    agreement : matches / positions (1.0 where there are no positions).
    positions : generated positions compared, over every prompt.
    matches : positions where both runs chose the same token.
    first_divergence : the earliest continuation index (0: the token after the prompt) at which some prompt's
        choices differ; None where every position agrees.
    """

    agreement: float
    positions: int
    matches: int
    first_divergence: Optional[int]


def token_agreement(choices: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]) -> TokenAgreement:
    """Compare per-prompt token lists position by position (each pair of equal length)."""
    if len(choices) != len(reference):
        raise ValueError(f"{len(choices)} choice lists for {len(reference)} reference lists")
    positions = matches = 0
    first: Optional[int] = None
    for i, (got, want) in enumerate(zip(choices, reference)):
        if len(got) != len(want):
            raise ValueError(f"prompt {i}: {len(got)} choices for {len(want)} reference tokens")
        for j, (a, b) in enumerate(zip(got, want)):
            if int(a) == int(b):
                matches += 1
            elif first is None or j < first:
                first = j
        positions += len(want)
    return TokenAgreement(matches / positions if positions else 1.0, positions, matches, first)


def teacher_forced_agreement(engine: "PagedEngine", prompts: list[list[int]],
                             reference_tokens: list[list[int]]) -> TokenAgreement:
    """Feed ``engine`` each prompt followed by its ``reference_tokens`` (another run's greedy output) and compare
    the engine's greedy choice (the argmax of its logits, [len(reference_tokens[i]), vocab] per prompt) at every
    continuation position with the reference token there."""
    result = engine.generate_teacher_forced(prompts, reference_tokens)
    choices = [logits.argmax(dim=-1).tolist() for logits in result.logits]
    return token_agreement(choices, reference_tokens)
