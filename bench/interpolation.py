"""Weight interpolation towards the starting model (WiSE-FT, arXiv 2109.01903), scanned over the
checkpoints of finished runs: dev and test nDCG@10 for each interpolation weight.

Entry point: the code, and its usage in the module docstring, are in
``dev/ance_train_dev/interpolation.py`` (``python bench/interpolation.py --help``)."""

import sys

from ance_train_dev.interpolation import main

if __name__ == "__main__":
    sys.exit(main())
