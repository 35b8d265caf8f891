"""The non-negative dual QP of WFLD and the plan: argmin_{μ ≥ 0} ½ μᵀKμ + μᵀb for a positive definite Gram K.

Lawson–Hanson's active-set method in the Gram form (R. Bro, S. de Jong, "A fast non-negativity-constrained least
squares algorithm", J. Chemometrics 11 (1997): FNNLS): the same iterates as scipy.optimize.nnls on the
least-squares form ‖Lᵀμ + L⁻¹b‖² (K = L Lᵀ), whose gradient is the same w = −(Kμ + b), but each step costs one
m × |P| product and one |P| × |P| Cholesky solve (P the passive set) instead of work on the m × m matrix Lᵀ —
and runs on K's device. WFLD's dual has m ≈ 3 × events (4,290 rows for 1,430 events): scipy's nnls took minutes
a Gauss–Newton step on the CPU there.

Steps: add the index of the largest w outside P; solve μ_P = −K_PP⁻¹ b_P; while some μ_P ≤ 0, step back from the
previous iterate to the first zero crossing and drop the indices that reach 0; stop when w ≤ tol outside P (KKT:
μ ≥ 0, w ≤ tol, μ·w = 0 on P).

Shapes: K [m, m] f64, b [m] f64, μ [m] f64.
"""

from __future__ import annotations

import torch

REL_TOL = 1e-12  # w ≤ REL_TOL × max|b| outside P counts as stationary (rounding), as scipy's tol on the same w


def nnls_gram(K: torch.Tensor, b: torch.Tensor, max_iter: int | None = None) -> torch.Tensor | None:
    """μ [m] ≥ 0 minimising ½ μᵀKμ + μᵀb (K positive definite, f64), or None when the active set does not settle
    within max_iter additions (default 3 m) or a K_PP is not numerically positive definite."""
    m = K.shape[0]
    mu = torch.zeros_like(b)
    if m == 0:
        return mu
    max_iter = 3 * m + 10 if max_iter is None else max_iter
    tol = REL_TOL * float(b.abs().max())
    P = torch.zeros(m, dtype=torch.bool, device=K.device)  # passive set
    w = -b  # [m] −gradient at μ = 0
    for _ in range(max_iter):
        j = int(torch.argmax(w.masked_fill(P, -torch.inf)))
        if P[j] or float(w[j]) <= tol:
            return mu
        P[j] = True
        s = _solve_passive(K, b, P)
        while s is not None and bool((s[P] <= 0).any()):
            neg = P & (s <= 0)  # step back to the first zero crossing on the segment mu -> s
            alpha = float(torch.min(mu[neg] / (mu[neg] - s[neg])))
            mu = mu + alpha * (s - mu)
            P &= mu > 0
            if not bool(P.any()):
                break
            s = _solve_passive(K, b, P)
        if s is None:
            return None
        if not bool(P.any()):  # the index just added could not move (rounding at the boundary): stationary
            return mu
        mu = s
        w = -(K[:, P] @ mu[P] + b)  # [m]
    return None


def _solve_passive(K: torch.Tensor, b: torch.Tensor, P: torch.Tensor) -> torch.Tensor | None:
    """s [m]: s_P = −K_PP⁻¹ b_P, 0 elsewhere; None when K_PP's Cholesky factorisation fails."""
    idx = P.nonzero().flatten()  # [|P|]
    L, info = torch.linalg.cholesky_ex(K[idx][:, idx])  # [|P|, |P|]
    if int(info) != 0:
        return None
    s = torch.zeros_like(b)
    s[idx] = -torch.cholesky_solve(b[idx, None], L)[:, 0]
    return s
