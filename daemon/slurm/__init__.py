"""Slurm access: typed records, command builders and parsers, and the backend that joins them."""
