"""A seeded chaos soak: a whole embedded run under random faults, checked for anything lost.

Entry point: the code, and its usage in the module docstring, are in
``dev/ance_train_dev/chaos.py`` (``python bench/chaos.py --help``)."""

import sys

from ance_train_dev.chaos import main

if __name__ == "__main__":
    sys.exit(main())
