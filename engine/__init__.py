"""l47.engine — the engines that make dumps: `hf` (transformers Qwen4Exp reference engine, with the GGUF
exporter/loader `gguf_export`) and `strata` (the external Metal binary, CONTRACT.md).

May import: l47.errors, l47.fileio, l47.model, l47.dumps. Installed as `l47.engine`.
"""
