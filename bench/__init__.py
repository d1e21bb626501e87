"""Benchmarks: each module compares crashsafe against named baselines side by side in one run."""
