"""Benchmarks: one module per measure, each comparing ignite_ext with its peer in the same run."""
