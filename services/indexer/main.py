"""The Indexer pod's entry point: ``python services/indexer/main.py`` runs what
``ance-train serve indexer`` runs (flags and ``ANCE_*`` variables as documented there).

The code of the service is the package ``ance_train.indexer`` (``src/ance_train/indexer/``);
see this folder's README.md for what it consumes and produces.
"""

import sys

from ance_train.cli import app

if __name__ == "__main__":
    app(["serve", "indexer", *sys.argv[1:]])
