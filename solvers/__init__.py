"""l47.solvers — the posed problem and the Solver protocol (`problem`), the registered methods (`methods`), the
settings' knobs (`knobs`), feasibility plan, WFLD closed form, FTPO trainer (the package `ftpo`), the constraint
builders both share (`batch`), K-FAC factors (`fisher`), re-quantisation and bundle writing (`bundle`), the solve
driver (`solve`).

May import: l47.errors, l47.fileio, l47.model, l47.tail, l47.data, l47.dumps. Installed as `l47.solvers`.
"""
