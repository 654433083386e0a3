"""``python -m posenc_fast info|verify|bench`` (see posenc_fast/cli/)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
