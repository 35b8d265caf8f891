"""The README's newcomer walk, run exactly as documented: every `l47` / `cd` line of the block after the
`<!-- walk` marker in README.md, parsed from the README (not copied here), on the demo model saved as a
transformers checkpoint folder with its own tokenizer.json, the demo's documents as the files a user fills in.

Reference: the verdicts the audit writes (report.json) and the exit codes; every command must exit 0 — export
(its check against transformers passed), dumps (zero-proxy within 1e-4 nats for each document), sets, solve —
and the two audits, whose exit code must be their report's verdict (1 exactly when a bar failed): at the walk's
reduced size (32 prompts) the per-phrase bars have too few events to pass (docs/DEMO.md), so the walk checks that
every step runs as written and that the verdicts are honest."""

from __future__ import annotations

import glob
import json
import re
import shlex
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from l47.app.cli import app
from l47.app.demo import DATA, MODEL

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = 32  # the first 32 demo prompts, as tests/test_demo_e2e.py runs the demo (its verdicts are known to pass)
FILL = {  # file the walk says to fill -> the demo's documents (collateral split alternately, as the demo does)
    "prompts/chats.jsonl": ("prompts.jsonl", "first"),
    "texts/collateral_anchor.jsonl": ("collateral.jsonl", 0),
    "texts/collateral_eval.jsonl": ("collateral.jsonl", 1),
    "texts/background.jsonl": ("background.jsonl", None),
    "prompts/chat_heldout.jsonl": ("heldback_chat_prompts.jsonl", None),
    "prompts/blind.jsonl": ("heldback_blind_prompts.jsonl", "one"),  # one blind chat
    "texts/kld_ops_tools.jsonl": ("kld_ops_tools.jsonl", None),
    "texts/kld_chat_json.jsonl": ("kld_chat_json.jsonl", None),
    "texts/kld_prose.jsonl": ("kld_prose.jsonl", None),
}


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


def _checkpoint(folder: Path) -> Path:
    """The demo model as a transformers checkpoint folder: its weights as the file holds them, its tokenizer."""
    from l47.engine.gguf_export import load_hf_from_gguf

    load_hf_from_gguf(MODEL, policy="exact").save_pretrained(folder)
    shutil.copy(DATA / "tokenizer.json", folder / "tokenizer.json")
    return folder


def _fill(exp: Path) -> None:
    for rel, (src, parity) in FILL.items():
        lines = [ln for ln in (DATA / src).read_text(encoding="utf-8").splitlines() if ln.strip()]
        if parity == "first":
            lines = lines[:PROMPTS]
        elif parity == "one":
            lines = lines[:1]
        elif parity is not None:
            lines = lines[parity::2]
        (exp / rel).write_text("\n".join(lines) + "\n", encoding="utf-8")


def test_readme_walk_runs_as_documented(tmp_path, monkeypatch):
    cmds = walk_commands()
    names = [c[1] for c in cmds if c[0] == "l47"]
    for step in ("export", "init", "dump", "sets", "plan", "solve", "audit"):
        assert step in names, f"the walk lost its `l47 {step}` step"
    monkeypatch.chdir(tmp_path)
    _checkpoint(tmp_path / "my-checkpoint")
    runner = CliRunner()
    filled = False
    verdicts: list[bool] = []
    for words in cmds:
        if words[0] == "cd":
            monkeypatch.chdir(Path.cwd() / words[1])
            continue
        if words[1] == "dump" and not filled:  # the user fills in the files init listed
            _fill(Path.cwd())
            filled = True
        args = []
        for w in words[1:]:  # the shell's glob expansion
            hits = sorted(glob.glob(w)) if glob.has_magic(w) else []
            args += hits or [w]
        r = runner.invoke(app, args)
        if words[1] == "audit":  # a verdict is the model's, not the walk's: the exit code must be the report's
            rj = Path(args[args.index("--out") + 1]) / "report.json"
            assert rj.is_file(), f"{' '.join(words)} -> exit {r.exit_code}, no report\n{r.output[-3000:]}"
            report = json.loads(rj.read_text())
            failed = [b["name"] for b in report["bars"] if b.get("applicable", True) and not b["passed"]]
            assert report["passed"] is (not failed), failed
            assert r.exit_code == (0 if report["passed"] else 1), r.output[-3000:]
            verdicts.append(report["passed"])
            continue
        if words[1] == "plan":  # 1: a phrase cannot reach its target, said before solving (an honest verdict)
            assert r.exit_code in (0, 1) and "plan: target residual" in r.output, r.output[-3000:]
            continue
        assert r.exit_code == 0, f"{' '.join(words)} -> exit {r.exit_code}\n{r.output[-3000:]}"
    assert len(verdicts) == 2  # the dev audit and the blind sign-off both wrote their reports
