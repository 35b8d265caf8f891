"""Thin phrases (l47.data.thin): counts, the documents to add, and the refusal before any long work."""

from types import SimpleNamespace as NS

from l47.data.thin import thin_phrases


def _docs(train, dev, heldout):
    return ([NS(set="train", refused=False)] * train + [NS(set="dev", refused=False)] * dev
            + [NS(set="heldout", refused=False)] * heldout + [NS(set="train", refused=True)] * 7  # refused: not pool
            + [NS(set="background", refused=False)] * 5)


def _ev(phrase, split, n, generated=True):
    return [NS(phrase=phrase, set=split, generated=generated)] * n


def test_thin_counts_and_documents_to_add_by_hand():
    docs = _docs(6, 2, 2)  # pool of 10 documents: shares train 0.6, heldout 0.2
    events = (_ev("a b", "train", 2) + _ev("a b", "dev", 1) + _ev("a b", "heldout", 1)
              + _ev("c d", "train", 5) + _ev("c d", "heldout", 3, generated=False)
              + _ev("e f", "background", 4, generated=False))
    thin = thin_phrases(["a b", "c d", "e f", "g h"], events, docs, min_train=5, min_heldout=3)
    assert [t.phrase for t in thin] == ["a b", "e f", "g h"]  # "c d" meets both minima exactly
    a = thin[0]
    assert a.short == {"train": (2, 5), "heldout": (1, 3)}
    # rate 4 events / 10 pool documents; train needs 3 / 0.6 = 5 events, held-out 2 / 0.2 = 10 -> 10 / 0.4 = 25
    assert abs(a.rate - 0.4) < 1e-12 and a.more_docs == 25 and a.kind == "generated chats"
    assert "'a b' has train 2, dev 1, heldout 1 events" in a.line() and "about 25 more generated chats" in a.line()
    e = thin[1]  # events only outside the pool: no rate, no estimate, said so
    assert e.rate == 0 and e.more_docs is None and "no pool document holds one" in e.line()
    assert thin[2].counts == {} and thin[2].kind == "written documents"


def test_thin_estimate_rounds_up():
    docs = _docs(3, 0, 1)  # shares train 0.75, heldout 0.25
    events = _ev("x y", "train", 4) + _ev("x y", "heldout", 3)
    (t,) = thin_phrases(["x y"], events, docs, min_train=5, min_heldout=3)
    # rate 7/4 = 1.75; train (5 − 4)/0.75 = 1.333 events -> 1.333/1.75 = 0.76 -> 1 document
    assert t.short == {"train": (4, 5)} and t.more_docs == 1
