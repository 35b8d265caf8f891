"""l47.evals — the audit: per-document metrics, the bars as data, KLD statistics, audit orchestration,
reports and plots, the sampler penalty.

May import: l47.errors, l47.fileio, l47.model, l47.tail, l47.data, l47.dumps. Installed as `l47.evals`.
"""
