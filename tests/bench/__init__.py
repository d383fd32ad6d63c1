"""Benchmarks: they print figures for the README; they assert nothing about time."""
