"""l47.testing — synthetic qwen4exp GGUFs and dumps for the tests and benchmarks, and planted failures built from
any experiment's own files (`planted`); never used by the pipeline.

May import: l47.errors, l47.fileio, l47.model, l47.tail, l47.dumps, l47.data. Installed as `l47.testing`.
"""
