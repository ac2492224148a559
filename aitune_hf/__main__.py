"""`python -m aitune_hf`: the same command line as `aitune-hf`."""

import sys

from aitune_hf.cli import main

if __name__ == "__main__":
    sys.exit(main())
