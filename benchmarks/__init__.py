"""Benchmarks of lightning_loco: run as modules from the repository root, e.g.
``python -m benchmarks.b1_sync_latency --quick``."""
