"""evals.report.render_tsv (column-wise) writes the same bytes as the per-row renderer it replaced (kept below as
the reference, verbatim from main `fda6abe`), on synthetic documents that cover every column: f32 and f64 numbers
with NaN, ±inf, −0.0, tiny and large values; token texts with tab / newline / CR / backslash; predicted ids past
the vocabulary (<id N>); every row kind; documents with and without penalty simulations; an empty document."""

from types import SimpleNamespace as NS

import numpy as np

from l47.evals import report
from l47.evals.metrics import SPECIAL, tok_text
from l47.model import names


def render_tsv_per_row(docs, vocab, special_ids, sims) -> str:  # the reference: main fda6abe's render_tsv
    _esc = report._esc
    spec = np.array(sorted(set(int(i) for i in special_ids.values())), dtype=np.int64)
    lines = ["\t".join(report.TSV_COLUMNS)]
    for d in docs:
        b, n = d.ps.base, d.ps.new
        tg = d.targets
        psb = np.exp(b.set_logp[SPECIAL]).sum(1)  # [T]
        psn = np.exp(n.set_logp[SPECIAL]).sum(1)
        sim = sims.get(d.sha256) or {}
        al, st = sim.get("alone"), sim.get("stacked")
        is_spec = np.isin(tg, spec)
        for t in range(d.T):
            kind = ("slop" if d.slop_rows[t] else "terminal" if d.chat.terminal[t] else "opener" if d.chat.opener[t]
                    else "special" if is_spec[t] else "ordinary")
            row = [d.set, d.path, d.sha256, t, names.ROLES[int(d.role[t])], kind, int(tg[t]),
                   _esc(vocab.decode([int(tg[t])])), f"{b.logp_target[t]:.6f}", f"{n.logp_target[t]:.6f}",
                   f"{d.ps.dlogp[t]:.6f}", f"{d.ps.kld[t]:.8f}", int(b.argmax[t]), int(n.argmax[t]),
                   _esc(tok_text(vocab, b.argmax[t])), _esc(tok_text(vocab, n.argmax[t])),
                   f"{psb[t]:.6g}", f"{psn[t]:.6g}", "" if al is None else f"{al.logp_target[t]:.6f}",
                   "" if st is None else f"{st.logp_target[t]:.6f}"]
            lines.append("\t".join(str(x) for x in row))
    return "\n".join(lines) + "\n"


class _Vocab:
    size = 50

    def decode(self, ids):
        (i,) = ids
        return ["tab\there", "new\nline", "cr\rx", "back\\slash", "plain", " space", "ü", ""][i % 8] + str(i)


def _nums(rng, T, dtype):
    x = (rng.standard_normal(T) * 10.0 ** rng.integers(-9, 4, T)).astype(dtype)
    for j, v in enumerate((np.nan, np.inf, -np.inf, -0.0, 0.0, 1e-300, -5e-7, 123456.789)):
        if j < T:
            x[rng.integers(T)] = v
    return x


def _doc(rng, i, T, with_sims, sims):
    f32 = np.float32
    tokens = rng.integers(0, 60, T + 1).astype(np.int64)

    def side():
        return NS(logp_target=_nums(rng, T, f32), argmax=rng.integers(0, 70, T).astype(np.int64),
                  set_logp={SPECIAL: (-np.abs(rng.standard_normal((T, 3))) * 20).astype(f32)})
    ps = NS(base=side(), new=side(), dlogp=_nums(rng, T, f32), kld=np.abs(_nums(rng, T, np.float64)))
    d = NS(set=["events", "kld_code", "heldout"][i % 3], path=f"dumps/doc {i}.l47dump", sha256=f"{i:064x}",
           tokens=tokens, role=rng.integers(0, len(names.ROLES), T).astype(np.uint8), ps=ps,
           chat=NS(terminal=rng.random(T) < 0.1, opener=rng.random(T) < 0.1), slop_rows=rng.random(T) < 0.1,
           T=T, targets=tokens[1:])
    if with_sims:
        sims[d.sha256] = {"alone": NS(logp_target=_nums(rng, T, f32)),
                          "stacked": None if i % 2 else NS(logp_target=_nums(rng, T, np.float64))}
    return d


def test_render_tsv_bytes_equal_the_per_row_renderer():
    rng = np.random.default_rng(0)
    sims: dict = {}
    docs = [_doc(rng, i, T, i % 3 == 0, sims) for i, T in enumerate((40, 1, 0, 257, 13, 64))]
    special_ids = {"<|im_end|>": 7, "<|im_start|>": 3, "<|endoftext|>": 7}
    got = report.render_tsv(docs, _Vocab(), special_ids, sims)
    want = render_tsv_per_row(docs, _Vocab(), special_ids, sims)
    assert got.encode() == want.encode()
    assert got.count("\n") == 1 + 40 + 1 + 257 + 13 + 64
    assert "<id 6" in got and "nan" in got and "inf" in got and "\\t" in got  # the cases above were exercised
