"""The Inferencer service: claims shard work items, encodes them with a checkpoint, uploads the
embeddings."""
