"""ance-train: dense retrievers trained with globally mined, asynchronously refreshed ANN negatives.

The three services are the packages ``trainer``, ``inferencer`` and ``indexer``; what travels
between them is defined once in ``protocol``. See docs/architecture.md ("Where does X live")."""
