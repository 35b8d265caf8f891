"""The sampler penalty: the exact simulation from per-position statistics against the exported transformers
LogitsProcessor applied to full random logits (float64 reference), the cheap forms' extra hits, the JSON spec.

Reference: full [T, V] logits in float64; the processor subtracts the bias from the logits it is handed; the
reference log-softmaxes them and takes KL / argmax directly. The simulation only sees log p of the target, the
top-k and the final tokens (what the audit keeps per position), so agreement to 1e-9 (float64 throughout) shows
the closed forms (log Z', KL = b·Σp + log Z', stacked KL) are exact.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.special import log_softmax

from l47.errors import L47Error
from l47.evals.penalty import (FORM_EXACT, FORM_LAST, FORM_SEED, PenaltyRule, PenaltySpec, extra_hits,
                               logits_processor, make_spec, penalized_at, penalty_mask, read_spec, simulate)
from l47.tail.forward import HeadStats

V = 40
# banned tuples over a toy vocabulary: "end to end" = (7, 8, 7), "rather than" = (11, 12), "right away" = (20, 21)
RULES = (PenaltyRule("end to end", (7, 8), 7), PenaltyRule("rather than", (11,), 12),
         PenaltyRule("right away", (20,), 21))
SPEC = PenaltySpec(bias=4.0, rules=RULES)


def _stats(z: np.ndarray, targets: np.ndarray, finals, k: int) -> HeadStats:
    """HeadStats of full f64 logits z [T, V] (what l47.tail.forward computes per position, here exactly)."""
    lp = log_softmax(z, axis=1)
    order = np.argsort(-lp, axis=1, kind="stable")[:, :k]
    T = z.shape[0]
    return HeadStats(lse=np.zeros(T), logp_target=lp[np.arange(T), targets], argmax=order[:, 0],
                     top_ids=order, top_logp=np.take_along_axis(lp, order, 1),
                     entropy=np.zeros(T), set_logp={"finals": lp[:, list(finals)]})


def _tokens(rng, T):
    t = rng.choice([i for i in range(V) if i not in (7, 8, 11, 20)], T + 1)  # prefix tokens only where planted
    # plant exact matches, a "to end" without "end" before it (cheap-form extra hit), and a lone 20
    t[5:8] = (7, 8, 7)
    t[15:17] = (11, 12)
    t[25:27] = (3, 8)
    t[27] = 7
    t[35:37] = (20, 21)
    return t


def _reference(z, tokens, spec, base_z=None):
    """Apply the exported processor to full logits; return log p(target), argmax, KL(base ‖ penalised)."""
    proc = logits_processor(spec)
    T = z.shape[0]
    out_lp, out_am, out_kl = np.zeros(T), np.zeros(T, dtype=np.int64), np.zeros(T)
    lb = log_softmax(z if base_z is None else base_z, axis=1)
    for t in range(T):
        s = proc(torch.tensor(tokens[None, :t + 1]), torch.tensor(z[None, t], dtype=torch.float64))[0].numpy()
        lq = log_softmax(s)
        out_lp[t] = lq[tokens[t + 1]]
        out_am[t] = int(np.argmax(s))
        out_kl[t] = float((np.exp(lb[t]) * (lb[t] - lq)).sum())
    return out_lp, out_am, out_kl


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_simulation_equals_the_logits_processor(seed):
    rng = np.random.default_rng(seed)
    T = 60
    tokens = _tokens(rng, T)
    z = rng.standard_normal((T, V)) * 3
    z[np.arange(T), tokens[1:]] += 2.0  # targets likely, so penalised targets carry real mass
    tg = tokens[1:]
    finals = SPEC.finals
    st = _stats(z, tg, finals, k=len(finals) + 2)
    m = penalty_mask(tokens, SPEC)
    sim = simulate(st, tg, m, finals, SPEC.bias)
    lp, am, kl = _reference(z, tokens, SPEC)
    np.testing.assert_allclose(sim.logp_target, lp, atol=1e-9)
    np.testing.assert_array_equal(sim.argmax, am)
    np.testing.assert_allclose(sim.kld_vs_base, kl, atol=1e-9)
    assert sim.argmax_exact
    # it fires exactly at the prefix matches and nowhere else
    assert set(np.flatnonzero(m.any(1)).tolist()) == {6, 15, 35}
    off = ~m.any(1)
    assert np.array_equal(sim.logp_target[off], st.logp_target[off]) and np.all(sim.kld_vs_base[off] == 0)
    assert np.all(sim.logp_target[[6, 15, 35]] < st.logp_target[[6, 15, 35]] - 1.0)


def test_stacked_on_an_edited_model():
    rng = np.random.default_rng(5)
    T = 50
    tokens = _tokens(rng, T)
    zb = rng.standard_normal((T, V)) * 3
    zn = zb + rng.standard_normal((T, V)) * 0.5  # the "bundle"
    tg = tokens[1:]
    finals = SPEC.finals
    sb, sn = _stats(zb, tg, finals, 5), _stats(zn, tg, finals, 5)
    lb, ln = log_softmax(zb, axis=1), log_softmax(zn, axis=1)
    kl_bn = (np.exp(lb) * (lb - ln)).sum(1)
    m = penalty_mask(tokens, SPEC)
    sim = simulate(sn, tg, m, finals, SPEC.bias, base=sb, kld_base_stats=kl_bn)
    lp, am, kl = _reference(zn, tokens, SPEC, base_z=zb)
    np.testing.assert_allclose(sim.logp_target, lp, atol=1e-9)
    np.testing.assert_allclose(sim.kld_vs_base, kl, atol=1e-9)
    np.testing.assert_array_equal(sim.argmax, am)


def test_cheap_forms_extra_hits():
    tokens = np.array([1, 3, 8, 7, 2, 7, 8, 7, 4, 11, 12, 5])
    # exact: only row 6 (prefix 7 8 -> 7) and row 9 (11 -> 12)
    assert set(np.flatnonzero(penalty_mask(tokens, SPEC).any(1)).tolist()) == {6, 9}
    h, m = extra_hits(tokens, SPEC, FORM_LAST)
    assert h.positions == 1 and h.examples == ((2, 7),)  # "3 8" -> 7: previous token is the last prefix token
    assert h.target_hit == 1  # and the actual next token there is 7: a legitimate use suppressed
    h2, m2 = extra_hits(tokens, SPEC, FORM_SEED)
    # seed's shortcut: previous token ∈ {7, 8, 11, 20} -> every final token
    rows = {t for t in range(len(tokens) - 1) if tokens[t] in (7, 8, 11, 20)}
    assert set(np.flatnonzero(m2.any(1)).tolist()) == rows
    assert h2.pairs == int(m2.sum() - (penalty_mask(tokens, SPEC) & m2).sum())
    assert penalized_at([5, 20], SPEC, FORM_SEED) == SPEC.finals


def test_penalized_at_matches_only_full_prefixes():
    assert penalized_at([1, 7, 8], SPEC) == (7,)
    assert penalized_at([8], SPEC) == ()  # a multi-token prefix is never matched by its last token alone
    assert penalized_at([7, 8, 11], SPEC) == (12,)
    assert penalized_at([], SPEC) == ()


def test_json_round_trip_and_bad_specs(tmp_path):
    class PT:
        def __init__(self, phrase, tuples):
            self.phrase, self.tuples = phrase, tuples

    spec = make_spec([PT("end to end", [(7, 8, 7)]), PT("rather than", [(11, 12), (9, 11, 12)])], bias=5.0,
                     model_sha256="ab" * 32, vocab="toy")
    p = tmp_path / "penalty.json"
    p.write_text(spec.to_json(decode=lambda ids: " ".join(map(str, ids))))
    back = read_spec(p)
    assert back == spec and back.form == FORM_EXACT and len(back.rules) == 3
    d = __import__("json").loads(p.read_text())
    assert d["rules"][0]["prefix_text"] == "7 8" and "semantics" in d
    with pytest.raises(L47Error, match="bias"):
        make_spec([], bias=0.0)
    with pytest.raises(L47Error, match="form"):
        make_spec([], form="nearby")
    p.write_text('{"schema": "other"}')
    with pytest.raises(L47Error, match="schema"):
        read_spec(p)
