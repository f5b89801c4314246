"""Encoding throughput on SciFact: a plain Hugging Face loop vs ``encode_texts``.

Entry point: the code, and its usage in the module docstring, are in
``dev/ance_train_dev/encode.py`` (``python bench/encode.py --help``)."""

import sys

from ance_train_dev.encode import main

if __name__ == "__main__":
    sys.exit(main())
