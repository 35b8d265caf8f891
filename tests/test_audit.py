"""`l47 audit` on a tiny synthetic model: hand-built bundles that fail for the seed's reasons, a hand-built bundle
that passes, the blind sign-off with its ledger, and bad input.

The world (built once per module):
  * the synthetic qwen4exp GGUF (l47.testing.synth, n 256, f 64, V 1024, 3 layers) with the conftest's tiny byte-level
    BPE vocabulary (special tokens <|endoftext|> 0 … </think> 4);
  * chat / plain documents rendered with the ChatML template; their dump states are synthetic arrays whose
    routed-expert output `yr` is moved along each target's head row (bisection, exact tail forward) until the
    BASE model gives every target the probability we choose: ordinary targets 0.55, slop events 0.6, real turn
    ends 0.6, one planted non-event 0.002 — computed, not hard-coded; hh carries a "slop key" (column J_KEY =
    C_KEY at every prefix-exact position, 0 elsewhere) and a constant feature (column J_BIAS = C_BIAS everywhere);
  * bundles from ΔW designs computed through the exact forward and re-quantised to Q8_0 (l47.model.quants):
      good        ΔW = u·e_KEYᵀ, u by Adam on TRAIN events only: lowers the final tokens and the special tokens;
      collateral  ΔW = −α·ĥ(" than")·e_BIASᵀ: " than" down ≥ 1.5 nats in every context (seed §5.3's mined loss);
      im_end      good + α·ĥ(<|im_end|>)·e_BIASᵀ until ≥ 3 ordinary argmaxes flip to it (seed §6.1's v3.1);
      second      good + one byte of another tensor changed;  noop: the base's bytes.
Every scenario asserts the bar that must fail, from the audit's own report.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from l47.model import names
from l47.errors import L47Error

DIMS_KW = dict(n=256, f=64, r=32, hc=4, V=1024, n_layers=3)
J_KEY, J_BIAS = 5, 40  # hh columns: the slop key, the constant feature
C_KEY, C_BIAS = 3.0, 2.0
P_ORD, P_EVENT, P_NONEVENT, P_END = 0.55, 0.6, 0.002, 0.6
PHRASES = ("rather than", "end to end", "right away")
WRITTEN = "written"

M = lambda r, c: {"role": r, "content": c}  # noqa: E731
DOCS = {
    # name: (set, chat messages | plain text)
    "train_a": ("train", [
        M("user", "How should we check the new build before the release?"),
        M("assistant", "<think>\nThe user wants a plan. Measure first, then report.\n</think>\n\n"
                       "Run the suite end to end on a clean machine. Use the measured numbers rather than a guess. "
                       "If a test fails, tell me right away and keep the log."),
        M("user", "And the slow tests?"),
        M("assistant", "Time them rather than skip them. We ran the batch end to end twice.")]),
    "train_b": ("train", [
        M("user", "Can you compare the two reports for me?"),
        M("assistant", "I read both files rather than the summary, and it took more than an hour. "
                       "The second report is shorter. Send the fixes right away so the team can review them. "
                       "Then check the pipeline end to end with fresh data.")]),
    "dev_a": ("dev", [
        M("user", "Is the model ready?"),
        M("assistant", "Almost. We tested it end to end yesterday, and we fixed the parser right away.")]),
    "heldout_a": ("heldout", [
        M("user", "What did the audit find?"),
        M("assistant", "The audit checked every tensor rather than a sample. It traced the head end to end "
                       "and flagged one file right away.")]),
    "heldout_b": ("heldout", [
        M("user", "Please fix the loader."),
        M("assistant", "I will patch the reader rather than the writer, then rerun the loader end to end. "
                       "Expect a note right away.")]),
    "coll_a": ("collateral_eval",
               "The river is more than a mile wide. At the end of the valley the road turns far away from the sea. "
               "She paid more than he did, and the end of the story came soon. The hills were far away, "
               "and the town lay at the end of a long road. It costs more than a car."),
    "chat_ho": ("chat_heldout", [
        M("user", "Why did the test stop early?"),
        M("assistant", "<think>\nCheck the log first.\n</think>\n\nThe runner hit a timeout. "
                       "I raised the limit rather than remove the test, and it now runs end to end."),
        M("user", "Good. What next?"),
        M("assistant", "Next we profile the slow step and write the numbers down.")]),
    "ops": ("kld.ops", "Tools return JSON like a list of results which the assistant reads. "
                       "Numbers appear in tables and reports; dates appear too."),
    "anchor_a": ("collateral_anchor",
                 "It was more than enough. The end of the road was far away. We walked more than ten miles to the "
                 "end of the trail, and the lake was far away from the camp. He knew more than most."),
    "bg_b": ("background", "The quick brown fox jumps over the lazy dog. A model reads text and predicts the next "
                           "token. Far away, the mountains were covered in snow; the river ran to the sea."),
    "bg_a": ("background", [
        M("user", "Tell me about bread."),
        M("assistant", "<think>\nA short answer.\n</think>\n\nMix flour, water, salt and yeast, knead, "
                       "let it rise, then bake it in a hot oven.")]),
    "blind_a": ("blind", [
        M("user", "Can you review the patch?"),
        M("assistant", "<think>\nRead the diff, then answer.\n</think>\n\nI read the whole diff rather than the "
                       "title. The tests pass end to end, and I sent two notes right away."),
        M("user", "Thanks, merge it."),
        M("assistant", "Merged. The build is green.")]),
}
NON_EVENT = ("train_b", "right away")  # the planted non-event: this phrase's event in this document gets p 0.002


# ----------------------------------------------------------------------------------------------------------
# the world


def _render(vocab, spec):
    from l47.dumps.chat import render_chat, render_plain

    if isinstance(spec, str):
        ids, role = render_plain(spec, vocab, "assistant")
    else:
        ids, role = render_chat(spec, vocab)
    return np.asarray(ids, dtype=np.int64), np.asarray(role, dtype=np.uint8)


def _fit_yr(w, arrs: list[dict], goals: list[np.ndarray], iters=24, tol=1e-3) -> None:
    """Set each document's yr [T, n] so that the base log p(target) = goal at every row: yr_t + α_t·ĥ_t with ĥ_t
    the unit head row of row t's target, α_t by bisection on [−64, 256] (log p(target) rises with α along its
    own head row). All documents' rows at once, exact forward, no gradients. Asserts |error| < tol nats."""
    from l47.tail.forward import full_logits, tail_mix

    cat = lambda k: torch.from_numpy(np.concatenate([a[k] for a in arrs]))  # noqa: E731
    R, inj, hh, sgv, yr = cat("R"), cat("inj"), cat("hh"), cat("sgv"), cat("yr")  # [ΣT, ...]
    tg = torch.from_numpy(np.concatenate([a["tokens"][1:] for a in arrs]).astype(np.int64))  # [ΣT]
    goal = torch.from_numpy(np.concatenate(goals)).float()  # [ΣT]
    h = w.head[tg] / w.head[tg].norm(dim=1, keepdim=True)  # [ΣT, n]

    def logp(a):  # [ΣT]
        z = full_logits(tail_mix(R, inj, hh, sgv, yr + a[:, None] * h, w), w)  # [ΣT, V]
        return torch.log_softmax(z, -1).gather(1, tg[:, None])[:, 0]

    lo, hi = torch.full_like(goal, -64.0), torch.full_like(goal, 256.0)
    with torch.no_grad():
        for _ in range(iters):
            mid = (lo + hi) / 2
            up = logp(mid) < goal
            lo, hi = torch.where(up, mid, lo), torch.where(up, hi, mid)
        a = (lo + hi) / 2
        err = float((logp(a) - goal).abs().max())
    assert err < tol, f"yr fit: max |log p − goal| = {err}"
    fitted = (yr + a[:, None] * h).numpy().astype(np.float32)
    r0 = 0
    for arr in arrs:
        T = arr["yr"].shape[0]
        arr["yr"] = fitted[r0:r0 + T]
        r0 += T


def _dump_arrays(vocab, pts, name, spec, seed):
    """Rendered tokens/roles, synthetic states with the slop key and the constant feature, and the goals."""
    from l47.dumps.select import chat_structure, find_events
    from l47.testing.synth import SynthDims, synth_dump_arrays

    tokens, role = _render(vocab, spec)
    T = tokens.shape[0] - 1
    arr = synth_dump_arrays(SynthDims(**DIMS_KW), T, seed)
    arr["tokens"] = tokens.astype(np.int32)
    arr["role"] = role
    hh = arr["hh"]
    hh[:, J_KEY] = 0.0
    hh[:, J_BIAS] = C_BIAS
    goal = np.full(T, math.log(P_ORD))
    for e in find_events(tokens, pts, role):
        hh[e.pos, J_KEY] = C_KEY
        goal[e.pos] = math.log(P_NONEVENT if (name, e.phrase) == NON_EVENT else P_EVENT)
    goal[chat_structure(tokens, role, vocab.special_ids).terminal] = math.log(P_END)
    return arr, goal


BLIND_SAMPLER = {"temperature": 0.7, "top_p": 0.9, "top_k": 40}  # what the blind chats claim they were drawn with


def _write_world_dump(path, w, name, spec, arr, generated: bool | None = None):
    """Write a verified dump: ref_logp / top-k / ref_logits are the exact forward's (the 'engine' is exact).
    `generated` (default: the blind set's documents): the assistant / think turns claim to be the model's own
    generation under BLIND_SAMPLER."""
    from l47.dumps import DumpMeta, read_dump, write_dump
    from l47.tail.forward import full_logits, mix_of_dump, score_dump

    prov = {r: WRITTEN for r in {names.ROLES[int(c)] for c in np.unique(arr["role"])}}
    if DOCS.get(name, ("",))[0] == "blind" if generated is None else generated:  # (DESIGN §4)
        prov.update({r: "generated" for r in ("assistant", "think") if r in prov})
        prov["generation"] = {"model": w.model_sha256, "prompt": "held back", "seed": 1, "sampler": BLIND_SAMPLER}
    meta = DumpMeta(schema_version=1, doc_id=name, layer=w.layer, n=w.n, f=w.f, hc=w.hc, r=w.r, V=w.V,
                    model=w.model_sha256, engine={"name": "synthetic", "version": "0", "settings": {}},
                    inj_convention="raw", hh_precision="f32", provenance=prov,
                    text=spec if isinstance(spec, str) else json.dumps(spec))
    tmp = write_dump(path.with_suffix(".tmp.safetensors"), arr, meta)
    d = read_dump(tmp)
    st = score_dump(w, d)
    with torch.no_grad():
        arr["ref_logits"] = full_logits(mix_of_dump(d, w), w).numpy().astype(np.float16)  # [T, V]
    tmp.unlink()
    arr["ref_logp"] = st.logp_target.astype(np.float32)
    arr["ref_top_ids"] = st.top_ids.astype(np.int32)
    arr["ref_top_logits"] = (st.top_logp + st.lse[:, None]).astype(np.float32)
    return write_dump(path, arr, meta)


def _batch(w, dumps, rows_of):
    """Stacked dump rows for the ΔW designs: dict of tensors + targets."""
    parts = {k: [] for k in ("R", "inj", "hh", "sgv", "yr", "tg")}
    for d in dumps:
        rows = rows_of(d)
        if not len(rows):
            continue
        for k in ("R", "inj", "hh", "sgv", "yr"):
            parts[k].append(torch.from_numpy(np.ascontiguousarray(getattr(d, k)[rows])))
        parts["tg"].append(torch.from_numpy(np.asarray(d.tokens[1:], dtype=np.int64)[rows]))
    return {k: torch.cat(v) for k, v in parts.items()}


def _logp(w, b, dW):
    from l47.tail.forward import full_logits, tail_mix

    z = full_logits(tail_mix(b["R"], b["inj"], b["hh"], b["sgv"], b["yr"], w, dW=dW), w)
    return torch.log_softmax(z, -1)  # [P, V]


def _design(w, b, col, objective, steps=150, lr=0.05, ridge=1e-3):
    """ΔW = v·e_colᵀ with v optimised (Adam) through the exact forward to minimise objective(log p [P, V])."""
    v = torch.zeros(w.n, requires_grad=True)
    e = torch.zeros(w.f)
    e[col] = 1.0
    opt = torch.optim.Adam([v], lr=lr)
    for _ in range(steps):
        loss = objective(_logp(w, b, v[:, None] * e[None, :])) + ridge * (v * v).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return (v.detach()[:, None] * e[None, :])  # [n, f]


def _along_head_row(w, b, col, token, sign, done, base_dW=None):
    """ΔW = sign·α·ĥ·e_colᵀ, ĥ the unit head row of `token` (moves that token's logit in every context that
    carries feature `col`), with α doubled until done(log p [P, V]) holds (exact forward, no gradients)."""
    h = w.head[token] / w.head[token].norm()
    e = torch.zeros(w.f)
    e[col] = 1.0
    alpha = 0.25
    with torch.no_grad():
        for _ in range(16):
            dW = sign * alpha * h[:, None] * e[None, :] + (0 if base_dW is None else base_dW)
            if done(_logp(w, b, dW)):
                return dW
            alpha *= 2
    raise AssertionError("design did not reach its goal")


def _write_bundle(base, out, w, dW, extra=None, prov=None):
    """Re-quantise W_sd + ΔW to Q8_0 (ggml rule, l47.model.quants) and write base-with-target-replaced + provenance."""
    from l47.model import quants
    from l47.model.gguf_io import copy_with_tensor_replaced

    raw = quants.quantize(w.W_sd + dW, int(__import__("gguf").GGMLQuantizationType.Q8_0), w.target).numpy()
    repl = {w.target: raw, **(extra or {})}
    kv = {names.PROVENANCE_PREFIX + "target": w.target, names.PROVENANCE_PREFIX + "method": "hand",
          names.PROVENANCE_PREFIX + "base_sha256": w.model_sha256, **(prov or {})}
    return copy_with_tensor_replaced(base, out, repl, extra_kv=kv)


def _write_record(bundle, w, sets_rep, extra_touched=(), claims_override=None):
    """A SolveRecord for a hand-made bundle: slop terms at the accepted train events, claims re-derived here."""
    from l47.data import record as rec
    from l47.model.gguf_io import open_gguf
    from l47.model.weights import edited_weight
    from l47.tail.forward import score_pair
    from l47.dumps import read_dump

    W_new, bsha = edited_weight(w, bundle)
    train = [e for e in sets_rep.events if e.set == "train"]
    pb, pa = [], []
    docs = {d.sha256: d for d in sets_rep.docs}
    cache = {}
    for e in train:
        if e.doc_sha256 not in cache:
            cache[e.doc_sha256] = score_pair(w, read_dump(docs[e.doc_sha256].path), W_new)
        ps = cache[e.doc_sha256]
        pb.append(math.exp(ps.base.logp_target[e.pos]))
        pa.append(math.exp(ps.new.logp_target[e.pos]))
    touched = [rec.Touched(e.doc_sha256, e.pos, e.final, rec.TERM_SLOP, e.phrase, e.p_base) for e in train]
    touched += list(extra_touched)
    claims = rec.SolveClaims(
        dW_rel_norm=float((W_new.double() - w.W_sd.double()).norm() / w.W_sd.double().norm()),
        train_p_rejected=rec.PRejected(before=float(np.mean(pb)), after=float(np.mean(pa)), n=len(train)))
    claims = replace(claims, **(claims_override or {}))
    inputs = [rec.InputFile(d.path, d.sha256, d.set) for d in sets_rep.docs if d.set in ("train", "dev", "background")]
    r = rec.SolveRecord(method="hand", toolkit_version="test", seed=0, base_sha256=w.model_sha256, bundle_sha256=bsha,
                        target=w.target, config={}, inputs=inputs, touched=touched, claims=claims,
                        experiment_content=sets_rep.content, experiment_content_sha256=sets_rep.content_sha256)
    rec.record_path_for(bundle).write_text(r.to_json())
    return r


def _experiment_toml(root: Path, paths: dict[str, Path], extra_sets: dict | None = None,
                     name: str = "experiment.toml", drop: tuple[str, ...] = ()) -> Path:
    sets: dict[str, list[str]] = {}
    for doc, (s, _) in DOCS.items():
        if doc not in drop:
            sets.setdefault(s, []).append(paths[doc].name)
    for s, v in (extra_sets or {}).items():
        sets.setdefault(s, []).extend(v)
    lines = ['name = "audit-test"', 'model = "base.gguf"', 'vocab = "gguf"', 'policy = "strata"', "", "[sets]"]
    lines += [f"{s} = {json.dumps(v)}" for s, v in sets.items() if not s.startswith("kld.")]
    lines += ["", "[sets.kld]"] + [f"{s[4:]} = {json.dumps(v)}" for s, v in sets.items() if s.startswith("kld.")]
    for p in PHRASES:
        lines += ["", "[[phrases]]", f'text = "{p}"']
    lines += ["", "[thresholds]", "min_heldout_per_phrase = 1", "min_train_per_phrase = 1", "collateral_min_total = 5",
              "collateral_min_per_word = 1"]
    path = root / name
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_tokenizer_kv):
    from l47.dumps import read_dump
    from l47.dumps.select import phrases_to_tuples
    from l47.engine.gguf_export import _TOKENIZER_TYPES
    from l47.data.experiment import load_experiment
    from l47.model.gguf_io import copy_with_tensor_replaced, open_gguf
    from l47.data.sets import build_sets
    from l47.testing.synth import SynthDims, write_synth_gguf
    from l47.model.vocab import vocab_from_gguf
    from l47.model.weights import load_tail_weights

    root = tmp_path_factory.mktemp("audit_world")
    raw = write_synth_gguf(root / "raw.gguf", SynthDims(**DIMS_KW), seed=7, unknown_type_tensor=True)
    base = copy_with_tensor_replaced(raw, root / "base.gguf", {}, extra_kv=tiny_tokenizer_kv,
                                     extra_kv_types=_TOKENIZER_TYPES)
    w = load_tail_weights(base, policy="strata")
    vocab = vocab_from_gguf(open_gguf(base))
    pts, _ = phrases_to_tuples(PHRASES, vocab)
    built = {name: _dump_arrays(vocab, pts, name, spec, seed=100 + i)
             for i, (name, (_, spec)) in enumerate(DOCS.items())}
    _fit_yr(w, [a for a, _ in built.values()], [g for _, g in built.values()])
    paths = {name: _write_world_dump(root / f"{name}.safetensors", w, name, DOCS[name][1], built[name][0])
             for name in DOCS}
    exp_path = _experiment_toml(root, paths)
    exp = load_experiment(exp_path)
    sets_rep = build_sets(replace(exp, sets={k: v for k, v in exp.sets.items() if k != "blind"}), w, vocab=vocab)
    assert not [d for d in sets_rep.docs if d.refused], [d.reasons for d in sets_rep.docs if d.refused]
    dumps = {n: read_dump(p) for n, p in paths.items()}

    # --- ΔW designs (optimised on TRAIN documents only)
    train = [dumps[n] for n, (s, _) in DOCS.items() if s == "train"]
    ev_rows = lambda d: [e.pos for e in sets_rep.events if e.set == "train" and e.doc_sha256 == d.sha256]  # noqa
    b_ev = _batch(w, train, ev_rows)
    spec_ids = torch.tensor(sorted(vocab.special_ids.values()))
    lp0 = _logp(w, b_ev, None).detach()
    special0 = lp0[:, spec_ids].exp().sum(1)

    def good_obj(lp):  # lower p(rejected) and the special tokens' mass (seed §6.1: never hand it to <|im_end|>)
        rej = lp.gather(1, b_ev["tg"][:, None])[:, 0].exp().mean()
        special = torch.logsumexp(lp[:, spec_ids], 1) - special0.log()
        return rej + 0.2 * special.mean()

    dW_good = _design(w, b_ev, J_KEY, good_obj, steps=150, lr=0.05)
    b_all = _batch(w, train, lambda d: list(range(d.T)))
    than = vocab.id_of(" than")
    with torch.no_grad():
        lp_all = _logp(w, b_all, None)
    # seed §5.3's mined loss: " than" suppressed in every context (≥ 1.5 nats on average)
    dW_coll = _along_head_row(w, b_all, J_BIAS, than, -1.0,
                              lambda lp: float((lp_all[:, than] - lp[:, than]).mean()) > 1.5)
    # seed §6.1's v3.1: the freed mass goes to <|im_end|>: argmax flips to it at ≥ 3 ordinary positions
    im_end = vocab.special_ids[names.IM_END]
    ordinary = ~torch.isin(b_all["tg"], torch.tensor(sorted(vocab.special_ids.values())))
    dW_end = _along_head_row(w, b_all, J_BIAS, im_end, 1.0, base_dW=dW_good, done=lambda lp: int(
        ((lp.argmax(1) == im_end) & (lp_all.argmax(1) != im_end) & ordinary).sum()) >= 3)

    bundles = {"good": _write_bundle(base, root / "good.gguf", w, dW_good),
               "collateral": _write_bundle(base, root / "collateral.gguf", w, dW_coll),
               "im_end": _write_bundle(base, root / "im_end.gguf", w, dW_end)}
    g = open_gguf(base)
    other = names.gguf_name(names.FFN_UP_SHEXP, w.layer)
    raw_other = np.array(g.raw(other)).copy()
    raw_other[0, 5] ^= 0x01  # one quant code of one block (not its scale)
    bundles["second"] = _write_bundle(base, root / "second.gguf", w, dW_good, extra={other: raw_other})
    bundles["noop"] = copy_with_tensor_replaced(base, root / "noop.gguf", {}, extra_kv={
        names.PROVENANCE_PREFIX + "target": w.target, names.PROVENANCE_PREFIX + "base_sha256": w.model_sha256})
    for k, b in bundles.items():
        _write_record(b, w, sets_rep)
    return dict(root=root, base=base, w=w, vocab=vocab, pts=pts, paths=paths, exp=exp_path, sets=sets_rep,
                bundles=bundles, dumps=dumps, dW_good=dW_good)


def _audit(world, bundle, out, **kw):
    from l47.evals.audit import AuditArgs, run_audit

    kw.setdefault("plots", False)
    return run_audit(AuditArgs(bundle=bundle, base=world["base"], experiment=world["exp"], out_dir=out, **kw))


def _ledger(world):
    from l47.data.ledger import Ledger

    return Ledger.open(None, world["w"].model_sha256)


def _token_sha(path) -> str:
    """Independent of l47: sha256 of the dump's token ids as little-endian int32 (safetensors reader)."""
    import hashlib

    from safetensors.numpy import load_file

    return hashlib.sha256(load_file(str(path))["tokens"].astype("<i4").tobytes()).hexdigest()


def _bars(res) -> dict:
    return {b.name: b for b in res.bars}


def _failed(res) -> set[str]:
    return {b.name for b in res.bars if not b.passed}


# ----------------------------------------------------------------------------------------------------------
# the world is what it claims to be


def test_world_has_events_non_events_and_natural_ce(world):
    s = world["sets"]
    n = {k: sum(1 for e in s.events if e.set == k) for k in ("train", "dev", "heldout", "chat_heldout")}
    assert n["train"] >= 6 and n["heldout"] >= 4 and n["chat_heldout"] >= 1, n
    assert any(e.phrase == NON_EVENT[1] and e.p_base < 1e-2 for e in s.non_events)  # the planted non-event
    assert all(e.p_base > 0.3 for e in s.events)
    assert all(d.ce < 0.5 * math.log(1024) for d in s.docs)  # natural, not a proxy
    assert sum(1 for c in s.collateral if c.set == "collateral_eval" and c.word == " than") >= 3


# ----------------------------------------------------------------------------------------------------------
# a hand-made bundle that does the right thing passes every bar (the positive control)


def test_good_bundle_passes_every_bar(world, tmp_path):
    res = _audit(world, world["bundles"]["good"], tmp_path / "out", plots=True)
    assert _failed(res) == set(), {b.name: (b.value, b.threshold, b.details) for b in res.bars if not b.passed}
    assert res.exit_code == 0 and res.passed
    b = _bars(res)
    assert b["c.slop"].value >= 0.5 and b["bundle.target_edited"].value > 0
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    assert rep["schema"] == "l47.audit/1" and rep["passed"] is True
    assert rep["inputs"]["bundle"]["sha256"] == res.bundle_sha256
    assert rep["thresholds"]["slop_reduction"] == 0.5 and rep["thresholds"]["kld_max"] == 0.01
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Bars" in md and "rather than" in md and "' than'" in md
    tsv = (tmp_path / "out" / "positions.tsv").read_text().splitlines()
    assert tsv[0].split("\t")[:4] == ["set", "doc", "doc_sha256", "pos"]
    assert len(tsv) - 1 == sum(d["T"] for d in rep["inputs"]["documents"])
    for p in ("slop_per_phrase.png", "collateral_dlogp.png", "kld_per_set.png", "special_mass.png"):
        assert (tmp_path / "out" / "plots" / p).read_bytes()[:4] == b"\x89PNG"
    # the held-out slop figure is re-derivable from the TSV (held-out rows of kind slop that are events)
    ho = rep["slop"]["heldout"]
    assert ho["n"] == sum(1 for e in world["sets"].events if e.set == "heldout")
    # the base model's ledger recorded every scored document (by content) against this bundle
    led = _ledger(world).entries()
    assert {e.bundle_sha256 for e in led} == {res.bundle_sha256} and {e.command for e in led} == {"audit"}
    assert {e.doc_sha256 for e in led} == {d["sha256"] for d in rep["inputs"]["documents"]}
    assert {d["sha256"] for d in rep["inputs"]["documents"]} == {_token_sha(p) for n, p in world["paths"].items()
                                                                 if DOCS[n][0] != "blind"}
    # the world lowers three minimum counts: the report says so on its summary line
    assert rep["stamps"] and rep["stamps"][0].startswith("weakened: min_heldout_per_phrase 1 (default 3)")
    assert "weakened" in md.splitlines()[0]


def test_overlay_bundle_is_compared_tensor_by_tensor(world, tmp_path):
    """The seed's bundles were overlays (a subset of the base's tensors): every tensor present is compared."""
    import gguf

    from l47.model import quants
    from l47.solvers.bundle import write_overlay

    w = world["w"]
    raw = quants.quantize(w.W_sd + world["dW_good"], int(gguf.GGMLQuantizationType.Q8_0), w.target).numpy()
    ov = write_overlay(world["base"], tmp_path / "overlay.gguf", w.target, raw, {"target": w.target})
    _write_record(ov, w, world["sets"])
    res = _audit(world, ov, tmp_path / "out")
    b, bundle = _bars(res), res.report["bundle"]
    assert bundle["form"] == "overlay" and bundle["compared"] >= 1 and bundle["metadata_omitted"]
    assert all(b[n].passed for n in ("bundle.only_target", "bundle.target_edited", "bundle.metadata", "bundle.scope"))
    assert res.passed


# ----------------------------------------------------------------------------------------------------------
# failing bundles, each failing for the seed's reason


def test_second_tensor_modified_fails_bundle_bar(world, tmp_path):
    res = _audit(world, world["bundles"]["second"], tmp_path / "out")
    b = _bars(res)
    assert not b["bundle.only_target"].passed and b["bundle.only_target"].value == 1
    assert "ffn_up_shexp" in b["bundle.only_target"].details["changed"][0]
    assert res.exit_code == 1
    assert b["c.slop"].passed and b["d.word_mean"].passed  # the rest is as good as the good bundle


def test_collateral_killer_fails_per_word_bar(world, tmp_path):
    res = _audit(world, world["bundles"]["collateral"], tmp_path / "out")
    b = _bars(res)["d.word_mean"]
    assert not b.passed and res.exit_code == 1
    per = res.report["collateral"]["per_word"]
    assert min(per, key=lambda k: per[k]["mean_dlogp"]) == " than"
    assert per[" than"]["mean_dlogp"] < -0.05
    assert _bars(res)["bundle.only_target"].passed  # the bundle is well-formed: the damage is the collateral


def test_mass_pushed_to_im_end_fails_bar_f(world, tmp_path):
    res = _audit(world, world["bundles"]["im_end"], tmp_path / "out")
    b = _bars(res)
    assert not b["f.flips"].passed and b["f.flips"].value >= 1
    flips = res.report["chat"]["flips"]["flips"]
    damage = [f for f in flips if f["kind"] == "to-special"]
    assert damage and all(f["new"] == names.IM_END for f in damage)
    assert all(f["role"] in ("assistant", "think", "user") for f in damage)
    assert all(f["context"] for f in damage)  # decoded to text for the report


def test_turn_ends_lost_to_a_word_fail_bar_f_with_their_margins(world, tmp_path):
    """A planted bundle that lifts one word (" than") in every context until a held-out chat's turn end loses
    <|im_end|>'s argmax: f.turn_end_argmax fails, and every lost row's base lead and new deficit equal a full-
    vocabulary re-derivation (f32 logits, log-softmax; tol 1e-4 nats: the audit streams the head in chunks and
    sums in f64, so the two differ only by f32 rounding of logits of magnitude ~10)."""
    from l47.model.weights import edited_weight

    w, vocab = world["w"], world["vocab"]
    im_end, than = vocab.special_ids[names.IM_END], vocab.id_of(" than")
    ho = [world["dumps"][n] for n, (s, _) in DOCS.items() if s == "chat_heldout"]
    b_end = _batch(w, ho, lambda d: np.flatnonzero(np.asarray(d.tokens[1:]) == im_end))  # real turn ends
    with torch.no_grad():
        was = _logp(w, b_end, None).argmax(1) == im_end
    assert int(was.sum()) >= 1
    dW = _along_head_row(w, b_end, J_BIAS, than, 1.0, base_dW=world["dW_good"],
                         done=lambda lp: int((was & (lp.argmax(1) != im_end)).sum()) >= 1)
    bundle = _write_bundle(world["base"], tmp_path / "lost_end.gguf", w, dW)
    _write_record(bundle, w, world["sets"])
    res = _audit(world, bundle, tmp_path / "out")
    b = _bars(res)
    assert not b["f.turn_end_argmax"].passed and b["f.turn_end_argmax"].value >= 1
    dW_q = edited_weight(w, bundle)[0] - w.W_sd  # the bundle's re-quantised ΔW
    by_path = {Path(p).resolve(): world["dumps"][n] for n, p in world["paths"].items() if n in world["dumps"]}
    lost = res.report["chat"]["turn_ends"]["lost_rows"]
    assert len(lost) == b["f.turn_end_argmax"].value
    for r in lost:
        one = _batch(w, [by_path[Path(r["doc"]).resolve()]], lambda d: [r["pos"]])
        with torch.no_grad():
            lp0, lp1 = _logp(w, one, None)[0].double(), _logp(w, one, dW_q)[0].double()
        top0 = torch.topk(lp0, 2).values
        assert int(lp0.argmax()) == im_end and int(lp1.argmax()) == r["new_argmax"] != im_end
        assert r["base_lead"] == pytest.approx(float(top0[0] - top0[1]), abs=1e-4)
        assert r["new_deficit"] == pytest.approx(float(lp1.max() - lp1[im_end]), abs=1e-4) and r["new_deficit"] > 0
    assert "lost turn end" in (tmp_path / "out" / "report.md").read_text()


def test_noop_bundle_fails_slop_bar(world, tmp_path):
    res = _audit(world, world["bundles"]["noop"], tmp_path / "out")
    b = _bars(res)
    assert not b["c.slop"].passed and b["c.slop"].value == pytest.approx(0.0, abs=1e-12)
    assert not b["bundle.target_edited"].passed
    assert b["e.kld.ops"].passed and b["e.kld.ops"].value == 0.0  # nothing moved


def test_record_with_non_prefix_and_non_event_positions_fails_bar_a(world, tmp_path):
    from l47.data import record as rec

    s, vocab = world["sets"], world["vocab"]
    bundle = tmp_path / "good_copy.gguf"
    shutil.copy(world["bundles"]["good"], bundle)
    than = vocab.id_of(" than")
    coll = next(c for c in s.collateral if c.set == "train" and c.token_id == than)  # "more than" in train_b
    ne = next(e for e in s.non_events if e.set == "train")  # the planted non-event (prefix-exact, p 0.002)
    _write_record(bundle, world["w"], s, extra_touched=[
        rec.Touched(coll.doc_sha256, coll.pos, than, rec.TERM_SLOP, "rather than", coll.p_base),
        rec.Touched(ne.doc_sha256, ne.pos, ne.final, rec.TERM_SLOP, ne.phrase, ne.p_base)])
    res = _audit(world, bundle, tmp_path / "out")
    b = _bars(res)
    assert not b["a.prefix_exact"].passed and b["a.prefix_exact"].value == 1
    bad = b["a.prefix_exact"].details["bad"][0]
    assert bad["pos"] == coll.pos and "prefix" in bad["why"] and bad["context"].endswith("more")
    assert not b["a.events"].passed and b["a.events"].value == 1
    assert b["a.events"].details["non_events"][0]["pos"] == ne.pos
    assert b["a.events"].details["non_events"][0]["p_base"] < 1e-2


def test_record_overlapping_a_scored_set_fails_disjointness(world, tmp_path):
    from l47.data import record as rec

    s = world["sets"]
    bundle = tmp_path / "good_copy.gguf"
    shutil.copy(world["bundles"]["good"], bundle)
    ho = next(e for e in s.events if e.set == "heldout")
    _write_record(bundle, world["w"], s, extra_touched=[
        rec.Touched(ho.doc_sha256, ho.pos, ho.final, rec.TERM_SLOP, ho.phrase, ho.p_base)])
    res = _audit(world, bundle, tmp_path / "out")
    b = _bars(res)
    assert not b["c.disjoint"].passed
    assert any(o["doc_sha256"] == ho.doc_sha256 and o["scored_set"] == "heldout"
               for o in b["c.disjoint"].details["overlap"])
    assert not b["b.natural"].passed  # and a held-out document is no training context


def test_claims_that_do_not_reproduce_fail(world, tmp_path):
    bundle = tmp_path / "good_copy.gguf"
    shutil.copy(world["bundles"]["good"], bundle)
    from l47.data.record import PRejected

    n = sum(1 for e in world["sets"].events if e.set == "train")
    _write_record(bundle, world["w"], world["sets"],
                  claims_override={"train_p_rejected": PRejected(before=0.63, after=0.0055, n=n)})
    res = _audit(world, bundle, tmp_path / "out")
    b = _bars(res)["claims"]
    assert not b.passed and "train_p_rejected.after" in b.details["mismatched"]
    assert b.details["compared"]["dW_rel_norm"]["ok"]


def test_engine_level_checks(world, tmp_path):
    """Dumps of an engine that ran the transplanted bundle: its log p must match the tail forward's edited
    prediction (one planted 0.01-nat disagreement must fail), engine-level KLD beside its floor."""
    from l47.dumps import read_dump, write_dump
    from l47.tail.forward import full_logits, mix_of_dump
    from l47.model.weights import edited_weight

    w, good = world["w"], world["bundles"]["good"]
    W_new, bsha = edited_weight(w, good)
    paths = []
    for name, shift in (("ops", 0.0), ("chat_ho", 0.01)):
        d = read_dump(world["paths"][name])
        with torch.no_grad():
            z = full_logits(mix_of_dump(d, w, W_sd=W_new), w)  # [T, V] the edited model's logits
        lp = torch.log_softmax(z.double(), -1)
        arr = {k: np.array(v) for k, v in d.arrays().items()}
        arr["ref_logp"] = (lp.gather(1, torch.from_numpy(d.targets.astype(np.int64))[:, None])[:, 0] + shift
                           ).numpy().astype(np.float32)
        top = torch.topk(z, arr["ref_top_ids"].shape[1], dim=1)
        arr["ref_top_ids"], arr["ref_top_logits"] = top.indices.numpy().astype(np.int32), top.values.numpy()
        arr["ref_logits"] = z.numpy().astype(np.float16)
        paths.append(write_dump(tmp_path / f"{name}.edited.safetensors", arr,
                                replace(d.meta, model=bsha, doc_id=name + "-edited-engine")))
    res = _audit(world, good, tmp_path / "out", engine_dumps=tuple(paths))
    b = _bars(res)
    zp = b["engine.zero_proxy"]
    assert not zp.passed and zp.value == pytest.approx(0.01, rel=1e-3)
    assert zp.details["per_doc"][str(paths[0])]["max_rel"] < 1e-4  # f32 summation order only
    e = b["e.engine_kld.kld.ops"]
    assert e.passed and e.details["floor"] < 1e-4  # f16 engine logits vs the exact forward
    assert e.value == pytest.approx(e.details["tail_kld"], abs=1e-4)
    ch = res.report["engine"]["kld"]["chat_heldout"]  # reported for every set, a bar only on kld.<domain>
    assert ch["kld"] == pytest.approx(ch["tail_kld"], abs=1e-3) and "e.engine_kld.chat_heldout" not in b


# ----------------------------------------------------------------------------------------------------------
# blind sign-off


def test_blind_signoff_once_then_refused(world, tmp_path):
    good = world["bundles"]["good"]
    dev = _audit(world, good, tmp_path / "dev")
    assert dev.passed
    blind_doc = world["paths"]["blind_a"]
    res = _audit(world, good, tmp_path / "blind1", blind=blind_doc, dev_report=tmp_path / "dev" / "report.json")
    b = _bars(res)
    assert res.mode == "blind" and {n for n in b if n.startswith("blind.")} >= {
        "blind.slop_residual", "blind.f.flips", "blind.g.kld", "blind.g.ordinary_dlogp", "blind.bundle_untouched"}
    assert res.passed, {k: (v.value, v.threshold) for k, v in b.items() if not v.passed}
    dev_ratio = dev.report["slop"]["heldout"]["residual_ratio"]
    assert b["blind.slop_residual"].threshold == pytest.approx(1.5 * dev_ratio)
    comp = {c["figure"]: c for c in res.report["blind"]["comparisons"]}
    assert comp["slop residual ratio"]["dev"] == pytest.approx(dev_ratio)
    # the ledger: "started" before the scoring, the verdict with the report
    ev = [(e.event, e.note.split()[0]) for e in _ledger(world).scored(_token_sha(blind_doc))]
    assert ev == [("blind-started", str(tmp_path / "blind1")), ("blind-verdict", "PASS")]
    # scored once: a second blind run (another output folder, the base model's one ledger) is refused
    with pytest.raises(L47Error, match="never scored before"):
        _audit(world, good, tmp_path / "blind2", blind=blind_doc, dev_report=tmp_path / "dev" / "report.json")
    assert not (tmp_path / "blind2" / "report.json").exists()


def _blind_half(world, tmp_path) -> Path:
    """A second blind document: blind_a up to and including its first real turn end after the think block (its
    own tokens, so its own sha256; the same generated provenance)."""
    from safetensors.numpy import load_file

    from l47.model import names

    tok = load_file(str(world["paths"]["blind_a"]))["tokens"]
    sp = world["vocab"].special_ids
    ends = np.flatnonzero(tok[1:] == sp[names.IM_END])  # rows whose target is the turn end
    think = np.flatnonzero(tok == sp[names.END_THINK])
    row = int(ends[ends > think[0]][0])
    return _resave(world, "blind_a", tmp_path / "blind_half.safetensors", rows=slice(0, row + 1))


def test_blind_set_pools_its_documents(world, tmp_path):
    """A blind set of two fresh documents: both checked and burned, the figures pooled over both — the turn-end
    mean is the mean over both documents' turn-end rows of positions.tsv, the events are both documents' —
    and either document is refused afterwards."""
    import csv

    good = world["bundles"]["good"]
    dev = _audit(world, good, tmp_path / "dev")
    a, b = world["paths"]["blind_a"], _blind_half(world, tmp_path)
    assert _token_sha(a) != _token_sha(b)
    res = _audit(world, good, tmp_path / "bset", blind=(a, b), dev_report=tmp_path / "dev" / "report.json")
    bl = res.report["blind"]
    assert bl["n_docs"] == 2 and bl["doc_sha256"] == [_token_sha(a), _token_sha(b)]
    assert [x["sha256"] for x in res.report["inputs"]["blind"]] == [_token_sha(a), _token_sha(b)]
    csv.field_size_limit(1 << 30)
    with open(tmp_path / "bset" / "positions.tsv", newline="") as fh:
        rows = list(csv.DictReader(fh, delimiter="\t", quoting=csv.QUOTE_NONE))
    te = [r for r in rows if r["kind"] == "terminal"]
    assert {r["doc_sha256"] for r in te} == {_token_sha(a), _token_sha(b)}
    assert bl["turn_ends"]["n"] == len(te)
    assert _bars(res)["blind.f.turn_end_dlogp"].value == pytest.approx(np.mean([float(r["dlogp"]) for r in te]),
                                                                       abs=1e-6)
    assert dev.passed
    ev_docs = {e["doc_sha256"] for e in bl["slop"]["events"]}
    assert ev_docs == {_token_sha(a), _token_sha(b)}
    for d in (a, b):
        assert [e.event for e in _ledger(world).scored(_token_sha(d))] == ["blind-started", "blind-verdict"]
        with pytest.raises(L47Error, match="never scored before"):
            _audit(world, good, tmp_path / f"again_{Path(d).stem}", blind=d, dev_report=tmp_path / "dev" / "report.json")


def test_blind_set_holding_a_copy_is_refused(world, tmp_path):
    """A blind set whose second document is a re-saved copy of the first (same tokens) or of a training document:
    refused before anything is scored, naming that file; no report, nothing appended."""
    good = world["bundles"]["good"]
    _audit(world, good, tmp_path / "dev")
    a = world["paths"]["blind_a"]
    twin = _resave(world, "blind_a", tmp_path / "twin.safetensors")
    with pytest.raises(L47Error, match="twin.safetensors.*another of its documents"):
        _audit(world, good, tmp_path / "b1", blind=(a, twin), dev_report=tmp_path / "dev" / "report.json")
    train = _resave(world, "train_a", tmp_path / "train_copy.safetensors")
    with pytest.raises(L47Error, match="train_copy.safetensors"):
        _audit(world, good, tmp_path / "b2", blind=(a, train), dev_report=tmp_path / "dev" / "report.json")
    assert not (tmp_path / "b1" / "report.json").exists() and not (tmp_path / "b2" / "report.json").exists()
    assert not _ledger(world).scored(_token_sha(a))


def test_blind_reused_through_other_named_ledgers_is_refused(world, tmp_path):
    """Each run names its own --ledger (dev A + blind A, then dev B + blind B): the first sign-off also burned the
    document in the base model's default ledger, so the second is refused before anything is scored."""
    good = world["bundles"]["good"]
    blind_doc = world["paths"]["blind_a"]
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    _audit(world, good, tmp_path / "devA", ledger=a)
    ok = _audit(world, good, tmp_path / "blindA", blind=blind_doc, dev_report=tmp_path / "devA" / "report.json",
                ledger=a)
    assert ok.passed and _ledger(world).scored(_token_sha(blind_doc))  # the default ledger has it too
    _audit(world, good, tmp_path / "devB", ledger=b)
    with pytest.raises(L47Error, match="never scored before"):
        _audit(world, good, tmp_path / "blindB", blind=blind_doc, dev_report=tmp_path / "devB" / "report.json",
               ledger=b)
    assert not (tmp_path / "blindB" / "report.json").exists()


def test_blind_document_scored_before_is_refused(world, tmp_path):
    from l47.data.ledger import Ledger

    good = world["bundles"]["good"]
    _audit(world, good, tmp_path / "dev")
    blind_doc = world["paths"]["blind_a"]
    ledger = Ledger.open(tmp_path / "shared.jsonl", world["w"].model_sha256)
    ledger.append([_token_sha(blind_doc)], "b" * 64, "score")
    with pytest.raises(L47Error, match="scored by `score`"):
        _audit(world, good, tmp_path / "blind", blind=blind_doc, dev_report=tmp_path / "dev" / "report.json",
               ledger=ledger.path)
    assert not (tmp_path / "blind" / "report.json").exists()
    assert len(ledger.entries()) == 1  # nothing scored, nothing appended


def test_blind_against_another_bundle_is_refused(world, tmp_path):
    _audit(world, world["bundles"]["good"], tmp_path / "dev")
    with pytest.raises(L47Error, match="sha256"):
        _audit(world, world["bundles"]["im_end"], tmp_path / "blind", blind=world["paths"]["blind_a"],
               dev_report=tmp_path / "dev" / "report.json")
    assert not (tmp_path / "blind" / "report.json").exists()
    # the blind document stays unscored: the ledger does not have it
    assert not _ledger(world).scored(_token_sha(world["paths"]["blind_a"]))


# ----------------------------------------------------------------------------------------------------------
# bad input: clear error, no partial report


def test_bundle_for_another_model(world, tmp_path):
    from l47.testing.synth import SynthDims, write_synth_gguf

    other = write_synth_gguf(tmp_path / "other.gguf", SynthDims(**{**DIMS_KW, "f": 96}), seed=1)
    with pytest.raises(L47Error, match="another model"):
        _audit(world, other, tmp_path / "out")
    assert not (tmp_path / "out" / "report.json").exists()


def test_record_for_another_base_is_refused(world, tmp_path):
    bundle = tmp_path / "good_copy.gguf"
    shutil.copy(world["bundles"]["good"], bundle)
    from l47.data.record import read_record, record_path_for

    r = read_record(record_path_for(world["bundles"]["good"]))
    record_path_for(bundle).write_text(replace(r, base_sha256="0" * 64).to_json())
    with pytest.raises(L47Error, match="another model"):
        _audit(world, bundle, tmp_path / "out")
    assert not (tmp_path / "out" / "report.json").exists()


def test_missing_dump(world, tmp_path):
    exp = world["exp"].read_text().replace('ops = ["ops.safetensors"]', 'ops = ["ops.safetensors", "gone.safetensors"]')
    p = world["root"] / "exp_missing.toml"
    p.write_text(exp)
    from l47.evals.audit import AuditArgs, run_audit

    with pytest.raises(L47Error, match="gone.safetensors"):
        run_audit(AuditArgs(world["bundles"]["good"], world["base"], p, tmp_path / "out"))
    assert not (tmp_path / "out" / "report.json").exists()


def test_corrupt_ledger_line(world, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    head = json.dumps({"schema": "l47.ledger/1", "base_sha256": world["w"].model_sha256})
    (tmp_path / "l.jsonl").write_text(head + "\nnot json\n")
    before = (tmp_path / "l.jsonl").read_bytes()
    with pytest.raises(L47Error, match="line 2"):
        _audit(world, world["bundles"]["good"], out, ledger=tmp_path / "l.jsonl")
    assert not (out / "report.json").exists() and (tmp_path / "l.jsonl").read_bytes() == before


def test_unwritable_out_dir(world, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(L47Error, match="output directory"):
        _audit(world, world["bundles"]["good"], blocker / "out")


# ----------------------------------------------------------------------------------------------------------
# the sampler penalty on the world's held-out documents


def test_penalty_export_and_simulation(world, tmp_path):
    from l47.evals.penalty import PenaltyArgs, read_spec, run_penalty

    res = run_penalty(PenaltyArgs(experiment=world["exp"], out=tmp_path / "penalty.json", base=world["base"],
                                  bundle=world["bundles"]["good"], bias=5.0))
    spec = read_spec(tmp_path / "penalty.json")
    assert spec.bias == 5.0 and len(spec.rules) == res.rules > 0
    assert res.unchanged_max_abs_dlogp == 0.0 and res.unchanged_rows > 0
    for ph, r in res.residual.items():
        assert r["penalty"] < r["base"] and r["stacked"] <= r["bundle"] + 1e-12, ph
    assert res.extra_hits["previous-token"]["positions"] >= res.extra_hits["last-prefix-token"]["positions"] > 0


# ----------------------------------------------------------------------------------------------------------
# the lead's solver (hook): a bundle from `l47 solve` on this tiny world must pass the audit


@pytest.mark.slow
def test_passing_bundle_from_solve(world, tmp_path):
    """The per-phrase slop bar needs every phrase's held-out p(rejected) halved: the solver is asked for an
    absolute margin too (p_cap, as the demo does; the audit's bars are unchanged)."""
    from l47.solvers import solve

    exp = world["root"] / "experiment_solve.toml"
    exp.write_text(world["exp"].read_text() + "\n[solver.wfld]\np_cap = 0.15\nmargin = 3.0\n")
    out = tmp_path / "solved.gguf"
    solve.run_solve(solve.SolveArgs(experiment=exp, method="wfld", out=out, model=world["base"]),
                    log=lambda *a, **k: None)
    res = _audit(world, out, tmp_path / "audit")
    assert res.passed, {b.name: (b.value, b.threshold, b.details.get("why")) for b in res.bars if not b.passed}


# ----------------------------------------------------------------------------------------------------------
# planted failures (issue 13, item 6): each bad input is failed for its own reason


def _resave(world, src: str, dst: Path, *, rows: slice | None = None, drop_ref: bool = False, prov=None):
    """A re-saved copy of a world document: new file name and doc_id (other file bytes), optionally only the
    rows `rows` (a near-copy: shares a long window, not the whole token sequence), without the engine's log p,
    or with another provenance."""
    from dataclasses import replace as dc_replace

    from l47.dumps import read_dump, write_dump

    d = read_dump(world["paths"][src])
    arr = {k: np.array(v) for k, v in d.arrays().items()}
    if rows is not None:
        arr = {k: (v[rows.start:rows.stop + 1] if k == "tokens" else v[rows]) for k, v in arr.items()}
    if drop_ref:
        for k in ("ref_logp", "ref_top_ids", "ref_top_logits", "ref_logits"):
            arr.pop(k, None)
    meta = dc_replace(d.meta, doc_id=f"{src}-copy-{dst.stem}", provenance=prov or d.meta.provenance)
    return write_dump(dst, arr, meta)


def _variant(world, tag: str, extra_sets: dict, drop=()) -> Path:
    return _experiment_toml(world["root"], world["paths"], extra_sets, name=f"exp_{tag}.toml", drop=drop)


def _audit_exp(world, bundle, out, exp, **kw):
    from l47.evals.audit import AuditArgs, run_audit

    kw.setdefault("plots", False)
    return run_audit(AuditArgs(bundle=bundle, base=world["base"], experiment=exp, out_dir=out, **kw))


def test_planted_copy_of_training_document_in_heldout_and_kld(world, tmp_path):
    """A renamed, re-saved copy of a training chat listed as held-out, and another in a KLD set: the same
    document by its tokens, so c.disjoint fails naming the training original (before: accepted, exit 0)."""
    root = world["root"]
    c1 = _resave(world, "train_a", root / "copy_heldout.safetensors")
    c2 = _resave(world, "train_b", root / "copy_kld.safetensors")
    exp = _variant(world, "copies", {"heldout": [c1.name], "kld.ops": [c2.name]})
    res = _audit_exp(world, world["bundles"]["good"], tmp_path / "out", exp)
    b = _bars(res)["c.disjoint"]
    assert not b.passed and res.exit_code == 1
    over = {o.get("path"): o for o in b.details["overlap"]}
    assert over[str(c1)]["with_path"] == str(world["paths"]["train_a"]) and over[str(c1)]["scored_set"] == "heldout"
    assert over[str(c2)]["scored_set"] == "kld.ops" and "exact" in over[str(c2)]["in"]
    assert over[str(c1)]["doc_sha256"] == _token_sha(world["paths"]["train_a"])
    # the rest of the audit is unchanged: the copies were refused, not scored as evidence
    docs = {d["path"]: d for d in res.report["inputs"]["documents"]}
    assert docs[str(c1)]["refused"] and "one set only" in docs[str(c1)]["reasons"][0]


def test_planted_near_copy_shares_a_window(world, tmp_path):
    """A scored document made of 70 consecutive rows of a training document (not the same tokens): it shares
    ≥ 64 content tokens with it, so it overlaps (kind window); with the window raised above its length it
    does not (the rule is the window, not chance)."""
    from l47.dumps import read_dump

    root = world["root"]
    d = read_dump(world["paths"]["train_a"])
    near = _resave(world, "train_a", root / "near_kld.safetensors", rows=slice(3, d.T - 3))
    assert read_dump(near).sha256 != d.sha256
    exp = _variant(world, "near", {"kld.ops": [near.name]})
    res = _audit_exp(world, world["bundles"]["good"], tmp_path / "out", exp)
    b = _bars(res)["c.disjoint"]
    assert not b.passed
    o = next(o for o in b.details["overlap"] if o.get("path") == str(near))
    assert "window" in o["in"] and o["with_path"] == str(world["paths"]["train_a"])
    wide = exp.read_text().replace("collateral_min_per_word = 1", "collateral_min_per_word = 1\noverlap_window = 200")
    exp2 = root / "exp_near_wide.toml"
    exp2.write_text(wide)
    res2 = _audit_exp(world, world["bundles"]["good"], tmp_path / "out2", exp2)
    assert _bars(res2)["c.disjoint"].passed
    assert any("overlap_window 200" in x for x in res2.report["stamps"])  # a raised window is a weakening


def test_planted_blind_copies_are_refused_before_scoring(world, tmp_path):
    """A re-saved copy of a training document as the blind document (before: the sign-off passed), and a
    near-copy: both refused before anything is scored; nothing appended."""
    good = world["bundles"]["good"]
    dev = tmp_path / "dev"
    _audit(world, good, dev)
    gen = {"assistant": "generated", "think": "generated", "user": WRITTEN, "template": WRITTEN, "system": WRITTEN,
           "generation": {"model": world["w"].model_sha256, "prompt": "held back", "seed": 3,
                          "sampler": {"temperature": 0.7, "top_p": 0.9, "top_k": 40}}}
    copy = _resave(world, "train_a", tmp_path / "blind_copy.safetensors", prov=gen)
    T = world["dumps"]["train_a"].T
    near = _resave(world, "train_a", tmp_path / "blind_near.safetensors", rows=slice(2, T - 2), prov=gen)
    n_before = len(_ledger(world).entries())
    for doc, why in ((copy, "scored by `audit`.*dev report: scored in set 'train'"), (near, "near-copy")):
        with pytest.raises(L47Error, match=why):
            _audit(world, good, tmp_path / f"b_{doc.stem}", blind=doc, dev_report=dev / "report.json")
        assert not (tmp_path / f"b_{doc.stem}" / "report.json").exists()
    assert len(_ledger(world).entries()) == n_before
    # a hand-written blind chat (not the model's own generation) is refused too
    written = _resave(world, "blind_a", tmp_path / "blind_written.safetensors",
                      prov={r: WRITTEN for r in ("assistant", "think", "user", "template", "system")})
    with pytest.raises(L47Error, match="provenance"):
        _audit(world, good, tmp_path / "b_written", blind=written, dev_report=dev / "report.json")


def test_planted_blind_reused_through_score_and_after_a_killed_run(world, tmp_path, monkeypatch):
    from l47.app.score import ScoreArgs, run_score
    import l47.evals.audit as audit_mod

    good = world["bundles"]["good"]
    dev = tmp_path / "dev"
    _audit(world, good, dev)
    gen_blind = world["paths"]["blind_a"]
    # (1) `l47 score` on the blind document: it is in the base model's ledger now, the sign-off is refused
    other = _resave(world, "blind_a", tmp_path / "blind_scored.safetensors")
    assert _token_sha(other) == _token_sha(gen_blind)
    run_score(ScoreArgs(world["base"], (other,)))
    with pytest.raises(L47Error, match="scored by `score`"):
        _audit(world, good, tmp_path / "b1", blind=gen_blind, dev_report=dev / "report.json")
    # (2) a killed sign-off (fresh ledger): the document is burned and a stub report says so
    monkeypatch.setenv("L47_HOME", str(tmp_path / "home2"))

    def killed(*a, **k):
        raise KeyboardInterrupt

    _audit(world, good, dev)  # the dev audit again, under the fresh ledger
    monkeypatch.setattr(audit_mod, "score_document", killed)
    with pytest.raises(KeyboardInterrupt):
        _audit(world, good, tmp_path / "b2", blind=gen_blind, dev_report=dev / "report.json")
    stub = json.loads((tmp_path / "b2" / "report.json").read_text())
    assert stub["status"] == "started" and stub["passed"] is False and "burned" in stub["stamps"][0]
    assert "NOT FINISHED" in (tmp_path / "b2" / "report.md").read_text()
    assert [e.event for e in _ledger(world).scored(_token_sha(gen_blind))] == ["blind-started"]
    monkeypatch.undo()
    monkeypatch.setenv("L47_HOME", str(tmp_path / "home2"))
    with pytest.raises(L47Error, match="blind-started"):
        _audit(world, good, tmp_path / "b3", blind=gen_blind, dev_report=dev / "report.json")


def test_planted_one_phrase_left_pooled_would_pass(world, tmp_path):
    """A bundle that suppresses two phrases' final tokens at slop rows and leaves the third: the pooled
    reduction passes the bar, the per-phrase bar fails naming the phrase left."""
    w, vocab, dumps, s = world["w"], world["vocab"], world["dumps"], world["sets"]
    train = [dumps[n] for n, (st, _) in DOCS.items() if st == "train"]
    b_ev = _batch(w, train, lambda d: [e.pos for e in s.events if e.set == "train" and e.doc_sha256 == d.sha256])
    lp0 = _logp(w, b_ev, None).detach()
    dW = None
    for word in (" than", " end"):
        tid = vocab.id_of(word)
        rows = b_ev["tg"] == tid
        dW = _along_head_row(w, b_ev, J_KEY, tid, -1.0, base_dW=dW,
                             done=lambda lp, t=tid, r=rows: float(lp[r, t].exp().mean()) < 0.05 * float(
                                 lp0[r, t].exp().mean()))
    bundle = _write_bundle(world["base"], tmp_path / "two_of_three.gguf", w, dW)
    _write_record(bundle, w, s)
    res = _audit(world, bundle, tmp_path / "out")
    b = _bars(res)["c.slop"]
    assert not b.passed and b.details["worst_phrase"] == "right away" and b.value < 0.5
    assert b.details["pooled"] >= 0.5  # the old pooled bar would have passed this bundle


def test_planted_unnatural_text_in_a_scored_set(world, tmp_path):
    """A document the model finds unnatural (base p 0.01 at every target: CE 4.6 > ½ ln 1024) in a KLD set:
    proxy.base_ce fails, naming it as the worst document, although the pooled CE stays under the bar."""
    from l47.dumps.select import phrases_to_tuples

    w, vocab = world["w"], world["vocab"]
    pts, _ = phrases_to_tuples(PHRASES, vocab)
    spec = "Numbers appear in tables and reports; dates appear too. The quick brown fox jumps over the lazy dog."
    arr, _ = _dump_arrays(vocab, pts, "odd", spec, seed=999)
    goal = np.full(arr["tokens"].shape[0] - 1, math.log(0.01))
    _fit_yr(w, [arr], [goal])
    path = _write_world_dump(world["root"] / "odd.safetensors", w, "odd", spec, arr)
    exp = _variant(world, "odd", {"kld.ops": [path.name]})
    res = _audit_exp(world, world["bundles"]["good"], tmp_path / "out", exp)
    b = _bars(res)["proxy.base_ce"]
    assert not b.passed and b.details["worst_doc"] == str(path)
    assert b.value == pytest.approx(-math.log(0.01), abs=2e-3) and b.threshold == pytest.approx(0.5 * math.log(1024))
    assert b.details["ce_pooled"] < b.threshold


def test_planted_dumps_without_engine_logits(world, tmp_path):
    root = world["root"]
    bare = _resave(world, "ops", root / "ops_unverified.safetensors", drop_ref=True)
    exp = _variant(world, "unverified", {"kld.ops": [bare.name]}, drop=("ops",))
    res = _audit_exp(world, world["bundles"]["good"], tmp_path / "out", exp)
    b = _bars(res)["proxy.zero_proxy"]
    assert not b.passed and b.value is None and str(bare) in b.details["unverified"]
    assert "no engine log p" in b.details["why"]
    ok = _audit_exp(world, world["bundles"]["good"], tmp_path / "out2", exp, allow_unverified=True)
    b2 = _bars(ok)["proxy.zero_proxy"]
    assert b2.passed and b2.applicable and b2.value < 1e-4  # the verified dumps are still judged
    assert any(x.startswith("unverified: 1 dump") for x in ok.report["stamps"])
    assert "unverified" in (tmp_path / "out2" / "report.md").read_text().splitlines()[0]


def _dev_p_rejected(world, bundle):
    """PRejected at the dev events from an exact paired pass here (score_pair), per phrase: what a solver claims
    as the dev figures at its stop."""
    from l47.data import record as rec
    from l47.dumps import read_dump
    from l47.model.weights import edited_weight
    from l47.tail.forward import score_pair

    w, s = world["w"], world["sets"]
    W_new, _ = edited_weight(w, bundle)
    docs = {d.sha256: d for d in s.docs}
    dev = [e for e in s.events if e.set == "dev"]
    got = [(e.phrase, score_pair(w, read_dump(docs[e.doc_sha256].path), W_new), e.pos) for e in dev]
    b = [(ph, math.exp(ps.base.logp_target[t])) for ph, ps, t in got]
    a = [(ph, math.exp(ps.new.logp_target[t])) for ph, ps, t in got]
    per = lambda xs: {ph: float(np.mean([x for q, x in xs if q == ph])) for ph in sorted({q for q, _ in xs})}  # noqa
    return rec.PRejected(before=float(np.mean([x for _, x in b])), after=float(np.mean([x for _, x in a])), n=len(dev),
                         per_phrase_before=per(b), per_phrase_after=per(a))


def test_planted_record_at_iteration_cap(world, tmp_path):
    """A record at its iteration cap fails the claims bar unexplained; a bare "convergence:" note does not
    explain it (no figures); the note with the iterations and the dev residual per phrase at the stop does — and
    the audit reports those figures as it re-derives them."""
    from l47.data import record as rec

    bundle = tmp_path / "good_capped.gguf"
    shutil.copy(world["bundles"]["good"], bundle)
    conv = rec.Convergence(stop_reason=rec.STOP_ITERATION_CAP, max_violation=0.3, violation_tol=0.01, iterations=8)
    r = _write_record(bundle, world["w"], world["sets"], claims_override={"convergence": conv})
    res = _audit(world, bundle, tmp_path / "out")
    b = _bars(res)["claims"]
    assert not b.passed and b.value == 2
    assert any("iteration_cap" in m for m in b.details["mismatched"])
    assert any("max_violation" in m for m in b.details["mismatched"])
    # a bare note ("convergence: ok"): still unexplained, the missing figures named
    rec.record_path_for(bundle).write_text(replace(r, notes=["convergence: ok"]).to_json())
    res1 = _audit(world, bundle, tmp_path / "out1")
    b1 = _bars(res1)["claims"]
    assert not b1.passed and b1.value == 2
    assert b1.details["convergence"]["missing"] == [
        "the dev residual per phrase at the stop (claims.dev_p_rejected per phrase)"]
    assert all("explanation lacks" in m for m in b1.details["convergence"]["unexplained"])
    # the figures without iterations: still unexplained
    dev = _dev_p_rejected(world, bundle)
    no_it = replace(r.claims, dev_p_rejected=dev, convergence=replace(conv, iterations=None))
    rec.record_path_for(bundle).write_text(replace(r, claims=no_it, notes=["convergence: capped"]).to_json())
    assert not _bars(_audit(world, bundle, tmp_path / "out1b"))["claims"].passed
    # the reason with the figures (iterations, dev residual per phrase): reported, not failed
    with_fig = replace(r.claims, dev_p_rejected=dev)
    rec.record_path_for(bundle).write_text(replace(r, claims=with_fig, notes=[
        "convergence: capped on purpose for this test; the held-out bars judge the result"]).to_json())
    res2 = _audit(world, bundle, tmp_path / "out2")
    b2 = _bars(res2)["claims"]
    assert b2.passed and b2.details["convergence"]["explanations"]
    fig = b2.details["convergence"]["figures"]
    assert fig["iterations"] == 8 and fig["reason"].startswith("capped on purpose")
    # the residuals reported are the re-derived dev claims' (rel. 1e-3: the claims bar's own tolerance)
    assert set(fig["dev_residual_per_phrase"]) == set(dev.per_phrase_before) and len(dev.per_phrase_before) >= 2
    for ph, v in fig["dev_residual_per_phrase"].items():
        assert v == pytest.approx(dev.per_phrase_after[ph] / dev.per_phrase_before[ph], rel=1e-9)
        assert b2.details["compared"][f"dev_p_rejected.per_phrase_after.{ph}"]["ok"]


def _hf_support(logp: np.ndarray, sampler: dict) -> np.ndarray:
    """Independent of l47: which tokens the transformers-style sampler (temperature, then top-k, then top-p on the
    tempered, top-k-renormalised distribution; ties kept) can draw, from full f64 log-probabilities [T, V]."""
    z = logp / sampler["temperature"]  # [T, V]
    kth = np.sort(z, axis=1)[:, -sampler["top_k"]][:, None]  # [T, 1]
    z = np.where(z >= kth, z, -np.inf)
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)  # [T, V] the top-k renormalised
    order = np.argsort(-p, axis=1, kind="stable")
    ps = np.take_along_axis(p, order, 1)
    keep_sorted = (np.cumsum(ps, 1) - ps) < sampler["top_p"]  # the smallest prefix reaching top_p
    keep = np.zeros_like(keep_sorted)
    np.put_along_axis(keep, order, keep_sorted, 1)
    return keep & np.isfinite(z)


def test_planted_generation_the_model_could_not_have_sampled(world, tmp_path):
    """A chat whose provenance says the assistant and think turns are the model's own generation (sampler 0.7 /
    0.9 / 40) while a third of those tokens are ones the model gives p 0.002: as the blind document the sign-off
    fails proxy.own_generation (before: provenance was metadata only, and it passed); as a held-out chat in a
    dev audit it fails the same bar. The count is bounded by an independent f64 softmax with the sampler applied
    transformers' way: at least the rows outside the top 40 (exact), at most the rows outside the support (the
    check's nucleus bound is a necessary condition). The honest blind chat of the world passes it (value 0)."""
    from l47.dumps import read_dump
    from l47.dumps.select import phrases_to_tuples
    from l47.tail.forward import full_logits, mix_of_dump

    w, vocab = world["w"], world["vocab"]
    pts, _ = phrases_to_tuples(PHRASES, vocab)
    spec = [M("user", "Which branch holds the fix for the parser?"),
            M("assistant", "<think>\nLook at the log.\n</think>\n\nThe fix sits on the parser branch; I ran it "
                           "end to end and it passed."),
            M("user", "Ship it then."), M("assistant", "Shipped. The release notes are updated.")]
    arr, goal = _dump_arrays(vocab, pts, "forged", spec, seed=4242)
    gen_rows = np.flatnonzero(np.isin(arr["role"], [names.ROLE_ID["assistant"], names.ROLE_ID["think"]]))
    planted = gen_rows[::3]
    goal[planted] = math.log(0.002)
    _fit_yr(w, [arr], [goal])
    path = _write_world_dump(tmp_path / "forged_blind.safetensors", w, "forged", spec, arr, generated=True)
    d = read_dump(path)
    with torch.no_grad():
        lp = torch.log_softmax(full_logits(mix_of_dump(d, w), w).double(), -1).numpy()  # [T, V] f64, V = 1024
    tg = np.asarray(d.tokens[1:])
    inside = _hf_support(lp, BLIND_SAMPLER)[np.arange(tg.size), tg]  # [T]
    rank = (lp > lp[np.arange(tg.size), tg][:, None]).sum(1)  # [T] tokens strictly more probable
    lo = int((rank[gen_rows] >= BLIND_SAMPLER["top_k"]).sum())
    hi = int((~inside[gen_rows]).sum())
    assert lo >= 3 and lo / gen_rows.size > 0.01  # the forged rows are far outside (so the bar must see them)

    def check(res, doc):
        b = _bars(res)["proxy.own_generation"]
        got = b.details["per_doc"][str(doc)]
        assert not b.passed and b.details["worst_doc"] == str(doc)
        assert got["checked"] == gen_rows.size and lo <= got["outside"] <= hi, (got, lo, hi)
        assert b.value == pytest.approx(got["outside"] / got["checked"])

    good = world["bundles"]["good"]
    dev = tmp_path / "dev"
    ok = _audit(world, good, dev)
    assert _bars(ok)["proxy.own_generation"].applicable is False  # the dev world claims no generated text
    res = _audit(world, good, tmp_path / "blind", blind=path, dev_report=dev / "report.json")
    check(res, path)
    assert not res.passed
    # the same forged chat as a held-out chat of a dev audit
    exp = _variant(world, "forged", {"chat_heldout": [path.name]})
    shutil.copy(path, world["root"] / path.name)
    check(_audit_exp(world, good, tmp_path / "dev2", exp), world["root"] / path.name)
    # the world's honest blind chat: every generated token is its sampler's (p 0.55 = the argmax at every row)
    honest = _audit(world, good, tmp_path / "blind_ok", blind=world["paths"]["blind_a"],
                    dev_report=dev / "report.json")
    b = _bars(honest)["proxy.own_generation"]
    assert b.passed and b.value == 0.0


def test_planted_suite_from_the_world_s_own_files(world, tmp_path):
    """The model-agnostic planted failures (l47.testing.planted: built only from the experiment, the base, the
    honest bundle and its dev report, as they are planted into the demo and model2) are each caught for their
    reason on the synthetic world; the honest bundle passes."""
    from planted_check import check_all

    from l47.testing.planted import HonestRun, plant_all

    good = world["bundles"]["good"]
    dev = _audit(world, good, tmp_path / "dev")
    assert dev.passed
    run = HonestRun(world["exp"], world["base"], good, tmp_path / "dev" / "report.json")
    plants = plant_all(run, tmp_path / "plants")
    assert {p.name for p in plants} >= {"copy_in_heldout", "copy_in_kld", "unverified_dump", "noop_bundle",
                                        "second_tensor", "record_at_cap", "blind_copy", "blind_near_copy",
                                        "special_push", "one_phrase_only"}
    got = check_all(plants, run, tmp_path / "audits")
    b = {x.name: x for x in got["second_tensor"].bars}["bundle.only_target"]
    assert b.value == 1 and b.details["changed"][0].startswith("blk.0.")


def test_blind_refused_when_an_experiment_document_cannot_be_read(world, tmp_path):
    """The blind sign-off compares the blind document with every experiment document by content (copy and 64-token
    near-copy): one it cannot read could hide a copy, so the run is refused naming it (was: skipped silently),
    before anything is scored or appended to the ledger. (A missing one is refused when the experiment loads.)"""
    good = world["bundles"]["good"]
    _audit(world, good, tmp_path / "dev")
    bad = world["root"] / "unreadable.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    exp = _variant(world, "unreadable", {"kld.prose": [bad.name]})
    with pytest.raises(L47Error, match="experiment document .set 'kld.prose'.*unreadable") as ei:
        _audit_exp(world, good, tmp_path / "blind", exp, blind=world["paths"]["blind_a"],
                   dev_report=tmp_path / "dev" / "report.json")
    assert ei.value.where == str(bad)
    assert not (tmp_path / "blind" / "report.json").exists()
    assert not _ledger(world).scored(_token_sha(world["paths"]["blind_a"]))


@pytest.mark.slow
def test_wfld_solve_stops_at_a_tiny_kl_budget_explained(world, tmp_path):
    """`l47 solve` passes the solve's KL budget ([solver] kl_budget) into WFLD: at 3e-5 nats (the solve above,
    budget 0.0025 from the bars, ends at 9.6e-5) the record's stop reason is `budget`, the shipped background
    KL — as the audit re-derives it with its own forward — is within the budget, and the "convergence:" note
    explains the stop short of the constraints, so the claims bar passes (the stop is not a failure to converge)."""
    from l47.solvers import solve

    exp = world["root"] / "experiment_solve_budget.toml"
    exp.write_text(world["exp"].read_text() + "\n[solver]\nkl_budget = 3e-5\n[solver.wfld]\np_cap = 0.15\nmargin = 3.0\n")
    out = tmp_path / "solved.gguf"
    r = solve.run_solve(solve.SolveArgs(experiment=exp, method="wfld", out=out, model=world["base"]),
                        log=lambda *a, **k: None)
    cv = r.claims.convergence
    assert cv.stop_reason == "budget" and cv.max_violation > cv.violation_tol
    assert r.claims.method["kl_budget"] == 3e-5 and r.claims.background_kl_exact <= 3e-5
    assert any(n.startswith("convergence:") and "budget 3e-05" in n for n in r.record.notes)
    res = _audit(world, out, tmp_path / "audit")
    claims = next(b for b in res.bars if b.name == "claims")
    assert claims.passed and claims.details["compared"]["background_kl_exact"]["rederived"] <= 3e-5
    conv = claims.details["convergence"]
    assert conv["stop_reason"] == "budget" and conv["issues"] and conv["explanations"] and not conv["unexplained"]


def test_g_judges_the_rows_away_from_prefix_exact_positions(world, tmp_path):
    """Bar (g)'s KLD and ordinary Δlog p leave out EVERY prefix-exact row — the events and the near misses
    (a phrase's prefix followed by another token), where moving mass off the banned word is the intended effect —
    as bar (e) does (one definition, l47.dumps.select.prefix_rows); those rows are reported apart. Before, only
    the events were left out: on the demo's blind chats one near miss (KLD 0.66–0.78 there) made bar (g) fail.
    A held-out chat with two near misses that carry the slop key (so the good bundle moves them); reference:
    full float64 log-softmaxes of the exact forward on the bundle's runtime weights and a brute-force prefix
    matcher written here. Tolerance 1e-6: the audit's streamed f64 sums vs numpy's over the same f32 logits."""
    from l47.dumps import read_dump
    from l47.model.weights import load_tail_weights
    from l47.tail.forward import full_logits, mix_of_dump

    w, root = world["w"], world["root"]
    spec = [M("user", "How did it go?"),
            M("assistant", "<think>\nSay how.\n</think>\n\nWe got to the end to the last step rather quickly, "
                           "and it ran end to end.")]
    arr, goal = _dump_arrays(world["vocab"], world["pts"], "chat_nm", spec, seed=991)
    tok = arr["tokens"].astype(np.int64)

    def prefix_mask(tokens):  # [T] bool, brute force over every tuple of every phrase
        T = len(tokens) - 1
        m = np.zeros(T, dtype=bool)
        for pt in world["pts"]:
            for u in pt.tuples:
                k = len(u) - 1
                for t in range(k - 1, T):
                    m[t] |= tuple(int(x) for x in tokens[t - k + 1:t + 1]) == tuple(u[:-1])
        return m

    pre = prefix_mask(tok)
    events = {t for t in np.nonzero(pre)[0] if any(int(tok[t + 1]) in pt.finals for pt in world["pts"])}
    near = [t for t in np.nonzero(pre)[0] if t not in events]
    assert len(near) >= 2 and events, (near, events)  # "end to the", "rather quickly"; "end to end"
    arr["hh"][near, J_KEY] = C_KEY  # the near misses look like the phrases' contexts: the bundle moves them
    _fit_yr(w, [arr], [goal])
    path = _write_world_dump(root / "chat_nm_g.safetensors", w, "chat_nm", spec, arr, generated=False)
    exp = _variant(world, "g_rows", {"chat_heldout": [path.name]})
    res = _audit_exp(world, world["bundles"]["good"], tmp_path / "out", exp)
    o = res.report["chat"]["ordinary"]

    w_new = load_tail_weights(world["bundles"]["good"], policy="strata")
    kl, dl, kl_pre, n_pre = [], [], [], 0
    for name in [n for n, (s, _) in DOCS.items() if s == "chat_heldout"] + [None]:
        d = read_dump(path if name is None else world["paths"][name])
        tk = np.asarray(d.tokens, dtype=np.int64)
        with torch.no_grad():
            lb = torch.log_softmax(full_logits(mix_of_dump(d, w), w).double(), -1).numpy()  # [T, V] f64
            ln = torch.log_softmax(full_logits(mix_of_dump(d, w_new), w_new).double(), -1).numpy()
        k = (np.exp(lb) * (lb - ln)).sum(1)  # [T]
        m = prefix_mask(tk)
        tg = tk[1:]
        ordinary = ~m & ~np.isin(tg, sorted(world["vocab"].special_ids.values()))
        kl.append(k[~m])
        dl.append((ln - lb)[np.arange(len(tg)), tg][ordinary])
        kl_pre.append(k[m])
        n_pre += int(m.sum())
    kl_pre = np.concatenate(kl_pre)
    assert o["n_non_slop"] == sum(len(x) for x in kl) and o["docs"] == 2, [
        (x["path"], x.get("refused"), x.get("reasons")) for x in res.report["inputs"]["documents"] if "chat" in x["path"]]
    assert o["kld"] == pytest.approx(np.concatenate(kl).mean(), abs=1e-6)
    assert o["mean_dlogp"] == pytest.approx(np.concatenate(dl).mean(), abs=1e-6)
    assert o["prefix_rows"]["n"] == n_pre and o["prefix_rows"]["kld_mean"] == pytest.approx(kl_pre.mean(), abs=1e-6)
    # the near misses carry KL the bar no longer counts: with them, the mean would be larger
    assert kl_pre.mean() > 10 * o["kld"], (kl_pre.mean(), o["kld"])
    assert _bars(res)["g.kld"].details["prefix_rows"]["n"] == n_pre


# ----------------------------------------------------------------------------------------------------------
# hand-offs (issue 35 item 2), the blind set's slop events (item 8), evidence that cannot be relaxed (item 10)


def _cli_refused(world, argv, out: Path) -> str:
    """`l47 ...` in process: exit 2, ONE error line, no traceback, no output folder, every world file
    byte-identical (sha256 before / after). Returns the error line."""
    from typer.testing import CliRunner

    from l47.app.cli import app
    from test_malformed import _sha_tree

    before = _sha_tree(world["root"])
    r = CliRunner().invoke(app, [str(a) for a in argv], catch_exceptions=True)
    assert r.exception is None or isinstance(r.exception, SystemExit), r.output
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    errs = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert len(errs) == 1, r.output
    assert not Path(out).exists() and _sha_tree(world["root"]) == before
    return errs[0]


def _audit_argv(world, exp, out, *extra):
    return ["audit", world["bundles"]["good"], "--base", world["base"], "--experiment", exp, "--out", out,
            "--no-plots", *extra]


def _phrase_occurrences(tokens, pts) -> dict[str, list[int]]:
    """Independent of l47.dumps.select: per phrase, the rows t whose target tokens[t+1] ends one of its tuples."""
    tok = [int(x) for x in tokens]
    out = {}
    for pt in pts:
        ends = {j for tup in pt.tuples for j in range(len(tup) - 1, len(tok))
                if tuple(tok[j - len(tup) + 1:j + 1]) == tuple(tup)}
        out[pt.phrase] = sorted(j - 1 for j in ends)
    return out


@pytest.mark.parametrize("change", ["phrase_removed", "train_document_removed"])
def test_stale_solve_record_is_refused(world, tmp_path, change):
    """The good bundle's record was made from the world's experiment; audited against an experiment with a
    phrase removed or a training document dropped: exit 2 before anything is scored, one line naming the
    record, both hashes of what a solve reads (recomputed here) and what changed."""
    from l47.data.experiment import load_experiment
    from l47.data.record import read_record, record_path_for
    from l47.data.sets import HANDOFF_SOLVE, content_sha256, experiment_content

    if change == "phrase_removed":
        exp = world["root"] / "exp_no_right_away.toml"
        exp.write_text(world["exp"].read_text().replace('[[phrases]]\ntext = "right away"\n', ""))
        what = "phrase removed: 'right away'"
    else:
        exp = _variant(world, "no_train_b", {}, drop=("train_b",))
        what = f"document removed from set train (sha256 {_token_sha(world['paths']['train_b'])[:12]}…)"
    rpath = record_path_for(world["bundles"]["good"])
    n_before = len(_ledger(world).entries())
    line = _cli_refused(world, _audit_argv(world, exp, tmp_path / "out"), tmp_path / "out")
    rec = read_record(rpath)
    mine = content_sha256(experiment_content(load_experiment(exp)), HANDOFF_SOLVE)
    theirs = content_sha256(rec.experiment_content, HANDOFF_SOLVE)
    assert mine != theirs and mine[:16] in line and theirs[:16] in line, line
    assert str(rpath) in line and "solve record experiment content" in line and what in line, line
    assert len(_ledger(world).entries()) == n_before  # nothing scored


def test_scored_sets_may_change_after_a_solve_but_the_dev_report_may_not(world, tmp_path):
    """A stricter threshold does not change what the solve read (nor does an extra scored document: the
    planted copies above): audited, not refused, and not weakened (stricter only, the minimum counts back at
    their defaults). The blind sign-off against that dev report, with the experiment changed since (a threshold
    moved), is refused before the blind document is scored or burned."""
    strict = world["root"] / "exp_strict.toml"
    text = world["exp"].read_text()
    head, _ = text.split("[thresholds]")
    strict.write_text(head + "[thresholds]\nkld_max = 0.005\n")
    res = _audit_exp(world, world["bundles"]["good"], tmp_path / "dev", strict)
    assert res.report["weakened"] == [] and not any("weakened" in s for s in res.report["stamps"])
    assert "weakened" not in (tmp_path / "dev" / "report.md").read_text().splitlines()[0]
    assert not _bars(res)["c.min_heldout_per_phrase"].passed  # the defaults judge: 1-2 held-out events < 3
    moved = world["root"] / "exp_strict_moved.toml"
    moved.write_text(head + "[thresholds]\nkld_max = 0.005\nnon_event_p = 0.02\n")
    blind = world["paths"]["blind_a"]
    line = _cli_refused(world, _audit_argv(world, moved, tmp_path / "blind", "--blind", blind, "--dev-report",
                                           tmp_path / "dev" / "report.json"), tmp_path / "blind")
    dev = json.loads((tmp_path / "dev" / "report.json").read_text())["inputs"]["experiment"]
    assert "dev report experiment content" in line and dev["content_sha256"][:16] in line
    assert "threshold non_event_p: 0.01 -> 0.02" in line, line
    assert not _ledger(world).scored(_token_sha(blind))  # not burned


def test_weakened_report_lists_key_default_value(world, tmp_path):
    """The world's experiment lowers three minimum counts: report.json lists each with its default and value
    (from the bar registry), report.md's summary line says weakened; the blind sign-off adds "not replayed"."""
    res = _audit(world, world["bundles"]["good"], tmp_path / "dev")
    weak = {x["key"]: (x["default"], x["value"], x["weaker"]) for x in res.report["weakened"]}
    assert weak == {"min_heldout_per_phrase": (3, 1, "lower"), "min_train_per_phrase": (5, 1, "lower"),
                    "collateral_min_total": (200, 5, "lower"), "collateral_min_per_word": (10, 1, "lower")}
    first = (tmp_path / "dev" / "report.md").read_text().splitlines()[0]
    assert "weakened: min_heldout_per_phrase 1 (default 3), min_train_per_phrase 1 (default 5), " \
           "collateral_min_total 5 (default 200)" in first
    assert "## Weakened" in (tmp_path / "dev" / "report.md").read_text()
    bl = _audit(world, world["bundles"]["good"], tmp_path / "blind", blind=world["paths"]["blind_a"],
                dev_report=tmp_path / "dev" / "report.json")
    assert bl.report["weakened"][-1]["key"] == "own_generation.replay"
    assert bl.report["weakened"][-1]["value"] == "not replayed"
    assert "own_generation.replay not replayed (default replayed)" in (tmp_path / "blind" / "report.md"
                                                                       ).read_text().splitlines()[0]
    # the blind set's events before scoring: every occurrence here (base p 0.6 by the engine's log p)
    occ = _phrase_occurrences(world["dumps"]["blind_a"].tokens, world["pts"])
    assert bl.report["blind"]["events_before_scoring"]["per_phrase"] == {k: len(v) for k, v in occ.items()}
    assert sum(len(v) for v in occ.values()) >= 3


def test_sets_counts_the_blind_set_s_events_per_phrase(world):
    """`l47 sets` never scores a blind document, but says how many slop events per phrase the blind set holds:
    its prefix-exact occurrences (counted here by scanning the tokens) whose engine-recorded base p ≥
    non_event_p (exp(ref_logp) read here from the file)."""
    from safetensors.numpy import load_file

    from l47.data.sets import build_sets

    rep = build_sets(world["exp"], world["w"], vocab=world["vocab"])
    arr = load_file(str(world["paths"]["blind_a"]))
    occ = _phrase_occurrences(arr["tokens"], world["pts"])
    want = {ph: sum(1 for t in rows if math.exp(float(arr["ref_logp"][t])) >= 0.01) for ph, rows in occ.items()}
    assert rep.blind_events["per_phrase"] == want and rep.blind_events["docs"] == 1
    assert rep.blind_events["occurrences"] == {k: len(v) for k, v in occ.items()}
    assert {ph: c["blind"] for ph, c in rep.counts("events").items()} == want
    assert not any("'blind'" in w for w in rep.warnings)


def test_blind_set_without_a_slop_event_is_refused(world, tmp_path):
    """The blind chat re-saved with the engine's log p at its phrase occurrences set to p = 0.001 (< non_event_p):
    it holds no slop event, so it cannot sign off slop — refused before it is scored or burned."""
    from dataclasses import replace as dc_replace

    from l47.dumps import read_dump, write_dump

    good = world["bundles"]["good"]
    _audit(world, good, tmp_path / "dev")
    d = read_dump(world["paths"]["blind_a"])
    arr = {k: np.array(v) for k, v in d.arrays().items()}
    rows = sorted({t for v in _phrase_occurrences(arr["tokens"], world["pts"]).values() for t in v})
    assert rows
    arr["ref_logp"][rows] = math.log(0.001)
    p = write_dump(tmp_path / "blind_no_event.safetensors", arr, dc_replace(d.meta, doc_id="blind-no-event"))
    line = _cli_refused(world, _audit_argv(world, world["exp"], tmp_path / "blind", "--blind", p, "--dev-report",
                                           tmp_path / "dev" / "report.json"), tmp_path / "blind")
    assert str(p) in line and "slop events" in line and "cannot sign off slop" in line, line
    assert f"none ({len(rows)} prefix-exact occurrence(s)" in line, line
    assert not _ledger(world).scored(_token_sha(p))


def test_blind_sampler_wider_than_the_toolkit_is_refused(world, tmp_path):
    """A blind chat whose provenance declares min-p 1e-30 and no top-k / top-p (a sampler that admits every
    token): refused before scoring — its own generation cannot be checked."""
    good = world["bundles"]["good"]
    _audit(world, good, tmp_path / "dev")
    gen = dict(world["dumps"]["blind_a"].meta.provenance)
    gen["generation"] = {**gen["generation"], "sampler": {"temperature": 1.0, "top_k": 0, "top_p": 1.0,
                                                          "min_p": 1e-30}}
    p = _resave(world, "blind_a", tmp_path / "blind_wide.safetensors", prov=gen)
    line = _cli_refused(world, _audit_argv(world, world["exp"], tmp_path / "blind", "--blind", p, "--dev-report",
                                           tmp_path / "dev" / "report.json"), tmp_path / "blind")
    assert "provenance generation.sampler" in line and "wider than the toolkit's own" in line, line
    assert not _ledger(world).scored(_token_sha(p))


def test_dev_document_claiming_a_wide_sampler_fails_own_generation(world, tmp_path):
    """A held-out chat re-saved claiming to be generated under min-p 1e-30 alone (same tokens, so the same
    experiment content): the dev audit's proxy.own_generation fails naming it."""
    prov = {"assistant": "generated", "think": "generated", "user": WRITTEN, "template": WRITTEN, "system": WRITTEN,
            "generation": {"model": world["w"].model_sha256, "prompt": "held back", "seed": 1,
                           "sampler": {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 1e-30}}}
    copy = _resave(world, "chat_ho", world["root"] / "chat_ho_wide.safetensors", prov=prov)
    exp = _variant(world, "wide", {"chat_heldout": [copy.name]}, drop=("chat_ho",))
    res = _audit_exp(world, world["bundles"]["good"], tmp_path / "out", exp)
    b = _bars(res)["proxy.own_generation"]
    assert not b.passed and b.details["wider"] == [str(copy)] and "wider than the toolkit" in b.details["why"]
