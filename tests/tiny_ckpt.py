"""A tiny transformers qwen4exp checkpoint FOLDER as a newcomer brings one: config.json + model.safetensors + its
own tokenizer.json (byte-level BPE, Qwen2 pre-tokenizer) with the five chat special tokens at ids 0–4 (not at the
end, as the demo's and Qwen's are), and a config vocabulary (default 4,000) larger than the tokenizer's, as real
checkpoints pad their head rows."""

from __future__ import annotations

import json
from pathlib import Path

from tiny_hf import tiny_model

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")

CORPUS = """The river town kept its old bridge. Rather than rebuild it, the council repaired each stone.
How long should I boil an egg? About 7 minutes for a firm yolk, then cool it right away.
You are a helpful assistant. A soft egg or a hard one? The road ran end to end again.
Numbers like 12, 345 and 1904 appear in tables; towers, arches and one toll gate.
नमस्ते किताब किताबें हिन्दी ि ी ु — combining marks e\u0301 a\u0308 and more text than that.
def f(x): return x * 2 + 1  # a comment; print("hello, world!") {"name": "search"}
"""


def train_tokenizer(specials=SPECIALS, pre: str = "qwen2", vocab_size: int = 700, byte_level_regex: bool = False,
                    texts=None, special_ids: dict[str, int] | None = None):
    """tokenizers BPE trained on `texts` (default CORPUS); `specials` first (ids 0..len-1), or at `special_ids`
    ({token: id}, anywhere in the vocabulary: `place_specials`); Qwen Split regex + ByteLevel, or GPT-2's
    ByteLevel(use_regex=True) alone when byte_level_regex (a pre-tokenizer l47 cannot detect)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from l47.model.vocab import qwen_pre_tokenizer

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False) if byte_level_regex else \
        qwen_pre_tokenizer(pre)
    tk.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials),
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(list(texts) if texts is not None else [CORPUS] * 8, tr)
    return place_specials(tk, special_ids) if special_ids else tk


def place_specials(tk, special_ids: dict[str, int]):
    """The same tokenizer with its added special tokens moved to the ids `special_ids` gives; every other token
    keeps its order and fills the remaining ids (the BPE merges name tokens by string, so they stay valid)."""
    from tokenizers import Tokenizer

    d = json.loads(tk.to_str())
    added = {a["content"]: a for a in d["added_tokens"]}
    assert set(special_ids) <= set(added), sorted(set(special_ids) - set(added))
    size = tk.get_vocab_size()
    assert sorted(special_ids.values()) == sorted(set(special_ids.values())) and max(special_ids.values()) < size
    old = sorted(tk.get_vocab().items(), key=lambda kv: kv[1])  # [(token, id)] by id
    rest = iter(i for i in range(size) if i not in set(special_ids.values()))
    new = {t: special_ids[t] if t in special_ids else next(rest) for t, _ in old}  # token -> new id
    d["model"]["vocab"] = {t: i for t, i in new.items() if t in d["model"]["vocab"]}
    for a in d["added_tokens"]:
        a["id"] = new[a["content"]]
    out = Tokenizer.from_str(json.dumps(d))
    assert all(out.token_to_id(t) == i for t, i in special_ids.items())
    return out


def save_checkpoint(path: Path, *, vocab: int = 4000, seed: int = 0, tokenizer=None, **kw) -> Path:
    """Write the folder; kw go to tiny_hf.tiny_config (layers, hidden, shared, lowrank, num_experts, ...)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = tiny_model(seed=seed, vocab=vocab, **kw)
    model.save_pretrained(path)
    tk = tokenizer if tokenizer is not None else train_tokenizer()
    tk.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for m in messages %}"
                                                            "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                                                            "<|im_end|>\n{% endfor %}"}))
    return path
