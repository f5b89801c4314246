"""Small training sets (issue 33): the 150-query proxies of SciFact and NFCorpus side by side.

Entry point: the code, and its usage in the module docstring, are in
``dev/ance_train_dev/quality_small.py`` (``python bench/quality_small.py --help``)."""

import sys

from ance_train_dev.quality_small import main

if __name__ == "__main__":
    sys.exit(main())
