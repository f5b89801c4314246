"""Refresh period with 1, 2, 4 inferencer replicas, through the real services.

Entry point: the code, and its usage in the module docstring, are in
``dev/ance_train_dev/refresh_scaling.py`` (``python bench/refresh_scaling.py --help``)."""

import sys

from ance_train_dev.refresh_scaling import main

if __name__ == "__main__":
    sys.exit(main())
