"""A small GPT and a byte-level text DataModule, used by the examples and the benchmarks."""
