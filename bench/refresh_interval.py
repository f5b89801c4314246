"""Refresh interval at a fixed budget (issue 31, item 3): do fresher ANN negatives help on dev?

Entry point: the code, and its usage in the module docstring, are in
``dev/ance_train_dev/refresh_interval.py`` (``python bench/refresh_interval.py --help``)."""

import sys

from ance_train_dev.refresh_interval import main

if __name__ == "__main__":
    sys.exit(main())
