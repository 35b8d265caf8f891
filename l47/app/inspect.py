"""`l47 inspect`: describe a GGUF's tail tensors and hyperparameters, or a dump file."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from l47.dumps import read_dump
from l47.engine.gguf_export import read_hf_config
from l47.errors import L47Error
from l47.model import names
from l47.model.gguf_io import open_gguf
from l47.model.vocab import checkpoint_tokenizer_kv, vocab_from_kv

GGUF_MAGIC = b"GGUF"


def _tail_names(g) -> list[str]:
    n_layers = int(g.kv.get(names.key(names.K_BLOCK_COUNT, g.kv.get(names.KEY_ARCH, names.ARCH)), 0))
    L = n_layers - 1
    want = [t.gguf for t in names.GLOBAL_TENSORS if t is not names.TOKEN_EMBD] + [names.OUTPUT_SCALE.gguf]
    want += [t.gguf.format(L=L) for t in (names.FFN_HC_NORM, names.FFN_HC_DOWN, names.FFN_HC_UP,
                                          names.FFN_HC_INJECT, names.FFN_HC_DOWN_INJECT, names.FFN_GATE_SHEXP,
                                          names.FFN_UP_SHEXP, names.FFN_DOWN_SHEXP, names.FFN_GATE_INP_SHEXP)]
    return [n for n in want if n in g.tensors]


def inspect_gguf(path: Path, console: Console) -> None:
    g = open_gguf(path)
    arch = g.kv.get(names.KEY_ARCH, "?")
    console.print(f"[bold]{path}[/]  GGUF v{g.version}, arch {arch}, {len(g.tensors)} tensors, "
                  f"alignment {g.alignment}")
    hp = Table(title="hyperparameters")
    hp.add_column("key")
    hp.add_column("value")
    for k, v in g.kv.items():
        if k.startswith(f"{arch}.") or k.startswith(names.PROVENANCE_PREFIX) or k in (names.KEY_NAME,):
            s = str(v)
            hp.add_row(k, s if len(s) < 100 else s[:97] + "…")
    console.print(hp)
    t = Table(title="tail tensors (logical shape = rows, cols)")
    for c in ("tensor", "type", "shape", "bytes"):
        t.add_column(c)
    for n in _tail_names(g):
        i = g.tensors[n]
        t.add_row(n, i.type_name, str(i.shape), "?" if i.nbytes is None else f"{i.nbytes:,}")
    console.print(t)
    unknown = [i for i in g.tensors.values() if i.nbytes is None]
    if unknown:
        console.print(f"{len(unknown)} tensor(s) of types this toolkit cannot decode (not needed by the tail "
                      f"forward), e.g. {unknown[0].name}: {unknown[0].type_name}")


def inspect_dump(path: Path, console: Console) -> None:
    d = read_dump(path)
    m = d.meta
    console.print(f"[bold]{path}[/]  dump schema v{m.schema_version}, doc {m.doc_id!r}, T = {d.T}, layer {m.layer}")
    t = Table(title="arrays")
    t.add_column("name")
    t.add_column("shape")
    t.add_column("dtype")
    for k in ("tokens", "R", "inj", "hh", "sgv", "yr", "role", "ref_logp", "ref_top_ids", "ref_top_logits",
              "ref_logits"):
        a = getattr(d, k)
        if a is not None:
            t.add_row(k, str(tuple(a.shape)), str(a.dtype))
    console.print(t)
    console.print(f"model {m.model}, engine {m.engine}, inj {m.inj_convention}, hh {m.hh_precision}")
    console.print(f"provenance {m.provenance}")
    console.print("verified (zero-proxy refs present)" if d.verified else "[yellow]unverified: no ref_logp[/]")


def inspect_checkpoint(path: Path, console: Console) -> None:
    """A transformers checkpoint folder: its qwen4exp config and its own tokenizer (what `l47 export` reads)."""
    cfg = read_hf_config(path)
    kv = checkpoint_tokenizer_kv(path, int(cfg.vocab_size))
    v = vocab_from_kv(kv, str(path / "tokenizer.json"))
    console.print(f"[bold]{path}[/]  transformers checkpoint, model_type {cfg.model_type}", highlight=False)
    t = Table(title="config")
    t.add_column("key")
    t.add_column("value")
    for k in ("num_hidden_layers", "hidden_size", "shared_expert_intermediate_size", "moe_intermediate_size",
              "num_experts", "num_experts_per_tok", "hc_count", "hc_lowrank", "vocab_size", "rms_norm_eps",
              "tie_word_embeddings"):
        t.add_row(k, str(getattr(cfg, k, "?")))
    t.add_row("tokenizer", f"{v.size:,} ids, pre {kv[names.K_TOK_PRE]}")
    t.add_row("specials", ", ".join(f"{s} {i}" for s, i in v.special_ids.items()) or "none")
    console.print(t)
    console.print(f"next: l47 export {path} MODEL.gguf", highlight=False)


def inspect_file(path: Path, console: Console) -> None:
    path = Path(path)
    if not path.exists():
        raise L47Error(path, "file", "an existing GGUF or dump file", "nothing")
    if path.is_dir():
        inspect_checkpoint(path, console)
        return
    with open(path, "rb") as fh:
        head = fh.read(4)
    if head == GGUF_MAGIC:
        inspect_gguf(path, console)
    else:
        inspect_dump(path, console)
