"""`python -m attnbackends.cli`: the `attnbackends` command."""

import sys

from . import main

if __name__ == "__main__":  # importing the package's modules (e.g. pkgutil.walk_packages) must not run it
    sys.exit(main())
