"""l47.app — the command line (`cli`) and the drivers behind it (dump, score, inspect, bench, demo and the rich
rendering of what the library returns). The only place that prints, the only place that imports rich, and the
only place that wires engines, solvers and evals together.

May import: everything. Installed as `l47.app`; the `l47` console script is `l47.app.cli:app`.
"""
