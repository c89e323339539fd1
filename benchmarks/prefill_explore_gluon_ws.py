"""The sm_90 compile report of the backend's Gluon prefill under the name
``tests/triton_backend/test_prefill_hopper.py`` calls (``--compile-only --configs 0 [--cache-write]`` and
:func:`compile_problems`); :mod:`benchmarks.compile_check` is the tool. Remove this module once that test calls
``benchmarks.compile_check`` (``--gluon-prefill [--cache-write]`` and ``gluon_prefill_problems``).
"""

from __future__ import annotations

import argparse
import json
import sys

from benchmarks.compile_check import gluon_prefill_problems as compile_problems
from benchmarks.compile_check import gluon_prefill_report as compile_report

__all__ = ["compile_problems", "compile_report", "main"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compile-only", action="store_true", required=True, help="the sm_90 compile report")
    ap.add_argument("--configs", default="0", choices=["0"], help="0: the backend's config (the only one)")
    ap.add_argument("--cache-write", action="store_true", help="the variant writing the paged cache itself")
    args = ap.parse_args(argv)
    print(json.dumps(compile_report(cache_write=args.cache_write)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
