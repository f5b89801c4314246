"""How hard are the negatives a run trained on, seen by the model at each of its checkpoints?

Entry point: the code, and its usage in the module docstring, are in
``dev/ance_train_dev/negative_hardness.py`` (``python bench/negative_hardness.py --help``)."""

from ance_train_dev.negative_hardness import main

if __name__ == "__main__":
    main()
