"""l47.testing — synthetic qwen4exp GGUFs and dumps for the tests and benchmarks (never used by the pipeline).

May import: l47.errors, l47.fileio, l47.model, l47.tail, l47.dumps. Installed as `l47.testing`.
"""
