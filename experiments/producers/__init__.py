"""Measurements outside the run command, each a command of its own writing a record or a data file: profiles of
real queries and keys, HATA's hash weights and recall, head importance, similarity, skew bases, the memory table."""
