#!/usr/bin/env python3
"""Train the demo model: a byte-level BPE vocabulary and a small transformers Qwen4Exp on the demo corpus.

Steps (all seeded; CPU by default, `--device cuda` for the GPU machine):
    1. byte-level BPE (`tokenizers`) on the training text: Qwen's split regex, then ByteLevel; the five chat
       special tokens appended as specials; the vocabulary is a multiple of 32 (padded with unused tokens)
    2. the corpus packed as `doc<|endoftext|>doc<|endoftext|>...`, cut into windows of `--seq` tokens
    3. AdamW (warm-up, cosine decay, grad-norm clip 1) on transformers' Qwen4ExpForCausalLM, f32, router
       load-balancing loss on
    4. checks on documents the model never saw: base CE on held-out natural text vs ln V; base p(final token |
       exact prefix) at every prefix-exact use of each banned phrase in held-out assistant turns
    5. the HF checkpoint (safetensors) + tokenizer.json + train_log.json in --out; the GGUF through
       `l47.engine.gguf_export.export_gguf` when it is available (the seed's tensor types)

Notation for tensor shapes:
    B   windows per step     T   window length (--seq)     V   vocabulary     n   hidden size

Precision: f32 parameters, activations and AdamW state; the loss is the f32 mean token cross-entropy; evaluation
reductions (CE sums, probabilities) in f64.

Usage:
    python scripts/make_demo_corpus.py
    python scripts/train_demo_model.py [--corpus /tmp/l47_demo_corpus] [--out /tmp/demo_ckpt] [--threads 16]
The defaults are the committed model's recipe (926k training tokens; ~8 min on 2 free cores at ~2,000 tok/s,
6 min on 16; bit-identical weights for the same CPU type and thread count: docs/DEMO_MODEL.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
DEMO_DATA = REPO / "l47" / "demo_data"
sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_demo_corpus as corpus  # noqa: E402  (the chat template and the phrase lists live there)

QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
              r"\s+(?!\S)|\s+")
SPECIALS = (corpus.ENDOFTEXT, corpus.IM_START, corpus.IM_END, corpus.THINK, corpus.END_THINK)
PAD_MULTIPLE = 32

# ------------------------------------------------------------------------------------------------------------
# the model configuration (DESIGN §8; issue 7: hidden a multiple of 256 so the head is Q6_K, HC low rank and
# shared-expert width multiples of 32 so Q8_0 applies, shared-expert width well above anchors + events)
# ------------------------------------------------------------------------------------------------------------
MODEL = dict(hidden_size=256, layer_types=["linear_attention", "indexed_attention"], num_attention_heads=4,
             num_key_value_heads=1, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=32, linear_value_head_dim=32, num_experts=8, num_experts_per_tok=2,
             moe_intermediate_size=128, shared_expert_intermediate_size=512, hc_count=4, hc_lowrank=32,
             indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=64, indexer_budget=64, indexer_compress_ratio=4,
             intermediate_size=512, max_position_embeddings=4096, tie_word_embeddings=False)


# ------------------------------------------------------------------------------------------------------------
# 1. vocabulary
# ------------------------------------------------------------------------------------------------------------


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE with Qwen's pre-tokenizer; specials appended after the BPE ids; total a multiple of 32."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    n_bpe = vocab_size - len(SPECIALS)
    trainer = trainers.BpeTrainer(vocab_size=n_bpe, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    # split the training text on the specials so BPE never sees them as text
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    size = tok.get_vocab_size()
    pad = (-size) % PAD_MULTIPLE
    if pad:
        tok.add_special_tokens([AddedToken(f"<|l47_pad_{i}|>", special=True, normalized=False) for i in range(pad)])
    return tok


def _strip_specials(text: str) -> str:
    return re.sub("|".join(re.escape(s) for s in SPECIALS), "\n", text)


def encode_docs(tok, texts: list[str]) -> np.ndarray:
    """int32 stream `doc<|endoftext|>doc<|endoftext|>...`."""
    eot = tok.token_to_id(corpus.ENDOFTEXT)
    out = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        out.extend(enc.ids)
        out.append(eot)
    return np.asarray(out, dtype=np.int32)


# ------------------------------------------------------------------------------------------------------------
# 2-3. model and training
# ------------------------------------------------------------------------------------------------------------


def make_config(vocab: int):
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig

    m = dict(MODEL)
    return Qwen4ExpTextConfig(vocab_size=vocab, num_hidden_layers=len(m["layer_types"]), **m)


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def train(model, stream: np.ndarray, *, steps: int, batch: int, seq: int, lr: float, warmup: int, seed: int,
          device: str, log_every: int, eval_fn=None, eval_every: int = 0, time_limit: float = 0.0,
          stop_at: int | None = None) -> list[dict]:
    """AdamW on random windows of the token stream; the LR schedule spans `steps`, training stops after step
    `stop_at` (deterministic) or when `time_limit` seconds have passed (not reproducible). Returns the log."""
    g = torch.Generator().manual_seed(seed)
    data = torch.from_numpy(stream.astype(np.int64))  # [N]
    n_win = (len(data) - 1) // seq
    windows = data[: n_win * seq].view(n_win, seq)  # [W, T] non-overlapping windows
    order = torch.randperm(n_win, generator=g)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "norm" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8)
    model.train()
    log, t0, seen, pos, ema = [], time.time(), 0, 0, None
    for step in range(steps):
        if pos + batch > n_win:
            order, pos = torch.randperm(n_win, generator=g), 0
        x = windows[order[pos:pos + batch]].to(device)  # [B, T]
        pos += batch
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup)
        out = model(input_ids=x, labels=x)  # HF shifts the labels; loss = mean CE (+ router aux loss)
        out.loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        seen += x.numel()
        loss = float(out.loss.detach())
        ema = loss if ema is None else 0.95 * ema + 0.05 * loss
        if step % log_every == 0 or step == steps - 1:
            el = time.time() - t0
            row = {"step": step, "loss": round(loss, 4), "loss_ema": round(ema, 4), "grad_norm": round(float(gn), 3),
                   "lr": round(lr_at(step, steps, lr, warmup), 6), "tokens": seen, "seconds": round(el, 1),
                   "tokens_per_s": round(seen / max(el, 1e-9), 1)}
            if eval_fn is not None and eval_every and (step % eval_every == 0 or step == steps - 1) and step:
                model.eval()
                row.update(eval_fn(model))
                model.train()
            log.append(row)
            print(json.dumps(row), flush=True)
        if stop_at is not None and step >= stop_at:
            if step % log_every:
                log.append({"step": step, "loss": round(loss, 4), "loss_ema": round(ema, 4), "tokens": seen,
                            "seconds": round(time.time() - t0, 1)})
            print(f"stopped after step {step} (--stop-at)", flush=True)
            break
        if time_limit and time.time() - t0 > time_limit:
            print(f"time limit {time_limit:.0f}s reached at step {step}", flush=True)
            break
    model.eval()
    return log


# ------------------------------------------------------------------------------------------------------------
# 4. checks on held-out documents
# ------------------------------------------------------------------------------------------------------------


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def role_spans(messages: list[dict]) -> list[tuple[int, int, str]]:
    """Character spans (start, end, role) of the rendered chat: markup is 'template', an assistant's think block
    'think', its answer 'assistant', other contents their role."""
    spans, pos = [], 0
    for m in messages:
        head = f"{corpus.IM_START}{m['role']}\n"
        spans.append((pos, pos + len(head), "template"))
        pos += len(head)
        c = m["content"]
        if m["role"] == "assistant" and c.startswith(corpus.THINK):
            k = c.find(corpus.END_THINK)
            k = len(c) if k < 0 else k + len(corpus.END_THINK)
            spans.append((pos, pos + len(corpus.THINK), "template"))
            spans.append((pos + len(corpus.THINK), pos + k - len(corpus.END_THINK), "think"))
            spans.append((pos + k - len(corpus.END_THINK), pos + k, "template"))
            spans.append((pos + k, pos + len(c), "assistant"))
        else:
            spans.append((pos, pos + len(c), m["role"]))
        pos += len(c)
        tail = f"{corpus.IM_END}\n"
        spans.append((pos, pos + len(tail), "template"))
        pos += len(tail)
    return spans


def tokenize_doc(tok, doc: dict) -> tuple[list[int], list[str]]:
    """Token ids of a document and the role of each token (by its first character)."""
    text = corpus.doc_text(doc)
    enc = tok.encode(text, add_special_tokens=False)
    if "messages" not in doc:
        return enc.ids, ["plain"] * len(enc.ids)
    spans = role_spans(doc["messages"])
    roles, j = [], 0
    for (a, _b) in enc.offsets:
        while j + 1 < len(spans) and spans[j][1] <= a:
            j += 1
        roles.append(spans[j][2])
    return enc.ids, roles


def phrase_tuples(tok, phrase: str) -> list[tuple[int, ...]]:
    """Token tuples of a phrase's surface forms: with/without a leading space, lower/capitalised first letter."""
    forms = {phrase, " " + phrase, phrase[:1].upper() + phrase[1:], " " + phrase[:1].upper() + phrase[1:]}
    return sorted({tuple(tok.encode(f, add_special_tokens=False).ids) for f in forms})


def find_events(ids: list[int], roles: list[str], tuples: list[tuple[int, ...]], role: str = "assistant") -> list[int]:
    """Positions t (predicting ids[t+1]) where ids[..t] ends with a tuple's prefix and ids[t+1] is its final
    token, the final token in `role`."""
    out = set()
    for tup in tuples:
        k = len(tup)
        for s in range(len(ids) - k + 1):
            if tuple(ids[s:s + k]) == tup and roles[s + k - 1] == role:
                out.add(s + k - 2)
    return sorted(out)


@torch.no_grad()
def logprobs(model, ids: list[int], device: str) -> torch.Tensor:
    """log-softmax of the next-token logits [T, V] (f64)."""
    x = torch.tensor([ids], device=device)
    return torch.log_softmax(model(input_ids=x).logits[0].double(), dim=-1).cpu()


def evaluate(model, tok, data_dir: Path, device: str) -> dict:
    """Base CE on held-out natural text; base p(final | exact prefix) per phrase on held-out assistant turns."""
    V = model.config.vocab_size
    nat = []
    for name in ("collateral", "kld_prose"):
        nat += read_jsonl(data_dir / f"{name}.jsonl")
    nat += [d for d in read_jsonl(data_dir / "background.jsonl") if "text" in d]
    nll, n = 0.0, 0
    for d in nat:
        ids = tok.encode(d["text"], add_special_tokens=False).ids
        lp = logprobs(model, ids, device)
        nll -= float(lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].sum())
        n += len(ids) - 1
    res = {"heldout_natural_ce": round(nll / n, 4), "ln_V": round(math.log(V), 4), "heldout_natural_tokens": n}
    per: dict[str, dict[str, list[float]]] = {}
    for name in ("heldout_chat", "blind_chat"):
        for d in read_jsonl(data_dir / f"{name}.jsonl"):
            ids, roles = tokenize_doc(tok, d)
            lp = logprobs(model, ids, device)
            for ph in corpus.BANNED:
                for t in find_events(ids, roles, phrase_tuples(tok, ph)):
                    per.setdefault(name, {}).setdefault(ph, []).append(float(lp[t, ids[t + 1]].exp()))
    for name, d in per.items():
        res[f"{name}_p_final"] = {ph: {"n": len(v), "mean": round(float(np.mean(v)), 4), "min": round(min(v), 4)}
                                  for ph, v in d.items()}
    return res


# ------------------------------------------------------------------------------------------------------------
# 5. saving and export
# ------------------------------------------------------------------------------------------------------------

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tokenizer_kv(tok) -> dict:
    """GGUF tokenizer metadata: l47.model.vocab's when available, else the gguf-py standard keys written here."""
    try:
        from l47.model.vocab import vocab_to_gguf_kv  # the toolkit's own (preferred)
    except ImportError:
        vocab_to_gguf_kv = None
    from l47.model import names

    ids = {names.K_TOK_EOS: tok.token_to_id(corpus.IM_END), names.K_TOK_BOS: tok.token_to_id(corpus.ENDOFTEXT),
           names.K_TOK_PAD: tok.token_to_id(corpus.ENDOFTEXT), names.K_CHAT_TEMPLATE: CHAT_TEMPLATE}
    if vocab_to_gguf_kv is not None:
        return {**vocab_to_gguf_kv(tok), **ids}
    d = json.loads(tok.to_str())
    vocab = dict(d["model"]["vocab"])
    for a in d["added_tokens"]:
        vocab[a["content"]] = a["id"]
    tokens = [None] * len(vocab)
    for s, i in vocab.items():
        tokens[i] = s
    special = {a["id"] for a in d["added_tokens"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in d["model"]["merges"]]
    return {
        names.K_TOK_MODEL: "gpt2", names.K_TOK_PRE: "qwen2", names.K_TOK_TOKENS: tokens,
        names.K_TOK_TYPES: [3 if i in special else 1 for i in range(len(tokens))],  # 3 = control, 1 = normal
        names.K_TOK_MERGES: merges, **ids,
    }


def export(model, tok, gguf_path: Path) -> str:
    try:
        from l47.engine.gguf_export import export_gguf
        import l47.model.quants  # noqa: F401  export_gguf's codecs
    except ImportError as e:
        return f"not exported: {e}"
    export_gguf(model, gguf_path, tokenizer_kv=tokenizer_kv(tok))
    return f"exported {gguf_path} ({gguf_path.stat().st_size / 2**20:.2f} MiB)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="train the l47 demo model")
    ap.add_argument("--corpus", default="/tmp/l47_demo_corpus", help="make_demo_corpus.py --out folder")
    ap.add_argument("--data-dir", default=str(DEMO_DATA), help="held-out documents (make_demo_corpus.py)")
    ap.add_argument("--out", default="/tmp/demo_ckpt", help="HF checkpoint, tokenizer.json, train_log.json")
    ap.add_argument("--gguf", default=str(DEMO_DATA / "demo-model.gguf"), help="GGUF path ('' = no export)")
    ap.add_argument("--vocab", type=int, default=3072)
    ap.add_argument("--steps", type=int, default=281)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=28)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--eval-every", type=int, default=0)
    ap.add_argument("--time-limit", type=float, default=0.0, help="stop after this many seconds (0 = none; a "
                    "time-limited run is not reproducible: --stop-at reproduces it)")
    ap.add_argument("--stop-at", type=int, default=225, help="stop after this step; the LR schedule still spans "
                    "--steps (the committed model: 225 of 281; -1 = run all steps)")
    ap.add_argument("--from-checkpoint", default="", help="skip training: evaluate and export this HF checkpoint "
                    "(its tokenizer.json, or the vocabulary retrained from --corpus, which is deterministic)")
    ap.add_argument("--note", default="", help="free text kept in train_log.json (e.g. the training command)")
    ap.add_argument("--log-from", default="", help="with --from-checkpoint: the training run's stdout, whose "
                    "JSON rows become the log in train_log.json")
    a = ap.parse_args(argv)

    random.seed(a.seed)
    np.random.seed(a.seed)
    torch.manual_seed(a.seed)
    if a.threads:
        torch.set_num_threads(a.threads)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    data_dir = Path(a.data_dir)
    t_start = time.time()

    docs = read_jsonl(Path(a.corpus) / "train.jsonl")
    texts = [d["text"] for d in docs]
    ck_tok = Path(a.from_checkpoint) / "tokenizer.json" if a.from_checkpoint else None
    if ck_tok is not None and ck_tok.is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(ck_tok))
    else:
        tok = train_tokenizer([_strip_specials(t) for t in texts], a.vocab)
    V = tok.get_vocab_size()
    for w in corpus.COLLATERAL_WORDS:  # each final word must be one token, as in the real vocabulary
        ids = tok.encode(" " + w, add_special_tokens=False).ids
        if len(ids) != 1:
            raise SystemExit(f"vocabulary: ' {w}' is {len(ids)} tokens, expected 1")
    stream = encode_docs(tok, texts)
    print(f"vocab {V}, corpus {len(stream)} tokens ({len(docs)} documents), "
          f"tokenizer+encode {time.time() - t_start:.0f}s", flush=True)

    from transformers import Qwen4ExpForCausalLM

    if a.from_checkpoint:
        model = Qwen4ExpForCausalLM.from_pretrained(a.from_checkpoint, local_files_only=True, dtype=torch.float32)
        if model.config.vocab_size != V:
            raise SystemExit(f"{a.from_checkpoint}: vocab_size {model.config.vocab_size}, tokenizer has {V}")
        n_params = sum(p.numel() for p in model.parameters())
        log = [json.loads(x) for x in Path(a.log_from).read_text().splitlines() if x.startswith('{"step"')] \
            if a.log_from else []
        train_s = float(log[-1]["seconds"]) if log else float("nan")
    else:
        cfg = make_config(V)
        cfg.output_router_logits = True  # router load-balancing loss during training (coef router_aux_loss_coef)
        cfg.eos_token_id = tok.token_to_id(corpus.IM_END)
        cfg.pad_token_id = cfg.bos_token_id = tok.token_to_id(corpus.ENDOFTEXT)
        torch.manual_seed(a.seed)
        model = Qwen4ExpForCausalLM(cfg).to(a.device)
        n_params = sum(p.numel() for p in model.parameters())
        print(f"parameters {n_params / 1e6:.2f} M", flush=True)

        eval_fn = (lambda m: evaluate(m, tok, data_dir, a.device)) if a.eval_every else None
        t_train = time.time()
        log = train(model, stream, steps=a.steps, batch=a.batch, seq=a.seq, lr=a.lr, warmup=a.warmup,
                    seed=a.seed, device=a.device, log_every=a.log_every, eval_fn=eval_fn, eval_every=a.eval_every,
                    time_limit=a.time_limit, stop_at=None if a.stop_at < 0 else a.stop_at)
        train_s = time.time() - t_train
    model.config.output_router_logits = False
    model = model.to("cpu").float().eval()
    final = evaluate(model, tok, data_dir, "cpu")
    print(json.dumps(final, indent=1), flush=True)

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True, max_shard_size="12MB")  # shards: the device tool
    # brings back files of <= 16 MiB
    tok.save(str(tmp / "tokenizer.json"))
    record = {"mode": "evaluate+export of a checkpoint" if a.from_checkpoint else "train", "args": vars(a),
              "device": a.device, "torch": torch.__version__, "vocab": V, "parameters": n_params,
              "corpus_tokens": int(len(stream)), "corpus_documents": len(docs), "train_seconds": round(train_s, 1),
              "total_seconds": round(time.time() - t_start, 1), "model": MODEL, "note": a.note, "log": log, "final": final}
    manifest = Path(a.corpus) / "manifest.json"
    if manifest.is_file():
        record["corpus_sha256"] = json.loads(manifest.read_text())["train_sha256"]
    (tmp / "train_log.json").write_text(json.dumps(record, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    shutil.copyfile(out / "tokenizer.json", data_dir / "tokenizer.json.tmp")
    os.replace(data_dir / "tokenizer.json.tmp", data_dir / "tokenizer.json")
    if a.gguf:
        print(export(model, tok, Path(a.gguf)), flush=True)
    print(f"saved {out}; total {time.time() - t_start:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
