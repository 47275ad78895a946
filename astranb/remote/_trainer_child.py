"""The child process of `ProcessTrainer` (astranb.remote.process): `python -m` this module."""

import sys

from .process import main

if __name__ == "__main__":
    sys.exit(main())
