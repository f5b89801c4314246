"""Retrieval quality on SciFact (or NFCorpus): does each method help? Measured through the real
services, against the sentence-transformers recipe a user would run instead.

Entry point: the code, and its usage in the module docstring, are in
``dev/ance_train_dev/quality.py`` (``python bench/quality.py --help``)."""

import sys

from ance_train_dev.quality import main

if __name__ == "__main__":
    sys.exit(main())
