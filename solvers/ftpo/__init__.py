"""FTPO trainer on the exact tail forward (torch; CPU / CUDA / MPS): solve to a target within a KL budget.

Objective minimised over ΔW [n, f] by Adam with a floor (ℓ = log p, z = logits, Δ = edited − base, r the rejected final
token of event e, p⁰ base probabilities; every term is dimensionless, scaled by a quantity of the data or a bar):

    L(ΔW) =  mean_phrase mean_{e ∈ phrase} π_e · τ·softplus((Δo_e + d_e) / τ)               target hinge (nats)
           + λ · mean_{b ∈ background} KL(p⁰_b ‖ p_b) / budget                              exact, full vocabulary
           + λ_shape · mean_{e ∈ events} KL(q⁰_e ‖ q_e) / budget                             the freed mass's shape
           + λ_cond · mean_{m ∈ near misses} KL(q⁰_m ‖ q_m) / budget                         only r's mass moves
           + λ_coll · mean_group mean_{a ∈ group} (min(Δℓ_a, 0) / tol_group)²                soft anchors
                     [+ (Δo_a / end_odds_tol)² at the real and plausible turn ends]               their lead
                     [+ one group: Σ_r n_r (min(mean_{runner-up r} Δ(z_end − z_r), 0) / end_lead_tol)² / Σ_r n_r]
           + λ_special · mean_e max(Δ log Σ_s p_s, 0)                                      no special-token rise
           + λ_special · mean_{b ∈ background} max(Δ log Σ_s p_s, 0)                         ... anywhere
           + λ_flip · Σ_{t ∈ near ties} (max(−Δ(z_t1 − z_t2), 0) / max(z⁰_t1 − z⁰_t2, 0.05))²   no flip (bar (f))
           + λ_ridge · ‖ΔW‖² / ‖W‖²
  o_e = z_r − log Σ_{v ∈ S_e} exp z_v, the log-odds of r against S_e (the base top-K without r and the special
  tokens): it never saturates (∂o/∂z_r = 1 where ∂ℓ_r/∂z_r = 1 − p_r ≈ 0 at a near-certain token), and as
  S_e ⊂ V∖{r} it bounds the exact log-odds from above, so its drop tracks theirs while the tether below keeps
  the shares inside V∖{r}. d_e = logit(p⁰_e) − logit(aim·t·p⁰_e) ≥ 0 is the log-odds drop the aim needs (f64).
  t = target_residual, aim < 1 (train events aim beyond the target: held-out events follow train only in part);
  π_e ∈ {0, 1} (`pulling`, set at each evaluation): 1 while e's phrase is short of t or e's own p/p⁰ is above t;
  budget = the solve's mean background KL budget; q = p restricted to the base top-K at the row without the
  banned token(s) and the special tokens, renormalised (at a near miss the natural continuation keeps its share,
  at an event the freed mass spreads as the base spreads it); groups are the collateral words, tol_word = |bar
  (d)'s word mean|, the real turn ends and (one more group) the background rows where the turn may end (base
  p(<|im_end|>) ≥ plausible_end_p), tol = |bar (f)'s mean Δlog p(<|im_end|>)|; o_a there is the log-odds of
  <|im_end|> against the rest of the row's base top-(K+1) (_EndOdds: Δℓ ≈ (1 − p)·Δo misses a lost lead at
  p ≈ 1); the special guard is in nats like the hinge (the special tokens must lose about as many nats as r
  does, or they take their share of its mass: docs/SOLVERS.md), λ_special doubles while the judged mean
  Σ p(special) at the train or dev events rises past bar (f)'s special_rise_tol, as λ_coll does while a word's
  or the turn ends' mean Δlog p over the solver's anchors is past its tolerance.
  Near ties are the background rows and real turn ends whose base top two tokens t1, t2 are one special token and
  one word within flip_margin nats: where bar (f) counts flips (to or away from a special token).
  The "margin" objective (expert option) replaces the target hinge by the seed's preference term
  τ·softplus((Δ(ℓ_r − ℓ_c) + margin·scale_e)/τ) against chosen natural alternatives c.

The step is Adam's with ε = floor × RMS over the matrix of √v̂, its update u = m̂/(√v̂ + ε) divided by max(1, RMS(u))
(Adafactor's update clipping, d = 1): when λ or the guard doubles, the gradient's scale jumps while v̂ (β₂ = 0.999)
lags, and plain Adam's steps grew ~30× — measured on the demo: the exact KL went 0.001 → 0.067 in 60 steps right
after the near-tie guard had doubled five times. Scale-free like Adam where the gradient is large,
gradient descent where it is far below the matrix's RMS (plain Adam moves an entry whose gradient is noise by a
full step, in directions of hh unseen contexts use: on the second model its KLD on JSON documents was 25× the
background KL; one second moment for the whole matrix kept ΔW in the gradient's span but was too slow).
Each step uses a rotating subset of the background (`background_batch` positions); every `eval_every` steps the
candidate ΔW is re-quantised (when a `shipped` map is given, as it ships) and measured EXACTLY: mean KL over the
whole background, train and dev residual per phrase. λ doubles whenever the exact KL exceeds the budget (it is
never lowered: a budget far from binding is no licence to spend it; the KLD domains and the held-out chat are
not in the background, and on the second model they moved 100–300× more than it). When `recover_after`
evaluations in a row are over the budget, λ has not brought the KL back: the step is too long for the valley the
edit is in, so the parameter returns to the kept candidate with fresh Adam moments and half the step (λ as it
stands; the record's history holds each restart). Without it one model2 seed of 13 left the budget at step ~240,
λ climbed to 1e6 and the edit collapsed; its kept candidate failed bar (d) (docs/BENCHMARKS.md, "Recovering from
a KL blow-up"). Kept:
the candidate within the budget with the most removal (mean over phrases of log max(residual, t), the residual
as `at_target_residuals` reads it: the larger of dev and train, the rule that stops the solve and that the record's convergence
reports — a key on dev alone kept candidates whose train residual was still above t after a "converged" stop); among
those reaching t on every phrase, the least KL. Stops when every phrase's dev and train residuals reach t
within the budget (converged), at the step cap, or at the time budget. Precision: f32 forward/backward, f64
vocabulary reductions (l47.tail.stream), f64 means of the measured figures.
"""

from __future__ import annotations

from l47.data.uncertainty import ratio_upper
from l47.solvers.ftpo.basis import (SCALE_CAP, GapBasis, background_scales, gap_basis, gap_jacobians, key_basis,
                                    off_span, project_out, turn_end_basis)
from l47.solvers.ftpo.config import OBJECTIVES, FtpoConfig, FtpoProblem
from l47.solvers.ftpo.judge import (BIND_DEV_KL, BIND_END_DLOGP, BIND_ENDS, BIND_FLIPS, BIND_KL, BIND_SPECIAL,
                                    BIND_WORDS, BIND_WORDS_BELOW, _Judge, _TurnEnds,
                                    at_target_residuals, candidate_key, next_multiplier, pulling, removal_score)
from l47.solvers.ftpo.objective import (_EndLeads, _EndOdds, _NearTies, _Objective, _Rotation, _Tether,
                                        conditional_kl, log_odds, needed_drop, per_group_mean, soft_anchor,
                                        special_word_pairs, target_hinge)
from l47.solvers.ftpo.trainer import (STOP_TARGET, FtpoResult, _Adam, phrase_groups, phrase_stops, residual_trend,
                                      step_parts, train_ftpo)

__all__ = ["BIND_DEV_KL", "BIND_END_DLOGP", "BIND_ENDS", "BIND_SPECIAL", "BIND_WORDS", "BIND_WORDS_BELOW", "BIND_FLIPS", "BIND_KL", "STOP_TARGET", "next_multiplier", "phrase_stops",
           "residual_trend", "step_parts", "phrase_groups", "OBJECTIVES", "SCALE_CAP", "FtpoConfig", "FtpoProblem", "FtpoResult", "GapBasis", "at_target_residuals",
           "background_scales", "candidate_key", "conditional_kl", "gap_basis", "gap_jacobians", "key_basis",
           "log_odds", "needed_drop", "off_span", "per_group_mean", "project_out", "pulling", "ratio_upper",
           "removal_score", "soft_anchor", "special_word_pairs", "target_hinge", "train_ftpo", "turn_end_basis",
           "_Adam", "_EndLeads", "_EndOdds", "_Judge", "_NearTies", "_Objective", "_Rotation", "_Tether",
           "_TurnEnds"]
