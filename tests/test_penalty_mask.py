"""evals/penalty.penalty_mask asks the one decision function (`penalized_at`) only where a rule's prefix can end,
with the history cut to the longest prefix: the mask must equal asking `penalized_at` at every row with the whole
history, for every form, on token streams dense in prefix tokens (overlapping and repeated prefixes, a prefix at
the very start) — compared exactly (bool arrays)."""

import numpy as np
import pytest

from l47.errors import L47Error
from l47.evals.penalty import FORMS, PenaltyRule, PenaltySpec, penalized_at, penalty_mask

RULES = (PenaltyRule("a", (7, 8), 7), PenaltyRule("b", (11,), 12), PenaltyRule("c", (3, 7, 8), 9),
         PenaltyRule("d", (8,), 30), PenaltyRule("e", (20, 20, 20, 21), 22))


def _every_row(tokens, spec, form):
    """The reference: penalized_at at every row with the whole history."""
    tokens = [int(i) for i in tokens]
    finals = spec.finals
    m = np.zeros((len(tokens) - 1, len(finals)), dtype=bool)
    for t in range(len(tokens) - 1):
        for tok in penalized_at(tokens[:t + 1], spec, form):
            m[t, finals.index(tok)] = True
    return m


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_penalty_mask_equals_asking_every_row(form, seed):
    rng = np.random.default_rng(seed)
    spec = PenaltySpec(bias=4.0, rules=RULES, form=form)
    pool = np.array([3, 7, 8, 11, 20, 21, 1, 2, 5])  # mostly prefix tokens: many hits and near misses
    for T in (1, 2, 5, 300):
        tokens = np.concatenate([[7, 8], rng.choice(pool, T)])  # a prefix at the very start
        got = penalty_mask(tokens, spec)
        assert got.shape == (T + 1, len(spec.finals))
        assert np.array_equal(got, _every_row(tokens, spec, form))
    assert got.any()  # the streams do hit


def test_penalty_mask_edge_cases():
    spec = PenaltySpec(bias=4.0, rules=RULES)
    assert penalty_mask([5], spec).shape == (0, len(spec.finals))
    assert not penalty_mask([1, 2, 3], PenaltySpec(bias=4.0, rules=())).size
    with pytest.raises(L47Error):
        penalty_mask([7, 8, 7], spec, "no-such-form")
