"""solvers/qp.py nnls_gram (the WFLD / plan dual QP) against scipy.optimize.nnls on the equivalent least-squares
form (the solver WFLD used before): same minimiser to 1e-8 relative (both are exact active-set methods on the
same strictly convex problem: they differ by rounding only), and the KKT conditions on every problem."""

import numpy as np
import pytest
import scipy.optimize
import torch

from l47.solvers.qp import nnls_gram


def _scipy(K: np.ndarray, b: np.ndarray) -> np.ndarray:
    L = np.linalg.cholesky(K)
    mu, _ = scipy.optimize.nnls(L.T, -np.linalg.solve(L, b), maxiter=50 * len(K))
    return mu


def _problem(m: int, rank: int, seed: int, ridge: float = 1e-6):
    """K = C Cᵀ + ridge·tr/m·I with C [m, rank] (rank < m: the near-singular Grams of many events sharing few
    directions, as WFLD's), b with both signs."""
    rng = np.random.default_rng(seed)
    C = rng.standard_normal((m, rank)) * rng.uniform(0.1, 3.0, rank)
    K = C @ C.T
    K += ridge * np.trace(K) / m * np.eye(m)
    b = rng.standard_normal(m) * 2.0 - 0.5
    return K, b


def _kkt(K, b, mu):
    y = K @ mu + b
    scale = np.abs(b).max()
    assert (mu >= 0).all()
    assert y.min() >= -1e-8 * scale
    assert np.abs(mu * y).max() <= 1e-8 * scale * max(1.0, mu.max())


@pytest.mark.parametrize("m,rank,seed", [(1, 1, 0), (7, 7, 1), (60, 60, 2), (120, 30, 3), (300, 40, 4),
                                         (400, 400, 5)])
def test_nnls_gram_matches_scipy_and_kkt(m, rank, seed):
    K, b = _problem(m, rank, seed)
    mu = nnls_gram(torch.from_numpy(K), torch.from_numpy(b))
    assert mu is not None
    mu = mu.numpy()
    ref = _scipy(K, b)
    _kkt(K, b, mu)
    obj = lambda x: 0.5 * x @ K @ x + b @ x  # noqa: E731
    assert obj(mu) <= obj(ref) + 1e-10 * abs(obj(ref))
    assert np.abs(mu - ref).max() <= 1e-8 * max(1.0, np.abs(ref).max())


def test_nnls_gram_edge_cases():
    K = np.diag([2.0, 4.0, 1.0])
    b = np.array([-2.0, 4.0, -3.0])
    mu = nnls_gram(torch.from_numpy(K), torch.from_numpy(b)).numpy()
    np.testing.assert_allclose(mu, [1.0, 0.0, 3.0], rtol=0, atol=1e-15)  # diagonal: μ = max(0, −b/k)
    assert np.array_equal(nnls_gram(torch.from_numpy(K), torch.ones(3, dtype=torch.float64)).numpy(), np.zeros(3))
    assert nnls_gram(torch.zeros(0, 0, dtype=torch.float64), torch.zeros(0, dtype=torch.float64)).numel() == 0


def test_nnls_gram_refuses_an_indefinite_block():
    K = np.diag([1.0, -1.0])  # indefinite: its Cholesky fails once both indices are passive
    assert nnls_gram(torch.from_numpy(K), torch.tensor([-1.0, -1.0], dtype=torch.float64)) is None
