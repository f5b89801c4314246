"""Datasets: BEIR / MS MARCO readers, validation with file and line in every error, the byte-offset
corpus and the dataset index every service fetches from the store."""
