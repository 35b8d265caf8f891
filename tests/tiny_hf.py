"""A tiny random transformers Qwen4Exp (the independent reference) and hooks capturing layer L's states.

HF initialises norm weights to zero and the gates tiny; we give them O(1) random values so |inj| ≫ 4 and every
convention (the /hc inside the inject sigmoid, the (1 + w) norm fold, stream-major flattening) changes the logits.
"""

from __future__ import annotations

import torch
from transformers import Qwen4ExpForCausalLM
from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig


def tiny_config(vocab: int = 1024, hidden: int = 256, layers: int = 3, shared: int = 64, lowrank: int = 32,
                **kw) -> Qwen4ExpTextConfig:
    types = ["linear_attention"] * (layers - 1) + ["indexed_attention"]
    base = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, layer_types=types,
                num_attention_heads=2, num_key_value_heads=1, head_dim=32, linear_num_key_heads=2,
                linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=shared,
                hc_count=4, hc_lowrank=lowrank, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=32,
                indexer_budget=64, indexer_compress_ratio=4, intermediate_size=64)
    base.update(kw)
    return Qwen4ExpTextConfig(**base)


@torch.no_grad()
def perturb(model: Qwen4ExpForCausalLM, seed: int = 0, norm_std: float = 0.3, gate_std: float = 0.3) -> None:
    """Give norms, gates and inject weights O(1) random values (HF's init leaves them ~0)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name:
            p.copy_(torch.randn(p.shape, generator=g) * norm_std)
        elif "block_inject_weight" in name or "shared_expert_gate" in name or name.endswith("mlp.gate.weight"):
            p.copy_(torch.randn(p.shape, generator=g) * gate_std)
        elif name == "lm_head.weight" or "shared_expert." in name:
            p.mul_(8.0)  # logits O(1–10), and a shared expert whose write is not negligible next to R


def tiny_model(seed: int = 0, **kw) -> Qwen4ExpForCausalLM:
    torch.manual_seed(seed)
    m = Qwen4ExpForCausalLM(tiny_config(**kw)).eval()
    perturb(m, seed)
    return m


@torch.no_grad()
def capture(model: Qwen4ExpForCausalLM, ids: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Run `ids` [T] through the model; return layer L's (R, inj, hh, sgv, yr) and the logits [T, V]."""
    L = model.config.num_hidden_layers - 1
    layer = model.model.layers[L]
    hc, n = model.config.hc_count, model.config.hidden_size
    got: dict[str, torch.Tensor] = {}
    hooks = [
        layer.mlp_hyper_connection.register_forward_hook(
            lambda m, i, o: got.__setitem__("R", o[1][0].reshape(-1, hc, n).clone())),
        layer.mlp_hyper_connection.block_inject_weight.register_forward_hook(
            lambda m, i, o: got.__setitem__("inj", o[0].clone())),
        layer.mlp.shared_expert.down_proj.register_forward_pre_hook(
            lambda m, i: got.__setitem__("hh", i[0].clone())),
        layer.mlp.shared_expert_gate.register_forward_hook(lambda m, i, o: got.__setitem__("sgv", o[:, 0].clone())),
        layer.mlp.experts.register_forward_hook(lambda m, i, o: got.__setitem__("yr", o.clone())),
    ]
    try:
        logits = model(ids[None]).logits[0].float()
    finally:
        for h in hooks:
            h.remove()
    return got, logits
