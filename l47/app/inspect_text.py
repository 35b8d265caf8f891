"""`l47 inspect DUMP --text`: the document a dump holds, token by token — the role of each token, the slop events,
near misses and turn ends marked, and with `--bundle B` each token's Δlog p (the bundle's log p of the token minus
the base's, from the exact tail forward on the dump's states).

Definitions are the toolkit's own, not re-derived here:
    event       l47.dumps.select.find_events: the phrase's tuple ends at this token (prefix-exact)
    near miss   l47.solvers.select.near_miss_rows: the phrase's prefix precedes this token, which is not the
                phrase's final token (the edit must leave the natural continuation alone here)
    turn end    l47.dumps.select.chat_structure(...).terminal: an <|im_end|> closing a turn with content
    Δlog p      l47.tail.forward.score_pair: log p_bundle(token) − log p_base(token), nats, f64

Phrases come from `--experiment E` (its [[phrases]]) and/or `--phrase P` (repeatable); the vocabulary and the base
from the experiment's model or `--model M`. On a terminal the text flows with colours (rich); otherwise (a pipe,
a file) one line per token with plain marks, so it can be read and grepped:

    index  role       token               marks                      Δlog p
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from l47.data.experiment import load_experiment
from l47.dumps import read_dump
from l47.dumps.select import chat_structure, find_events, phrases_to_tuples
from l47.errors import L47Error
from l47.model import names
from l47.model.vocab import resolve_vocab
from l47.model.weights import edited_weight, load_tail_weights
from l47.solvers.select import near_miss_rows
from l47.tail.forward import score_pair


@dataclass(frozen=True)
class TokenMark:
    """One token of the document (index i of tokens [T+1]); its target row is i − 1."""

    i: int
    id: int
    text: str  # the characters this token completes (UTF-8 decoded across token boundaries)
    role: str  # the role of the token as a target ("" for token 0, which no row predicts)
    event: str = ""  # the phrase whose event ends at this token
    in_event: str = ""  # the phrase of an event whose tuple this token belongs to (before its final)
    near_miss: str = ""  # the phrase whose prefix precedes this token (not its final)
    turn_end: bool = False
    dlogp: float | None = None  # nats; None without a bundle (and for token 0)

    def marks(self) -> str:
        out = []
        if self.event:
            out.append(f"EVENT[{self.event}]")
        elif self.in_event:
            out.append(f"in-event[{self.in_event}]")
        if self.near_miss:
            out.append(f"near-miss[{self.near_miss}]")
        if self.turn_end:
            out.append("TURN-END")
        return " ".join(out)


@dataclass(frozen=True)
class TextView:
    doc_id: str
    T: int
    phrases: tuple[str, ...]
    tokens: tuple[TokenMark, ...]
    bundle: str = ""  # the bundle of the Δlog p column ("" without one)


def _pieces(vocab, ids) -> list[str]:
    """Each token's text: an incremental UTF-8 decode, so a character split over tokens shows at its last one."""
    dec = codecs.getincrementaldecoder("utf-8")("replace")
    out = [dec.decode(vocab.token_bytes(int(i))) for i in ids]
    if out:
        out[-1] += dec.decode(b"", final=True)
    return out


def text_view(dump, vocab, pts, dlogp: np.ndarray | None = None, bundle: str = "") -> TextView:
    """The marks of every token of `dump` under the phrase tuples `pts` (l47.dumps.select.PhraseTuples);
    dlogp [T] (row t = token t + 1) when a bundle was scored."""
    tok = np.asarray(dump.tokens, dtype=np.int64)  # [T+1]
    role = np.asarray(dump.role)  # [T]
    T = tok.shape[0] - 1
    event, in_event, near = {}, {}, {}
    for e in find_events(tok, pts, role):
        event[e.pos + 1] = e.phrase
        for j in range(e.start, e.pos + 1):
            in_event.setdefault(j, e.phrase)
    one = SimpleNamespace(sha256="doc")
    for pt in pts:
        for _, t, _ in near_miss_rows([one], [pt], lambda _s: tok):
            near.setdefault(t + 1, pt.phrase)
    terminal = chat_structure(tok, role, vocab.special_ids).terminal  # [T]
    role_names = names.ROLES
    marks = []
    for i, (tid, piece) in enumerate(zip(tok.tolist(), _pieces(vocab, tok.tolist()))):
        r = role_names[int(role[i - 1])] if i > 0 and int(role[i - 1]) < len(role_names) else ""
        marks.append(TokenMark(i, int(tid), piece, r, event.get(i, ""), in_event.get(i, ""), near.get(i, ""),
                               bool(i > 0 and terminal[i - 1]),
                               None if dlogp is None or i == 0 else float(dlogp[i - 1])))
    return TextView(str(dump.meta.doc_id), T, tuple(pt.phrase for pt in pts), tuple(marks), bundle)


# ----------------------------------------------------------------------------------------------------------
# inputs


@dataclass(frozen=True)
class TextArgs:
    dump: Path
    experiment: Path | None = None
    phrases: tuple[str, ...] = ()
    model: Path | None = None
    bundle: Path | None = None
    device: str = "cpu"


def _base_and_phrases(args: TextArgs):
    """(base GGUF path, vocabulary, phrase list, weight policy) from --experiment / --model / --phrase."""
    phrases: list = list(args.phrases)
    model, source, policy = args.model, "auto", "strata"
    if args.experiment is not None:
        exp = load_experiment(args.experiment, check_files=False)
        phrases = list(exp.phrases) + phrases
        model, source, policy = model or exp.model, exp.vocab, exp.policy
    if model is None:
        raise L47Error(args.dump, "--text", "the model whose vocabulary decodes the tokens: --experiment E or "
                       "--model M", "neither")
    return Path(model), resolve_vocab(source, Path(model)), phrases, policy


def _dlogp(args: TextArgs, dump, base: Path, policy: str) -> np.ndarray:
    """[T] f64: log p_bundle − log p_base of every target token (exact tail forward on the dump's states)."""
    w = load_tail_weights(base, policy=policy, device=args.device)
    if dump.meta.model != w.model_sha256:
        raise L47Error(args.dump, "meta.model", f"the base's sha256 {w.model_sha256[:16]}… (Δlog p is measured on "
                       "the states of the model the bundle edits)", f"{str(dump.meta.model)[:16]}…")
    W_new, _ = edited_weight(w, args.bundle, args.device)
    return np.asarray(score_pair(w, dump, W_new).dlogp, dtype=np.float64)


def build_text_view(args: TextArgs) -> TextView:
    """Read the dump, the phrases and the vocabulary; score the bundle when given. L47Error on bad input."""
    dump = read_dump(args.dump)
    base, vocab, phrases, policy = _base_and_phrases(args)
    too_big = int(np.asarray(dump.tokens).max(initial=0))
    if too_big >= vocab.size:
        raise L47Error(args.dump, "tokens", f"ids of {vocab.name} (< {vocab.size})", f"id {too_big}")
    pts, _ = phrases_to_tuples(phrases, vocab)
    d = _dlogp(args, dump, base, policy) if args.bundle is not None else None
    return text_view(dump, vocab, pts, d, str(args.bundle or ""))


# ----------------------------------------------------------------------------------------------------------
# rendering

ROLE_STYLE = {"system": "on grey15", "user": "on dark_blue", "assistant": "", "think": "on grey23",
              "template": "dim", "tool": "on dark_green"}
DLOGP_SHOWN = 0.01  # |Δlog p| (nats) from which a token is coloured on a terminal


def render_plain(view: TextView) -> list[str]:
    """One line per token: index, role, the token's text (repr), marks, Δlog p."""
    head = (f"doc {view.doc_id!r}: T = {view.T} targets; phrases: "
            + (", ".join(repr(p) for p in view.phrases) or "none")
            + (f"; Δlog p = log p(bundle {view.bundle}) − log p(base), nats" if view.bundle else ""))
    lines = [head, f"{'index':>6}  {'role':<10} {'token':<24} {'marks':<40} {'Δlog p' if view.bundle else ''}"]
    for m in view.tokens:
        d = "" if m.dlogp is None else f"{m.dlogp:+.4f}"
        lines.append(f"{m.i:>6}  {m.role or '-':<10} {m.text!r:<24} {m.marks():<40} {d}".rstrip())
    return lines


def render_rich(view: TextView):
    """The text flowing as written: a [role] label where the role changes, events bold red (their prefix
    underlined red), near misses underlined yellow, turn ends ⏎; with a bundle each token green (Δlog p > 0) or
    red (< 0) from |Δlog p| ≥ DLOGP_SHOWN, and every event's Δlog p listed after the text."""
    from rich.text import Text

    out = Text()
    last = None
    for m in view.tokens:
        if m.role != last and m.role:
            out.append(f"[{m.role}]", style="bold cyan")
            last = m.role
        style = ROLE_STYLE.get(m.role, "")
        if m.dlogp is not None and abs(m.dlogp) >= DLOGP_SHOWN:
            style += " green" if m.dlogp > 0 else " red"
        if m.event:
            style += " bold reverse"
        elif m.in_event:
            style += " underline"
        if m.near_miss:
            style += " underline yellow"
        out.append(m.text, style=style.strip() or None)
        if m.turn_end:
            out.append("⏎", style="bold magenta")
    return out


def print_text(view: TextView, console) -> None:
    """Colours on a terminal, plain marks otherwise."""
    if not console.is_terminal:
        for line in render_plain(view):
            console.print(line, highlight=False, markup=False, soft_wrap=True)
        return
    console.print(f"doc {view.doc_id!r}: T = {view.T}; phrases: {', '.join(view.phrases) or 'none'}",
                  highlight=False, markup=False)
    console.print("legend: [role] label at each change · event: reversed bold · its prefix: underlined · near miss: "
                  "yellow underline · ⏎ turn end" + (" · Δlog p: green up / red down" if view.bundle else ""),
                  highlight=False, markup=False)
    console.print(render_rich(view), soft_wrap=True)
    ev = [m for m in view.tokens if m.event]
    if view.bundle and ev:
        console.print("events: " + ", ".join(f"#{m.i} {m.event!r} {m.dlogp:+.3f}" for m in ev), highlight=False,
                      markup=False)
