"""The Inferencer pod's entry point: ``python services/inferencer/main.py`` runs what
``ance-train serve inferencer`` runs (flags and ``ANCE_*`` variables as documented there).

The code of the service is the package ``ance_train.inferencer`` (``src/ance_train/inferencer/``);
see this folder's README.md for what it consumes and produces.
"""

import sys

from ance_train.cli import app

if __name__ == "__main__":
    app(["serve", "inferencer", *sys.argv[1:]])
