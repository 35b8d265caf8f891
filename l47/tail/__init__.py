"""l47.tail — the exact tail forward of DESIGN §1 as pure functions with a shape legend (`forward`), and the one
streaming accumulator over the vocabulary (log-sum-exp, target log p, KL, top-k and Fisher moments) that every
consumer uses.

May import: l47.errors, l47.model. Installed as `l47.tail`.
"""
