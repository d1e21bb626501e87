"""Reference training jobs used by the demo, tests and benchmarks (data ships offline)."""
