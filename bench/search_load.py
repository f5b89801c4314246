"""Search under load: many concurrent gRPC clients on the indexer's ``Retrieval.Search`` while
the served index is swapped, as a refresh swaps it.

Entry point: the code, and its usage in the module docstring, are in
``dev/ance_train_dev/search_load.py`` (``python bench/search_load.py --help``)."""

import sys

from ance_train_dev.search_load import main

if __name__ == "__main__":
    sys.exit(main())
