"""Helpers for tests, benchmarks and examples that start ranks and replicas of their own."""
