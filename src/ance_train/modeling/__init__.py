"""The bi-encoder, fast encoding, the checkpoint model cache and export."""
