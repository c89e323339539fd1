"""Every benchmark suite on this GPU, side by side with the peers; see attnbackends/bench/__init__.py.

    python benchmarks/run.py [--suites triton,flashinfer_adapter,mla] [--outdir benchmarks/results]
"""

import sys

from attnbackends.bench.run import main

if __name__ == "__main__":
    sys.exit(main())
