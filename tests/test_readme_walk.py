"""The README's newcomer walk, run exactly as documented: every `l47` / `cd` line of the block after the
`<!-- walk` marker in README.md, parsed from the README (not copied here), on a qwen4exp saved as a transformers
checkpoint folder with its own tokenizer.json, documents of its own as the files a user fills in. Two checkpoints:
the demo model, and model2 (docs/MODEL2.md: 3 layers, n 512, vocabulary 4,000 with the specials at ids 0-4, its
own BPE and phrases) — a checkpoint the walk was not written for. For model2 the `init` line's `--phrase` /
`--word` values are model2's five phrases and their final words (what a user types for their own model); every
other word of every line is the README's. A third, "fresh": a random qwen4exp built here and saved by
transformers itself (4 layers, n 160, hyper-connection low rank r 24 — not a multiple of Q8_0's 32-element block,
so its `[hc·n, r]` tensors have no Q8_0 form — shared expert 96, 6 experts), with a BPE tokenizer trained here by
`tokenizers` on the demo's documents, the chat special tokens in the MIDDLE (<|endoftext|> 700, <|im_start|>
701) and at the END (<think> 1497, </think> 1498, <|im_end|> 1499 of V 1,500): ids neither the demo (3067-3071)
nor model2 (0-4) uses. Its documents are the demo's, its phrases the README's.

Reference: the verdicts the audit writes (report.json) and the exit codes; every command must exit 0 — export
(its check against transformers passed), dumps (zero-proxy within 1e-4 nats for each document), sets, solve —
and the two audits, whose exit code must be their report's verdict (1 exactly when a bar failed): at the walk's
reduced size (32 demo prompts, 12 model2 prompts) the per-phrase bars have too few events to pass
(docs/DEMO.md), and the random model has no slop to remove at all, so the walk checks that every step runs as
written and that the verdicts are honest."""

from __future__ import annotations

import glob
import json
import re
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from l47.app.cli import app
from l47.app.demo import DATA, MODEL

ROOT = Path(__file__).resolve().parents[1]
M2 = ROOT / "l47" / "testing" / "model2"


@dataclass(frozen=True)
class WalkModel:
    """A checkpoint the walk runs on: its GGUF (saved as a transformers folder) or None (built by `fresh_checkpoint`),
    its documents (file the walk says to fill -> (its documents, which of them)), and the phrases / final words a
    user names for it (None: the README's own)."""

    gguf: Path | None
    data: Path
    fill: dict
    phrases: tuple[str, ...] | None = None
    words: tuple[str, ...] | None = None


FRESH_V = 1500
FRESH_SPECIALS = {"<|endoftext|>": 700, "<|im_start|>": 701,  # the middle of the vocabulary
                  "<think>": FRESH_V - 3, "</think>": FRESH_V - 2, "<|im_end|>": FRESH_V - 1}  # its end
FRESH_DIMS = dict(layers=4, hidden=160, lowrank=24, shared=96, num_experts=6)


def _document_texts(data: Path) -> list[str]:
    """Every text and message content of a folder's JSONL documents (what the fresh tokenizer is trained on)."""
    out = []
    for f in sorted(data.glob("*.jsonl")):
        for ln in f.read_text(encoding="utf-8").splitlines():
            if ln.strip():
                d = json.loads(ln)
                out.append(d.get("text") or "\n".join(m["content"] for m in d.get("messages", [])))
    return out


def fresh_checkpoint(folder: Path) -> Path:
    """A random qwen4exp checkpoint folder nobody has seen (FRESH_DIMS, FRESH_SPECIALS), built with the tests'
    one checkpoint writer (tests/tiny_ckpt.py): transformers' save_pretrained + the tokenizer's own JSON."""
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_ckpt import save_checkpoint, train_tokenizer

    tk = train_tokenizer(pre="qwen35", vocab_size=FRESH_V, texts=_document_texts(DATA), special_ids=FRESH_SPECIALS)
    assert tk.get_vocab_size() == FRESH_V
    return save_checkpoint(folder, vocab=FRESH_V, seed=15, tokenizer=tk, **FRESH_DIMS)


def _models() -> dict[str, WalkModel]:
    sys.path.insert(0, str(ROOT / "scripts"))
    import make_model2 as m2  # model2's phrases and final words, from the script that built it

    demo = WalkModel(MODEL, DATA, {  # the first 32 demo prompts, as tests/test_demo_e2e.py runs the demo
        "prompts/chats.jsonl": ("prompts.jsonl", slice(0, 32)),
        "texts/collateral_anchor.jsonl": ("collateral.jsonl", slice(0, None, 2)),  # split alternately (demo)
        "texts/collateral_eval.jsonl": ("collateral.jsonl", slice(1, None, 2)),
        "texts/background.jsonl": ("background.jsonl", slice(None)),
        "prompts/chat_heldout.jsonl": ("heldback_chat_prompts.jsonl", slice(None)),
        "prompts/blind.jsonl": ("heldback_blind_prompts.jsonl", slice(0, 3)),  # a blind set of three chats
        "texts/kld_ops_tools.jsonl": ("kld_ops_tools.jsonl", slice(None)),
        "texts/kld_chat_json.jsonl": ("kld_chat_json.jsonl", slice(None)),
        "texts/kld_prose.jsonl": ("kld_prose.jsonl", slice(None)),
    })
    model2 = WalkModel(M2 / "model2.gguf", M2, {  # reduced size: generation is most of the walk's time
        "prompts/chats.jsonl": ("prompts.jsonl", slice(0, 12)),
        "texts/collateral_anchor.jsonl": ("collateral.jsonl", slice(0, 24, 2)),
        "texts/collateral_eval.jsonl": ("collateral.jsonl", slice(1, 24, 2)),
        "texts/background.jsonl": ("background.jsonl", slice(0, None, 3)),  # plain and chat documents
        "prompts/chat_heldout.jsonl": ("prompts.jsonl", slice(56, 60)),  # prompts held back from the chats
        "prompts/blind.jsonl": ("prompts.jsonl", slice(61, 64)),  # three, held back from the chats too
        "texts/kld_ops_tools.jsonl": ("kld_support.jsonl", slice(0, 3)),  # model2's three domains under the
        "texts/kld_chat_json.jsonl": ("kld_order_json.jsonl", slice(0, 3)),  # README's set names
        "texts/kld_prose.jsonl": ("kld_recipes.jsonl", slice(0, 3)),
    }, tuple(m2.PHRASES), tuple(" " + w for w in m2.FINALS))
    fresh = WalkModel(None, DATA, {  # the demo's documents, fewer: a random model writes every turn to its cap
        "prompts/chats.jsonl": ("prompts.jsonl", slice(0, 8)),
        "texts/collateral_anchor.jsonl": ("collateral.jsonl", slice(0, 24, 2)),
        "texts/collateral_eval.jsonl": ("collateral.jsonl", slice(1, 24, 2)),
        "texts/background.jsonl": ("background.jsonl", slice(0, None, 3)),
        "prompts/chat_heldout.jsonl": ("heldback_chat_prompts.jsonl", slice(0, 2)),
        "prompts/blind.jsonl": ("heldback_blind_prompts.jsonl", slice(0, 3)),
        "texts/kld_ops_tools.jsonl": ("kld_ops_tools.jsonl", slice(0, 3)),
        "texts/kld_chat_json.jsonl": ("kld_chat_json.jsonl", slice(0, 3)),
        "texts/kld_prose.jsonl": ("kld_prose.jsonl", slice(0, 3)),
    })
    return {"demo": demo, "model2": model2, "fresh": fresh}


MODELS = _models()


def walk_commands() -> list[list[str]]:
    """The walk block's commands: continuation lines joined, comments dropped, only l47 and cd lines."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    m = re.search(r"<!-- walk.*?-->\s*```sh\n(.*?)```", text, flags=re.S)
    assert m, "README.md has no walk block"
    joined = m.group(1).replace("\\\n", " ")
    cmds = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        if words and words[0] in ("l47", "cd"):
            cmds.append(words)
    return cmds


def _checkpoint(m: WalkModel, folder: Path) -> Path:
    """The model as a transformers checkpoint folder: its weights as the file holds them, its tokenizer."""
    from l47.engine.gguf_export import load_hf_from_gguf

    if m.gguf is None:
        return fresh_checkpoint(folder)
    load_hf_from_gguf(m.gguf, policy="exact").save_pretrained(folder)
    shutil.copy(m.data / "tokenizer.json", folder / "tokenizer.json")
    return folder


def _fill(m: WalkModel, exp: Path) -> None:
    for rel, (src, which) in m.fill.items():
        lines = [ln for ln in (m.data / src).read_text(encoding="utf-8").splitlines() if ln.strip()][which]
        assert lines, (src, which)
        (exp / rel).write_text("\n".join(lines) + "\n", encoding="utf-8")
    # the walk's documents are a few of each kind (minutes, not hours): its phrases are thin, which plan and solve
    # refuse by default (min_train_per_phrase 5, min_heldout_per_phrase 3); the user's edit of the experiment file
    # lowers both to 1, and every report of the walk says "weakened"
    toml = exp / "experiment.toml"
    text = toml.read_text(encoding="utf-8")
    for key in ("min_train_per_phrase", "min_heldout_per_phrase"):
        text, n = re.subn(rf"^#?\s*{key}\s*=.*$", f"{key} = 1", text, count=1, flags=re.M)
        assert n == 1, (key, "not in l47 init's experiment.toml")
    toml.write_text(text, encoding="utf-8")


def _own_phrases(words: list[str], m: WalkModel) -> list[str]:
    """The `init` line with the model's own --phrase / --word values in place of the README's."""
    if words[:2] != ["l47", "init"] or m.phrases is None:
        return words
    out, i = [], 0
    while i < len(words):
        if words[i] in ("--phrase", "--word"):
            i += 2
            continue
        out.append(words[i])
        i += 1
    for ph in m.phrases:
        out += ["--phrase", ph]
    for w in m.words:
        out += ["--word", w]
    return out


@pytest.mark.parametrize("model", sorted(MODELS))
def test_readme_walk_runs_as_documented(model, tmp_path, monkeypatch):
    m = MODELS[model]
    cmds = [_own_phrases(c, m) for c in walk_commands()]
    names = [c[1] for c in cmds if c[0] == "l47"]
    for step in ("export", "init", "dump", "sets", "plan", "solve", "audit"):
        assert step in names, f"the walk lost its `l47 {step}` step"
    monkeypatch.chdir(tmp_path)
    _checkpoint(m, tmp_path / "my-checkpoint")
    runner = CliRunner()
    filled = False
    verdicts: list[bool] = []
    nothing_to_remove = False  # sets found no event at all (a random model never writes a banned phrase)
    for words in cmds:
        if words[0] == "cd":
            monkeypatch.chdir(Path.cwd() / words[1])
            continue
        if words[1] == "dump" and not filled:  # the user fills in the files init listed
            _fill(m, Path.cwd())
            filled = True
        args = []
        for w in words[1:]:  # the shell's glob expansion
            hits = sorted(glob.glob(w)) if glob.has_magic(w) else []
            args += hits or [w]
        r = runner.invoke(app, args)
        assert r.exception is None or isinstance(r.exception, SystemExit), \
            f"{' '.join(words)} -> traceback\n{r.output[-3000:]}"  # an exit code, never an uncaught error
        if words[1] == "sets" and r.exit_code == 0:
            nothing_to_remove = not json.loads(Path("sets.json").read_text())["events"]
        if nothing_to_remove and words[1] in ("plan", "solve", "audit"):
            # no event to train on: plan and solve refuse their input (exit 2, one line naming the file and the
            # train events), solve writes no bundle, so each audit refuses the missing bundle.gguf (exit 2)
            flat = " ".join(r.output.split())
            assert r.exit_code == 2 and len(r.output.strip().splitlines()) <= 3, r.output[-3000:]
            want = ("bundle.gguf",) if words[1] == "audit" else ("experiment.toml", "train events", "found none")
            assert all(w in flat for w in want), (want, flat)
            assert not Path("bundle.gguf").exists()
            verdicts.append(None)
            continue
        if words[1] == "audit":  # a verdict is the model's, not the walk's: the exit code must be the report's
            rj = Path(args[args.index("--out") + 1]) / "report.json"
            assert rj.is_file(), f"{' '.join(words)} -> exit {r.exit_code}, no report\n{r.output[-3000:]}"
            report = json.loads(rj.read_text())
            failed = [b["name"] for b in report["bars"] if b.get("applicable", True) and not b["passed"]]
            assert report["passed"] is (not failed), failed
            assert r.exit_code == (0 if report["passed"] else 1), r.output[-3000:]
            if "--blind" in words:  # the shell expanded the glob after one --blind: every dump is in the blind set
                blind = sorted(glob.glob("dumps/blind/*.safetensors"))
                assert len(blind) >= 3 and [b["path"] for b in report["inputs"]["blind"]] == blind, report["inputs"]
            verdicts.append(report["passed"])
            continue
        if words[1] == "plan":  # 1: a phrase cannot reach its target, said before solving (an honest verdict)
            assert r.exit_code in (0, 1) and "plan: target residual" in r.output, r.output[-3000:]
            continue
        assert r.exit_code == 0, f"{' '.join(words)} -> exit {r.exit_code}\n{r.output[-3000:]}"
    if nothing_to_remove:  # only the random checkpoint may have nothing to remove
        assert model == "fresh" and verdicts == [None] * 4  # plan, solve and both audits refused, exit 2
    else:
        assert len(verdicts) == 2  # the dev audit and the blind sign-off both wrote their reports
