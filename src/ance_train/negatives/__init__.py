"""Hard negatives: the negatives table, the strategies of the papers and the indexer-side mining."""
