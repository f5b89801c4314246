"""The Trainer service: the training loop, its negatives feed and its checkpoints."""
