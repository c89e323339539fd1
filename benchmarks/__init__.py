"""Benchmarks against the peers (FlashInfer, flash-attn, torch SDPA), side by side in one process; GPU only.

Tooling, not part of the installed library: run from the checkout's root. ``python -m benchmarks.run --list`` names
the suites; ``python -m benchmarks.run --suite NAME`` runs one and keeps its results in ``benchmarks/results/``
(``<gpu>-<suite>-<date>.{json,md,log}``), from which ``benchmarks/RESULTS.md`` is generated;
``python -m benchmarks.run --gpu-tests`` runs the GPU test groups. ``bash benchmarks/gpu_run.sh`` does either on a
GPU host. The design decisions these numbers stand behind: ``benchmarks/NOTES.md``. tqdm, tabulate and matplotlib
come with the ``dev`` extra.
"""
