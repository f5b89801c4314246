"""The Trainer pod's entry point: ``python services/trainer/main.py`` runs what
``ance-train serve trainer`` runs (flags and ``ANCE_*`` variables as documented there).

The code of the service is the package ``ance_train.trainer`` (``src/ance_train/trainer/``);
see this folder's README.md for what it consumes and produces.
"""

import sys

from ance_train.cli import app

if __name__ == "__main__":
    app(["serve", "trainer", *sys.argv[1:]])
