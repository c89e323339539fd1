"""Benchmarks against the peers (FlashInfer, flash-attn), side by side in one process; GPU only.

`attnbackends bench` (or `python benchmarks/run.py`) runs every suite and writes
``benchmarks/results/<gpu>-<date>.json``, a markdown table and a PNG plot. Each suite is also a script:
``python -m attnbackends.bench.triton_vs_flashinfer``, ``...flashinfer_adapter``, ``...mla``.
"""
