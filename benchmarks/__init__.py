"""Benchmarks against the peers (FlashInfer, flash-attn), side by side in one process; GPU only.

Tooling, not part of the installed library: run from the checkout's root. ``python -m benchmarks.run`` runs every
suite and writes ``benchmarks/results/<gpu>-<date>.json``, a markdown table and a PNG plot (tqdm, tabulate and
matplotlib come with the ``dev`` extra). Each suite is also a script: ``python -m benchmarks.triton_vs_flashinfer``,
``...flashinfer_adapter``, ``...mla``; ``python benchmarks/cp_decode.py`` times context-parallel decode on 2 GPUs.
"""
