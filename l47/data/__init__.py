"""l47.data — what the pipeline reads and writes between stages: the experiment schema (`experiment`), the sets
report (`sets`: events, splits, collateral, refusals), the typed solve record (`record`) and the content-keyed
ledger (`ledger`).

May import: l47.errors, l47.fileio, l47.model, l47.tail, l47.dumps. Installed as `l47.data`.
"""
