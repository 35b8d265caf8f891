"""Planted failures built from any experiment's own files (issue 13, item 6).

Each `Plant` is one bad input made from an honest audit's inputs — a training document copied where it must not
be, a bundle that does nothing or touches a second tensor, a solve record that hit its iteration cap, a dump
without the engine's log p, special-token mass pushed by ΔW, a blind document that is a (near-)copy or a forged
generation — with what the audit must do about it: fail a named bar, or refuse before scoring. Nothing here is
specific to one model: the documents, tensors and token ids come from the experiment, the base GGUF and the
honest dev report. The tests plant them into the synthetic world, the demo and model2.

    honest = HonestRun(experiment, base, bundle, dev_report)  # the inputs of a finished dev audit
    plants = plant_all(honest, out)                           # [Plant], each written under `out`
"""

from __future__ import annotations

import json
import shutil
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from l47.data import record as rec
from l47.data.experiment import load_experiment
from l47.data.record import read_record, record_path_for
from l47.dumps import read_dump, write_dump
from l47.dumps.select import chat_structure, find_events, phrases_to_tuples
from l47.model import names, quants
from l47.model.gguf_io import copy_with_tensor_replaced, open_gguf
from l47.model.vocab import vocab_from_gguf
from l47.model.weights import edited_weight, load_tail_weights
from l47.tail.forward import logp_at, mix_of_dump, score_dump

REFUSED = "refused"  # Plant.expect for inputs the audit must refuse before scoring (exit 2, nothing scored)


@dataclass(frozen=True)
class HonestRun:
    """A finished dev audit: its experiment file, base GGUF, bundle (with its solve record beside it) and report."""

    experiment: Path
    base: Path
    bundle: Path
    dev_report: Path

    @property
    def ledger(self) -> Path:
        """The ledger the dev audit appended to (the base model's, or the one it was given)."""
        return Path(json.loads(Path(self.dev_report).read_text())["inputs"]["ledger"])

    def documents(self) -> list[dict]:
        """The report's scored documents: {path, sha256, set, doc_id, T, verified, refused, reasons}."""
        return json.loads(Path(self.dev_report).read_text())["inputs"]["documents"]


@dataclass(frozen=True)
class Plant:
    name: str
    expect: str  # the bar that must fail, or REFUSED
    why: str  # what the bad input is
    experiment: Path
    bundle: Path
    blind: Path | None = None  # a blind sign-off (against HonestRun.dev_report)
    match: str = ""  # REFUSED: a regex the one-line error must match
    reason: Callable[[object], bool] | None = None  # the failed bar (evals.bars.Bar) -> failed for the plant's own
    # reason; None: the bar must be worse than the honest run's (where that one failed too)


# ----------------------------------------------------------------------------------------------------------
# documents


def resave(src, dst: Path, *, rows: slice | None = None, drop_ref: bool = False, provenance: dict | None = None) -> Path:
    """A re-saved copy of a dump: new file name and doc_id (other file bytes, the same tokens), optionally only the
    rows `rows` (a near-copy: shares a long window, not the whole token sequence), without the engine's own log p
    (ref_*: the zero-proxy check cannot run), or with another provenance."""
    d = read_dump(src)
    arr = {k: np.array(v) for k, v in d.arrays().items()}
    if rows is not None:
        arr = {k: (v[rows.start:rows.stop + 1] if k == "tokens" else v[rows]) for k, v in arr.items()}
    if drop_ref:
        arr = {k: v for k, v in arr.items() if not k.startswith("ref_")}
    meta = replace(d.meta, doc_id=f"{d.meta.doc_id}-planted-{Path(dst).stem}",
                   provenance=provenance if provenance is not None else d.meta.provenance)
    return write_dump(dst, arr, meta)


def claimed_generation(model_sha256: str, sampler: dict | None = None) -> dict:
    """Provenance that says the assistant and think turns are this model's own generation."""
    return {"assistant": "generated", "think": "generated", "user": "written", "template": "written",
            "system": "written", "generation": {"model": model_sha256, "prompt": "held back", "seed": 1,
                                                "sampler": sampler or {"temperature": 0.7, "top_p": 0.9, "top_k": 40}}}


def variant(experiment: Path, dst: Path, add: dict[str, list[Path]] | None = None,
            swap: dict[Path, Path] | None = None) -> Path:
    """The experiment file with documents added to sets (`add`: set name or "kld.<domain>" -> paths) or one dump
    replaced by another (`swap`), written to `dst` with every path absolute (so it can live anywhere)."""
    import tomli_w  # dev dependency: the standard library reads TOML but does not write it

    exp = load_experiment(experiment)
    raw = tomllib.loads(Path(experiment).read_text(encoding="utf-8"))
    swap = {Path(k).resolve(): Path(v) for k, v in (swap or {}).items()}
    sets: dict[str, list[str]] = {}
    for s, paths in exp.sets.items():
        sets[s] = [str(swap.get(p.resolve(), p).resolve()) for p in paths]
    for s, paths in (add or {}).items():
        sets.setdefault(s, []).extend(str(Path(p).resolve()) for p in paths)
    raw["sets"] = {s: v for s, v in sets.items() if not s.startswith("kld.")}
    kld = {s[4:]: v for s, v in sets.items() if s.startswith("kld.")}
    if kld:
        raw["sets"]["kld"] = kld
    if exp.model is not None:
        raw["model"] = str(Path(exp.model).resolve())
    if exp.split is not None:
        raw["split"] = {**raw["split"], "pool": [str(swap.get(p.resolve(), p).resolve()) for p in exp.split.pool]}
    dst.write_text(tomli_w.dumps(raw), encoding="utf-8")
    return dst


def _pick(docs: list[dict], sets: tuple[str, ...]) -> dict:
    """The first accepted document of the first of `sets` that has one (the honest report's order)."""
    for s in sets:
        for d in docs:
            if d["set"] == s and not d["refused"]:
                return d
    raise ValueError(f"the honest audit scored no accepted document in {sets}")


# ----------------------------------------------------------------------------------------------------------
# bundles


def _with_record(bundle: Path, src_bundle: Path, **changes) -> Path:
    """A solve record beside `bundle`: `src_bundle`'s, naming the new bundle's sha256, fields replaced."""
    r = read_record(record_path_for(src_bundle))
    r = replace(r, bundle_sha256=open_gguf(bundle).sha256(), **changes)
    record_path_for(bundle).write_text(r.to_json())
    return bundle


def noop_bundle(run: HonestRun, dst: Path) -> Path:
    """The honest bundle with the target's bytes put back to the base's: a bundle that edits nothing."""
    target = _target(run)
    copy_with_tensor_replaced(run.bundle, dst, {target: np.array(open_gguf(run.base).raw(target))})
    return _with_record(dst, run.bundle)


def second_tensor_bundle(run: HonestRun, dst: Path) -> tuple[Path, str]:
    """The honest bundle with one more tensor changed (one value of a layer-0 tensor, which the tail forward never
    reads, so every other bar stays as it was): (bundle, the tensor's name)."""
    import gguf

    g = open_gguf(run.bundle)
    known = [n for n in sorted(g.tensors) if g.info(n).nbytes is not None and n != _target(run)]
    name = next((n for n in known if n.startswith("blk.0.")), known[0] if known else None)
    if name is None:
        raise ValueError(f"{run.bundle}: no tensor besides the target to change (an overlay of one tensor)")
    raw = np.array(g.raw(name))
    flat = raw.reshape(-1)
    if g.info(name).ggml_type == int(gguf.GGMLQuantizationType.F32):
        v = flat.view(np.float32)
        v[0] = v[0] * 1.001 + 1e-3
    else:
        flat[-1] ^= 1  # the lowest bit of the last quant byte
    copy_with_tensor_replaced(run.bundle, dst, {name: raw})
    return _with_record(dst, run.bundle), name


def capped_bundle(run: HonestRun, dst: Path) -> Path:
    """The honest bundle, its record saying the solver stopped at its iteration cap above its tolerance."""
    shutil.copy(run.bundle, dst)
    r = rec.read_record(rec.record_path_for(run.bundle))
    conv = rec.Convergence(stop_reason=rec.STOP_ITERATION_CAP, max_violation=1.0, violation_tol=0.01,
                           iterations=(r.claims.convergence.iterations if r.claims.convergence else None))
    return _with_record(dst, run.bundle, claims=replace(r.claims, convergence=conv), notes=[])


def special_push_bundle(run: HonestRun, dst: Path, docs: list[Path], *, flips: int = 3) -> Path:
    """The honest ΔW plus a push of <|im_end|>: α·g with g = ∂ Σ log p(<|im_end|>) / ∂ΔW over the rows of `docs`
    (exact differentiable tail forward), α doubled until <|im_end|> becomes the argmax at `flips` or more
    non-terminal rows of those documents that had another argmax. Re-quantised to Q8_0 like every bundle."""
    w = load_tail_weights(run.base, policy=load_experiment(run.experiment).policy)
    W_new, _ = edited_weight(w, run.bundle)
    dW0 = (W_new - w.W_sd).detach()  # [n, f] the honest edit
    special = _special_ids(run)
    end = int(special[names.IM_END])
    dumps = [read_dump(p) for p in docs]
    dW = dW0.clone().requires_grad_(True)
    total = sum(logp_at(mix_of_dump(d, w, W_sd=w.W_sd + dW), w, torch.full((d.T,), end)).sum() for d in dumps)
    g = torch.autograd.grad(total, dW)[0]  # [n, f]
    g = g / g.norm() * w.W_sd.norm()  # the push's scale: ‖W_sd‖ (α is relative to it)
    rows = []  # [T] bool per document: non-terminal rows whose honest argmax is not <|im_end|>
    for d in dumps:
        cs = chat_structure(np.asarray(d.tokens), np.asarray(d.role), special)
        rows.append(~cs.terminal & (score_dump(w, d, W_sd=w.W_sd + dW0).argmax != end))

    def flipped(dW_try) -> int:
        return sum(int(((score_dump(w, d, W_sd=w.W_sd + dW_try).argmax == end) & r).sum()) for d, r in zip(dumps, rows))

    alpha = 1e-3
    while flipped(dW0 + alpha * g) < flips:
        alpha *= 2
        if alpha > 8:
            raise ValueError("no push within 8·‖W_sd‖ flips <|im_end|>")
    return _write_edit(run, dst, w, W_new + alpha * g)


def one_phrase_bundle(run: HonestRun, dst: Path, *, residual: float = 0.1) -> tuple[Path, str]:
    """A bundle that removes ONE phrase and leaves the others: ΔW = −α·g/‖g‖·‖W_sd‖ with g = ∂ Σ log p(final) /
    ∂ΔW over that phrase's events in the training documents (exact differentiable tail forward), α doubled until
    the phrase's mean p(final) there is ≤ `residual` × base. The phrase is the one with the most training events
    (ties: the first in the experiment). -> (bundle, phrase). Re-quantised in the target's own type."""
    exp = load_experiment(run.experiment)
    w = load_tail_weights(run.base, policy=exp.policy)
    pts, _ = phrases_to_tuples(exp.phrases, vocab_from_gguf(open_gguf(run.base)))
    train = [read_dump(d["path"]) for d in run.documents() if d["set"] == "train" and not d["refused"]]
    events = [(d, e) for d in train for e in find_events(np.asarray(d.tokens), pts)]
    counts = {pt.phrase: sum(e.phrase == pt.phrase for _, e in events) for pt in pts}
    phrase = max(counts, key=lambda k: (counts[k], -list(counts).index(k)))
    if not counts[phrase]:
        raise ValueError(f"{run.experiment}: no training document holds an event of any phrase")
    rows = {}  # doc index -> (rows [E], finals [E]) of the phrase's events
    for i, d in enumerate(train):
        ev = [e for dd, e in events if dd is d and e.phrase == phrase]
        if ev:
            rows[i] = (torch.as_tensor([e.pos for e in ev]), torch.as_tensor([e.tuple[-1] for e in ev]))

    def mean_p(dW) -> tuple[torch.Tensor, torch.Tensor]:  # (Σ log p, mean p) over the phrase's events
        lps = [logp_at(mix_of_dump(train[i], w, W_sd=w.W_sd + dW, rows=r), w, f) for i, (r, f) in rows.items()]
        lp = torch.cat(lps)  # [E]
        return lp.sum(), lp.exp().mean()

    dW0 = torch.zeros_like(w.W_sd, requires_grad=True)
    total, p0 = mean_p(dW0)
    g = torch.autograd.grad(total, dW0)[0]  # [n, f]
    g = -g / g.norm() * w.W_sd.norm()
    alpha = 1e-3
    with torch.no_grad():
        while float(mean_p(alpha * g)[1]) > residual * float(p0):
            alpha *= 2
            if alpha > 8:
                raise ValueError(f"no edit within 8·‖W_sd‖ removes {phrase!r}")
    return _write_edit(run, dst, w, w.W_sd + alpha * g), phrase


def unnatural_text(base: Path, n_tokens: int = 160, seed: int = 0) -> str:
    """Text the model finds unnatural whatever its vocabulary: `n_tokens` ids drawn uniformly from the vocabulary
    less its special tokens, decoded (a document near ln V nats per token, far above bar proxy.base_ce's ½ ln V)."""
    vocab = vocab_from_gguf(open_gguf(base))
    pool = np.setdiff1d(np.arange(vocab.size), np.asarray(list(vocab.special_ids.values()), dtype=np.int64))
    ids = np.random.default_rng(seed).choice(pool, size=n_tokens)
    return vocab.decode([int(i) for i in ids]).replace("<|", "< |")  # never a chat special token by its text


def _write_edit(run: HonestRun, dst: Path, w, W_sd_new: torch.Tensor) -> Path:
    """The honest bundle with its target replaced by W_sd_new re-quantised in the target's own type."""
    ti = open_gguf(run.bundle).info(w.target)
    raw = quants.quantize(W_sd_new, ti.ggml_type, w.target).numpy()
    copy_with_tensor_replaced(run.bundle, dst, {w.target: raw})
    return _with_record(dst, run.bundle)


def _target(run: HonestRun) -> str:
    return read_record(record_path_for(run.bundle)).target


def _special_ids(run: HonestRun) -> dict[str, int]:
    return dict(vocab_from_gguf(open_gguf(run.base)).special_ids)


# ----------------------------------------------------------------------------------------------------------
# the suite


def plant_all(run: HonestRun, out: Path, forged: Path | None = None, unnatural: Path | None = None) -> list[Plant]:
    """Every model-agnostic planted failure of one honest run, written under `out`. `forged`: a dump of a document
    the model did not generate (a written chat, never scored), to be planted as a blind document claiming to be
    the model's own generation; `unnatural`: a dump of text the model finds unnatural (unnatural_text), planted
    in a scored set (both need an engine to dump, so the caller makes them)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    docs = run.documents()
    train = _pick(docs, ("train",))
    chat_train = _pick(docs, ("train",) if _is_chat(train) else ("train", "dev"))
    scored = _pick(docs, tuple(sorted({d["set"] for d in docs if d["set"].startswith("kld.")})) + ("collateral_eval",))
    kld = next((d["set"] for d in docs if d["set"].startswith("kld.")), "kld.planted")
    sha = open_gguf(run.base).sha256()
    gen = claimed_generation(sha)
    exp, b = run.experiment, run.bundle
    plants = [
        Plant("copy_in_heldout", "c.disjoint", "a renamed, re-saved copy of a training document as a held-out chat",
              variant(exp, out / "exp_copy_heldout.toml",
                      {"chat_heldout": [resave(train["path"], out / "copy_heldout.safetensors")]}), b),
        Plant("copy_in_kld", "c.disjoint", f"a renamed, re-saved copy of a training document in {kld}",
              variant(exp, out / "exp_copy_kld.toml", {kld: [resave(train["path"], out / "copy_kld.safetensors")]}), b),
        Plant("unverified_dump", "proxy.zero_proxy", "a scored dump re-saved without the engine's own log p",
              variant(exp, out / "exp_unverified.toml",
                      swap={Path(scored["path"]): resave(scored["path"], out / "unverified.safetensors", drop_ref=True)}),
              b),
        Plant("noop_bundle", "c.slop", "a bundle whose target is the base's", exp, noop_bundle(run, out / "noop.gguf")),
        Plant("second_tensor", "bundle.only_target", "a bundle that changes one more tensor", exp,
              second_tensor_bundle(run, out / "second.gguf")[0]),
        Plant("record_at_cap", "claims", "a solve record that stopped at its iteration cap, violation 1 nat", exp,
              capped_bundle(run, out / "capped.gguf")),
        Plant("blind_copy", REFUSED, "a training chat re-saved as the blind document, provenance 'generated'", exp, b,
              resave(chat_train["path"], out / "blind_copy.safetensors", provenance=gen), match="blind document"),
        Plant("blind_near_copy", REFUSED, "a training chat less its first and last two rows as the blind document",
              exp, b, _near_copy(chat_train, out / "blind_near.safetensors", gen), match="near-copy|blind document"),
    ]
    chats = [Path(d["path"]) for d in docs if d["set"] in ("chat_heldout", "dev") and not d["refused"]][:4]
    if chats:
        plants.append(Plant("special_push", "f.flips", "ΔW pushes <|im_end|> to the argmax mid-turn", exp,
                            special_push_bundle(run, out / "push.gguf", chats)))
    one, phrase = one_phrase_bundle(run, out / "one_phrase.gguf")
    plants.append(Plant("one_phrase_only", "c.slop", f"a bundle that removes {phrase!r} only (the pooled reduction "
                        "can pass while every other phrase stays)", exp, one, reason=_left_phrases(phrase)))
    if unnatural is not None:
        plants.append(Plant("unnatural_text", "proxy.base_ce", f"text the model finds unnatural in {kld}",
                            variant(exp, out / "exp_unnatural.toml",
                                    {kld: [resave(unnatural, out / "unnatural.safetensors")]}), b))
    if forged is not None:
        plants.append(Plant("forged_blind", "proxy.own_generation", "a written chat claiming to be the model's own "
                            "generation as the blind document", exp, b,
                            resave(forged, out / "forged_blind.safetensors", provenance=gen)))
    return plants


def _left_phrases(removed: str) -> Callable[[object], bool]:
    """c.slop failed for the one-phrase plant's reason: the removed phrase meets the reduction bar and the worst
    phrase is another one (whatever the honest bundle reached)."""
    def reason(bar) -> bool:
        per = bar.details.get("per_phrase") or {}
        return (removed in per and per[removed]["reduction"] >= bar.threshold
                and bar.details.get("worst_phrase") != removed)
    return reason


def _is_chat(doc: dict) -> bool:
    d = read_dump(doc["path"], validate=False)
    return bool((np.asarray(d.role) == names.ROLE_ID["think"]).any())


def _near_copy(doc: dict, dst: Path, provenance: dict) -> Path:
    T = int(doc["T"])
    return resave(doc["path"], dst, rows=slice(2, T - 2), provenance=provenance)


__all__ = ["REFUSED", "HonestRun", "Plant", "resave", "claimed_generation", "variant", "noop_bundle",
           "second_tensor_bundle", "capped_bundle", "special_push_bundle", "one_phrase_bundle", "unnatural_text",
           "plant_all"]
