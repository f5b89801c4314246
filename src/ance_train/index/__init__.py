"""FAISS indexes (``ann``) and the capacity model of ``ance-train plan`` (``capacity``)."""
