"""Benchmarks: ratios measured side by side in one invocation; results go to docs/benchmarks.md."""
