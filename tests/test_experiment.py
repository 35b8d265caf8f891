"""The experiment file (l47.data.experiment): the documented example parses, defaults are the seed's numbers, and
every kind of bad input is a clear L47Error naming the item (typo'd keys list the valid ones).

No arithmetic: comparisons are exact (defaults against the numbers written in the seed / DESIGN §4, §6).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from l47.errors import L47Error
from l47.data.experiment import Thresholds, load_experiment

DOC = Path(__file__).resolve().parents[1] / "docs" / "EXPERIMENT.md"


def _doc_example() -> str:
    return re.search(r"```toml\n(.*?)```", DOC.read_text(), re.S).group(1)


def _touch_example_files(root: Path, toml: str) -> None:
    """Create every file the example names (patterns: one matching file each)."""
    for s in re.findall(r'"([^"]+\.(?:safetensors|gguf))"', toml):
        p = root / s.replace("*", "x")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"")


def _write(tmp_path: Path, text: str, files=("a", "b", "c", "d")) -> Path:
    for f in files:
        (tmp_path / f"{f}.safetensors").write_bytes(b"")
    p = tmp_path / "exp.toml"
    p.write_text(text)
    return p


BASE = """
[sets]
train = ["a.safetensors"]
heldout = ["b.safetensors"]

[[phrases]]
text = "rather than"
"""


def test_documented_example_parses(tmp_path):
    toml = _doc_example()
    _touch_example_files(tmp_path, toml)
    p = tmp_path / "exp.toml"
    p.write_text(toml)
    e = load_experiment(p)
    assert e.name == "anti-slop v4" and e.model == tmp_path / "models/strata-phase3.gguf"
    assert [ph.text for ph in e.phrases][:2] == ["end to end", "short version"]
    assert {ph.text: ph.margin_scale for ph in e.phrases}["right away"] == 0.5
    assert e.collateral_words == (" than", " what", " end", " away", " version", " actually")
    assert set(e.sets) == {"collateral_anchor", "collateral_eval", "background", "chat_heldout", "blind",
                           "kld.ops_tools", "kld.chat_json", "kld.ja"}
    assert e.sets["collateral_anchor"] == (tmp_path / "dumps/collateral/anchor_x.safetensors",)
    assert e.split.seed == 20240501 and e.split.fractions == {"train": 0.55, "dev": 0.10, "heldout": 0.35}
    assert e.split.pool == (tmp_path / "dumps/generated/x.safetensors",)
    assert e.solver == {"method": "wfld", "wfld": {"delta_cho": 0.05}}  # as `l47 solve` accepts it
    assert ("pool", tmp_path / "dumps/generated/x.safetensors") in e.documents()


def test_threshold_defaults_are_the_seeds():
    t = Thresholds()
    assert (t.non_event_p, t.heldout_frac, t.min_heldout_per_phrase, t.collateral_min_total) == (1e-2, 0.30, 3, 200)
    assert (t.slop_reduction, t.collateral_word_mean, t.collateral_frac_below, t.collateral_below) == \
        (0.50, -0.05, 0.10, -0.1)
    assert (t.kld_max, t.chat_ordinary_dlogp, t.chat_kld, t.im_end_dlogp) == (0.01, -0.01, 0.005, -0.005)
    assert (t.blind_residual_factor, t.zero_proxy_tol, t.ce_proxy_frac) == (1.5, 1e-3, 0.5)


def test_minimal_and_overrides(tmp_path):
    p = _write(tmp_path, BASE + "\n[thresholds]\nnon_event_p = 0.05\nmin_heldout_per_phrase = 5\n")
    e = load_experiment(p)
    assert e.thresholds.non_event_p == 0.05 and e.thresholds.min_heldout_per_phrase == 5
    assert e.thresholds.heldout_frac == 0.30  # untouched default
    assert e.sets["train"] == (tmp_path / "a.safetensors",) and e.vocab == "auto" and e.policy == "strata"
    assert e.collateral_words == () and e.split is None and e.model is None


@pytest.mark.parametrize("snippet,field,listed", [
    ("[thresholds]\nnon_event_P = 0.1\n", "[thresholds] key 'non_event_P'", "non_event_p"),
    ("[sets.kld]\n", None, None),  # valid (empty kld table)
    ("modle = 'x.gguf'\n", "key 'modle'", "model"),
    ("[collateral]\nword = [' than']\n", "[collateral] key 'word'", "words"),
])
def test_typod_keys_list_the_valid_ones(tmp_path, snippet, field, listed):
    text = snippet + BASE if not snippet.startswith("[") else BASE + snippet
    p = _write(tmp_path, text)
    if field is None:
        load_experiment(p)
        return
    with pytest.raises(L47Error) as ei:
        load_experiment(p)
    assert ei.value.field == field and listed in ei.value.expected and str(p) in str(ei.value)


def test_typod_set_name_and_phrase_key(tmp_path):
    p = _write(tmp_path, BASE.replace("heldout =", "held_out ="))
    with pytest.raises(L47Error, match="held_out") as ei:
        load_experiment(p)
    assert "heldout" in ei.value.expected
    p = _write(tmp_path, BASE + "margin = 2\n")
    with pytest.raises(L47Error, match="margin_scale"):
        load_experiment(p)


def test_phrase_with_no_tokens(tmp_path):
    p = _write(tmp_path, BASE + '\n[[phrases]]\ntext = "   "\n')
    with pytest.raises(L47Error, match=r"phrases\[1\]\.text") as ei:
        load_experiment(p)
    assert "at least one token" in ei.value.expected
    p = _write(tmp_path, BASE + '\n[[phrases]]\ntext = "Rather than"\n')
    with pytest.raises(L47Error, match="again"):
        load_experiment(p)


def test_missing_dump_files_are_all_named(tmp_path):
    p = _write(tmp_path, BASE.replace('"b.safetensors"', '"b.safetensors", "nope.safetensors", "gone/*.safetensors"'))
    with pytest.raises(L47Error) as ei:
        load_experiment(p)
    msg = str(ei.value)
    assert "nope.safetensors" in msg and "gone/*.safetensors (pattern matches no file)" in msg
    assert "2 missing" in msg and "sets.heldout" in msg
    assert load_experiment(p, check_files=False).sets["heldout"][1] == tmp_path / "nope.safetensors"


def test_one_set_per_document(tmp_path):
    p = _write(tmp_path, BASE + '\n[sets.kld]\nops = ["a.safetensors"]\n')
    with pytest.raises(L47Error, match="one set only") as ei:
        load_experiment(p)
    assert "sets.train" in str(ei.value) and "a.safetensors" in str(ei.value)


def test_split_table(tmp_path):
    text = '[split]\npool = ["*.safetensors"]\nseed = 3\n\n[[phrases]]\ntext = "x y"\n'
    p = _write(tmp_path, text)
    e = load_experiment(p)
    assert len(e.split.pool) == 4 and e.split.seed == 3 and e.split.fractions["heldout"] == 0.35
    with pytest.raises(L47Error, match="not both"):
        load_experiment(_write(tmp_path, BASE + '\n[split]\npool = ["c.safetensors"]\n'))
    with pytest.raises(L47Error, match="= 1"):
        load_experiment(_write(tmp_path, text.replace("seed = 3", "seed = 3\ntrain = 0.9")))
    with pytest.raises(L47Error, match="split.seed"):
        load_experiment(_write(tmp_path, text.replace("seed = 3", "seed = 'x'")))


def test_bad_values(tmp_path):
    with pytest.raises(L47Error, match="thresholds.min_heldout_per_phrase"):
        load_experiment(_write(tmp_path, BASE + "[thresholds]\nmin_heldout_per_phrase = 2.5\n"))
    with pytest.raises(L47Error, match="thresholds.kld_max"):
        load_experiment(_write(tmp_path, BASE + "[thresholds]\nkld_max = true\n"))
    with pytest.raises(L47Error, match="vocab"):
        load_experiment(_write(tmp_path, "vocab = 'llama'\n" + BASE))
    with pytest.raises(L47Error, match="TOML"):
        load_experiment(_write(tmp_path, BASE + "[thresholds\n"))
    with pytest.raises(L47Error, match="margin_scale"):
        load_experiment(_write(tmp_path, BASE + "margin_scale = -1\n"))
    with pytest.raises(L47Error, match="collateral.words"):
        load_experiment(_write(tmp_path, BASE + "[collateral]\nwords = ['']\n"))


def test_a_tilde_user_that_names_no_user_is_one_refusal(tmp_path):
    """Path.expanduser raises RuntimeError for ~user of no such user (found by scripts/fuzz_readers.py)."""
    p = _write(tmp_path, 'model = "~no_such_user_l47_zz/m.gguf"\n' + BASE)
    with pytest.raises(L47Error, match="~user must name a user"):
        load_experiment(p)
