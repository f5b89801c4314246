"""Paired significance of the quality benchmark's differences, over test queries.

Entry point: the code, and its usage in the module docstring, are in
``dev/ance_train_dev/significance.py`` (``python bench/significance.py --help``)."""

import sys

from ance_train_dev.significance import main

if __name__ == "__main__":
    sys.exit(main())
