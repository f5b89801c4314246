"""Test and benchmark support (never shipped in the wheel): synthetic corpora and vectors, a
tiny random BERT."""
