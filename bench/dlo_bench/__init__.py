"""Benchmarks, tiny models and the demo of dlo.

Each benchmark checks correctness first, warms up, then measures, and reports ratios against a
baseline measured in the same run, as JSON carrying the commit, the machine and the parameters.
Modules are imported lazily by the `dlo` command line; nothing here is imported by the planes.
"""
