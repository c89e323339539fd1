"""Test support shared by our tests and third-party backends: random batches, the float64 oracle, tolerances and
the conformance suite."""

from .cases import SEQUENCE_KINDS, RandomBatch, SequenceShape, make_random_batch, random_sequence_shapes
from .conformance import (
    CaseNotSupported,
    ConformanceCase,
    check_backend_case,
    check_backend_case_or_raise,
    check_backend_on_batch,
    check_backend_on_batches,
    conformance_cases,
    run_backend_on_batch,
    sweep,
)
from .layer_groups import LAYER_GROUP_SHAPES, check_layer_groups, layer_group_batches
from .oracle import oracle_attention
from .run_ahead import RUN_AHEAD_STEPS, check_backend_run_ahead, run_ahead_batches
from .tolerances import Tolerance, assert_close_to_oracle, tolerance_for

__all__ = [
    "SEQUENCE_KINDS",
    "RandomBatch",
    "SequenceShape",
    "make_random_batch",
    "random_sequence_shapes",
    "CaseNotSupported",
    "ConformanceCase",
    "check_backend_case",
    "check_backend_case_or_raise",
    "check_backend_on_batch",
    "check_backend_on_batches",
    "conformance_cases",
    "run_backend_on_batch",
    "sweep",
    "LAYER_GROUP_SHAPES",
    "check_layer_groups",
    "layer_group_batches",
    "oracle_attention",
    "RUN_AHEAD_STEPS",
    "check_backend_run_ahead",
    "run_ahead_batches",
    "Tolerance",
    "assert_close_to_oracle",
    "tolerance_for",
]
