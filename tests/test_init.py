"""`l47 init` and the experiment schema against the parsers that actually read the file.

References: the parsers themselves (l47.data.experiment.load_experiment, l47.solvers.solve.resolve_config) —
the schema must list exactly the keys they accept, with the defaults their dataclasses hold; every commented
default of the generated file, uncommented, must parse to that same default; every TOML example in the docs must
parse (no tolerance: keys and values compare exactly)."""

from __future__ import annotations

import re
import tomllib
from dataclasses import fields
from pathlib import Path

import pytest
from typer.testing import CliRunner

from l47.app.cli import app
from l47.app.demo import MODEL
from l47.app.init import InitArgs, render_experiment, schema, schema_markdown
from l47.data import experiment as E
from l47.solvers.ftpo import FtpoConfig
from l47.solvers.solve import COMMON_KEYS, DEFAULT_METHOD, resolve_config
from l47.solvers.wfld import WfldConfig

ROOT = Path(__file__).resolve().parents[1]


def test_schema_covers_exactly_the_accepted_keys():
    by = {}
    for k in schema():
        by.setdefault(k.table, []).append(k.name)
    assert set(by[""]) == set(E.TOP_KEYS) - {"sets", "split", "phrases", "collateral", "thresholds", "solver"}
    assert set(by["sets"]) == set(E.SETS) | {E.KLD}
    assert set(by["split"]) == set(E.SPLIT_KEYS)
    assert set(by["phrases"]) == set(E.PHRASE_KEYS)
    assert set(by["collateral"]) == set(E.COLLATERAL_KEYS)
    assert by["thresholds"] == [f.name for f in fields(E.Thresholds)]
    assert set(by["solver"]) == set(COMMON_KEYS)
    assert by["solver.wfld"] == [f.name for f in fields(WfldConfig)]
    assert by["solver.ftpo"] == [f.name for f in fields(FtpoConfig)]
    missing = [f"[{k.table}] {k.name}" for k in schema() if not k.meaning]
    assert not missing, f"add a meaning in l47/app/init.py for {missing}"


def _written(tmp_path, **kw):
    args = InitArgs(tmp_path / "exp", MODEL, ("rather than", "end to end"), (" than",), ("prose", "ops"), **kw)
    return render_experiment(args, "../m.gguf")


def test_every_commented_default_parses_to_that_default(tmp_path):
    text = _written(tmp_path)
    d = tomllib.loads(text)
    assert d["solver"]["method"] == "ftpo" and d["collateral"]["words"] == [" than"]
    # uncomment every "# key = value" line: the parsers accept each and the values are the defaults
    full = re.sub(r"^# (\w+ = )", r"\1", text, flags=re.M)
    full = re.sub(r"^(train|dev|heldout) = \[\].*$", "", full, flags=re.M)  # explicit lists conflict with [split]
    full = full.replace("# margin_scale", "margin_scale")
    exp_path = tmp_path / "exp" / "experiment.toml"
    exp_path.parent.mkdir()
    exp_path.write_text(full)
    exp = E.load_experiment(exp_path, check_files=False)
    assert exp.thresholds == E.Thresholds() and exp.vocab == "auto" and exp.policy == "strata"
    assert exp.split.fractions == E.DEFAULT_FRACTIONS and exp.split.seed == 0
    cfg = resolve_config(exp.solver, None, str(exp_path))
    assert cfg.method == "ftpo" == DEFAULT_METHOD
    assert {f.name: getattr(cfg.wfld, f.name) for f in fields(WfldConfig)} == \
        {f.name: (list(f.default) if isinstance(f.default, tuple) else f.default) for f in fields(WfldConfig)}
    assert cfg.ftpo == FtpoConfig()
    assert sorted(exp.sets) == sorted(["collateral_anchor", "collateral_eval", "background", "chat_heldout", "blind",
                                       "kld.prose", "kld.ops"])


def _model(tmp_path) -> Path:
    """The demo model (a qwen4exp GGUF with its own tokenizer) beside the experiment, as a user keeps it."""
    import shutil

    return Path(shutil.copy(MODEL, tmp_path / "m.gguf"))


def test_init_cli_writes_folder_and_refuses_overwrite(tmp_path):
    model = _model(tmp_path)
    r = CliRunner().invoke(app, ["init", str(tmp_path / "exp"), "--model", str(model), "--phrase", "rather than"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "exp" / "experiment.toml").is_file() and (tmp_path / "exp" / "texts").is_dir()
    assert "l47 sets experiment.toml" in r.output
    exp = E.load_experiment(tmp_path / "exp" / "experiment.toml", check_files=False)
    assert exp.model == (tmp_path / "m.gguf").resolve() or exp.model.resolve() == model.resolve()
    before = (tmp_path / "exp" / "experiment.toml").read_bytes()
    r = CliRunner().invoke(app, ["init", str(tmp_path / "exp"), "--model", str(model), "--phrase", "x y"])
    assert r.exit_code == 2 and "experiment.toml" in r.output and "new or empty folder" in r.output
    assert (tmp_path / "exp" / "experiment.toml").read_bytes() == before
    r = CliRunner().invoke(app, ["init", str(tmp_path / "e2"), "--model", str(tmp_path / "no.gguf"), "--phrase", "a b"])
    assert r.exit_code == 2 and "--model" in r.output and not (tmp_path / "e2").exists()


def _toml_blocks(path: Path) -> list[str]:
    return re.findall(r"```toml\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.S)


DOCS = sorted(p for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")] if _toml_blocks(p))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_toml_example_in_the_docs_parses(doc, tmp_path):
    for i, block in enumerate(_toml_blocks(doc)):
        p = tmp_path / f"ex{i}.toml"
        p.write_text(block)
        exp = E.load_experiment(p, check_files=False)  # unknown keys, types, ranges: as `l47 sets` reads it
        cfg = resolve_config(exp.solver, None, str(p))  # as `l47 solve` reads it
        assert cfg.method in ("wfld", "ftpo")


def test_experiment_doc_tables_match_the_schema():
    text = (ROOT / "docs" / "EXPERIMENT.md").read_text(encoding="utf-8")
    gen = re.search(r"<!-- generated by .*? -->\n(.*?)<!-- end generated -->", text, flags=re.S)
    assert gen and gen.group(1) == schema_markdown(), "regenerate with l47.app.init.schema_markdown()"
    # the thresholds table: every key, with the dataclass default
    rows = dict(re.findall(r"^\| `(\w+)` \| ([-+0-9.e]+) \|", text, flags=re.M))
    for f in fields(E.Thresholds):
        assert f.name in rows, f.name
        assert float(rows[f.name]) == float(f.default), (f.name, rows[f.name], f.default)


def test_init_set_makes_keys_active_and_refuses_unknown(tmp_path):
    model = _model(tmp_path)
    base = ["init", str(tmp_path / "exp"), "--model", str(model), "--phrase", "rather than"]
    r = CliRunner().invoke(app, base + ["--set", "solver.wfld.p_cap=0.35", "--set", "solver.max_anchors_per_word=8",
                                        "--set", "thresholds.kld_max=0.02", "--set", "policy=exact"])
    assert r.exit_code == 0, r.output
    exp = E.load_experiment(tmp_path / "exp" / "experiment.toml", check_files=False)
    cfg = resolve_config(exp.solver, None, "x")
    assert cfg.wfld.p_cap == 0.35 and cfg.max_anchors_per_word == 8 and exp.thresholds.kld_max == 0.02
    assert exp.policy == "exact" and cfg.wfld.margin == WfldConfig().margin  # the others stay at their defaults
    for bad, field in (("solver.wfld.bogus=1", "solver.wfld.bogus"), ("thresholds.kld_max=abc", "kld_max"),
                       ("p_cap", "p_cap")):
        r = CliRunner().invoke(app, ["init", str(tmp_path / "e2"), "--model", str(model), "--phrase", "a b",
                                     "--set", bad])
        assert r.exit_code == 2 and field in r.output and not (tmp_path / "e2").exists(), r.output


def test_init_writes_the_solvers_default_method(tmp_path):
    """`l47 init` without --method writes `method = "ftpo"` active: the solver's own default, the same one
    `l47 solve` uses when the file names none (one default, not two)."""
    model = _model(tmp_path)
    assert InitArgs(tmp_path / "x", model, ("a b",)).method == DEFAULT_METHOD == "ftpo"
    r = CliRunner().invoke(app, ["init", str(tmp_path / "exp"), "--model", str(model), "--phrase", "rather than"])
    assert r.exit_code == 0, r.output
    d = tomllib.loads((tmp_path / "exp" / "experiment.toml").read_text())
    assert d["solver"]["method"] == "ftpo"
    assert resolve_config(d["solver"], None, "experiment.toml").method == "ftpo"


# ---------------------------------------------------------------------------------------------------------
# `l47 init` validates everything it is given before writing anything (issue 35 item 4)


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under root -> its bytes (None: a folder)."""
    return {p.relative_to(root).as_posix(): (p.read_bytes() if p.is_file() else None)
            for p in sorted(root.rglob("*"))}


def _init_refused(tmp_path, argv, *must):
    """`l47 init ...` exits 2 with one error line naming each of `must`, no traceback, and the whole of tmp_path
    (the model and every other input, the target folder) byte-identical afterwards: nothing written."""
    before = _tree(tmp_path)
    r = CliRunner().invoke(app, ["init", *map(str, argv)])
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    errs = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert r.exit_code == 2 and len(errs) == 1 and "Traceback" not in r.output, r.output
    for m in must:
        assert m in errs[0], (m, errs[0])
    assert _tree(tmp_path) == before, "init wrote or changed something"
    return errs[0]


def test_init_refuses_a_non_empty_folder_and_takes_an_empty_one(tmp_path):
    model = _model(tmp_path)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's notes\n")
    _init_refused(tmp_path, [mine, "--model", model, "--phrase", "rather than"],
                  str(mine), "folder", "new or empty folder", "1 entry (notes.txt)")
    (tmp_path / "a_file").write_text("x\n")
    _init_refused(tmp_path, [tmp_path / "a_file", "--model", model, "--phrase", "rather than"], "a_file", "a file")
    empty = tmp_path / "empty"
    empty.mkdir()
    r = CliRunner().invoke(app, ["init", str(empty), "--model", str(model), "--phrase", "rather than"])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in empty.iterdir()) == ["dumps", "experiment.toml", "prompts", "texts"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left beside it


def test_init_refuses_phrases_and_words_the_vocabulary_cannot_hold(tmp_path):
    """The references are the model's own vocabulary (its GGUF tokenizer): 'a' is one token (no prefix, so no
    prefix-exact event), 'than' without its space two; a zero-width space is U+200B, category Cf."""
    from l47.model.vocab import vocab_for_model

    model = _model(tmp_path)
    v = vocab_for_model(model)
    assert len(v.encode("a")) == 1 and len(v.encode("than")) == 2 and len(v.encode(" than")) == 1
    assert len(v.encode("\u200b")) >= 2  # it would pass a token count: the visible-character rule refuses it
    exp = tmp_path / "exp"
    base = [exp, "--model", model]
    _init_refused(tmp_path, base + ["--phrase", "\u200b"], "--phrase", "visible characters", "U+200B ZERO WIDTH SPACE")
    _init_refused(tmp_path, base + ["--phrase", "rather\u200bthan"], "--phrase", "U+200B")
    _init_refused(tmp_path, base + ["--phrase", "   "], "--phrase", "no visible character")
    _init_refused(tmp_path, base + ["--phrase", "rather than", "--phrase", "a"], "--phrase 'a'", "at least 2 tokens",
                  f"1 token(s) {v.encode('a')}")
    _init_refused(tmp_path, base + ["--phrase", "rather than", "--word", "than"], "--word 'than'",
                  "exactly one token", f"2 tokens {v.encode('than')}")
    _init_refused(tmp_path, base + ["--phrase", "rather than", "--word", "\u200b"], "--word", "U+200B")
    r = CliRunner().invoke(app, ["init", *map(str, base), "--phrase", "rather than", "--word", " than"])
    assert r.exit_code == 0, r.output  # the positive control


def test_init_refuses_a_model_that_is_not_a_qwen4exp_gguf(tmp_path):
    from l47.model.gguf_io import copy_with_tensor_replaced
    from l47.model.names import KEY_ARCH

    exp = tmp_path / "exp"
    text = tmp_path / "model.gguf"
    text.write_text("not a model\n")
    other = copy_with_tensor_replaced(MODEL, tmp_path / "llama.gguf", {}, extra_kv={KEY_ARCH: "llama"})
    (tmp_path / "ckpt").mkdir()
    for model, must in ((text, ("model.gguf", "--model (magic)", "b'GGUF'")),
                        (other, ("llama.gguf", f"--model (metadata {KEY_ARCH})", "'qwen4exp'", "'llama'")),
                        (tmp_path / "ckpt", ("ckpt", "--model", "a folder")),
                        (tmp_path / "none.gguf", ("none.gguf", "--model", "no such file"))):
        _init_refused(tmp_path, [exp, "--model", model, "--phrase", "rather than"], *must)


def test_init_refuses_settings_the_schema_does_not_accept(tmp_path):
    model = _model(tmp_path)
    base = [tmp_path / "exp", "--model", model, "--phrase", "rather than"]
    for bad, must in ((["--set", "solver.wfld.bogus=1"], ("--set", "solver.wfld.bogus")),
                      (["--set", "thresholds.kld_max=abc"], ("--set", "kld_max")),
                      (["--set", "thresholds.kld_max=-1"], ("--set", "kld_max")),
                      (["--set", "solver.ftpo.steps=0.5"], ("--set", "steps")),
                      (["--set", "vocab=nonsense"], ("--set", "vocab")),
                      (["--set", "solver.wfld.p_cap=0.3", "--set", "solver.wfld.p_cap=0.4"],
                       ("--set solver.wfld.p_cap", "each key once", "2 times"))):
        _init_refused(tmp_path, base + bad, *must)
