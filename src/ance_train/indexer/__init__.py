"""The Indexer service: builds the index of a refreshed checkpoint, mines negatives, evaluates,
serves ``Retrieval.Search``."""
