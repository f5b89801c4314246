"""The bi-encoder, fast encoding and the checkpoint model cache."""
