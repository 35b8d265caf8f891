"""Every GGUF key, tensor name and transformers name the toolkit uses — the one name table.

qwen4exp has no entry in gguf-py's constants, so the project keeps its own (DESIGN §1, §8). Tensor names
follow llama.cpp's conventions (`blk.{L}.ffn_down_shexp.weight`, `output.weight`); the hyper-connection
tensors use the `hc_attn_*` / `hc_ffn_*` / `output_hc_*` family seen in the public qwen4exp files.

Dimension order: GGUF stores `ne` fastest-first; everything in this project uses the *logical* torch/numpy
order `[rows, cols]` (= reversed `ne`). The flip happens in exactly one place: `l47.model.gguf_io`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ARCH = "qwen4exp"

# --- metadata keys --------------------------------------------------------------------------------------
KEY_ARCH = "general.architecture"
KEY_ALIGNMENT = "general.alignment"
KEY_NAME = "general.name"
DEFAULT_ALIGNMENT = 32


def key(suffix: str, arch: str = ARCH) -> str:
    """`{arch}.{suffix}` — an architecture-scoped metadata key."""
    return f"{arch}.{suffix}"


K_BLOCK_COUNT = "block_count"
K_EMBED = "embedding_length"
K_SHEXP_FF = "expert_shared_feed_forward_length"
K_EXPERT_FF = "expert_feed_forward_length"
K_EXPERT_COUNT = "expert_count"
K_EXPERT_USED = "expert_used_count"
K_HC_COUNT = "hyper_connection.count"
K_HC_LOWRANK = "hyper_connection.lowrank"
K_RMS_EPS = "attention.layer_norm_rms_epsilon"
K_VOCAB = "vocab_size"
K_HF_CONFIG = "l47.hf_config"  # JSON of the transformers config, written by our own GGUF exporter

# tokenizer metadata (gguf-py standard keys)
K_TOK_MODEL = "tokenizer.ggml.model"
K_TOK_PRE = "tokenizer.ggml.pre"
K_TOK_TOKENS = "tokenizer.ggml.tokens"
K_TOK_TYPES = "tokenizer.ggml.token_type"
K_TOK_MERGES = "tokenizer.ggml.merges"
K_TOK_EOS = "tokenizer.ggml.eos_token_id"
K_TOK_BOS = "tokenizer.ggml.bos_token_id"
K_TOK_PAD = "tokenizer.ggml.padding_token_id"
K_CHAT_TEMPLATE = "tokenizer.chat_template"

# provenance keys written into a bundle (the only metadata a bundle may add or change)
PROVENANCE_PREFIX = "l47.provenance."

# --- special tokens (text form; ids are always read from the model's vocabulary) -----------------------
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"
THINK = "<think>"
END_THINK = "</think>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, THINK, END_THINK)

# --- roles of a target token (dump `role` array) --------------------------------------------------------
ROLES = ("template", "system", "user", "assistant", "think", "tool")
ROLE_ID = {name: i for i, name in enumerate(ROLES)}

# --- tensors --------------------------------------------------------------------------------------------
# role: what the tensor is in the tail forward (None = not used by the tail forward)


@dataclass(frozen=True)
class TensorName:
    gguf: str  # may contain {L}
    hf: str  # transformers state_dict name, may contain {L}
    role: str | None  # role in the tail forward, or None
    note: str = ""


# Global tensors.
TOKEN_EMBD = TensorName("token_embd.weight", "model.embed_tokens.weight", None)
OUTPUT = TensorName("output.weight", "lm_head.weight", "head", "[V, n]; Q6_K in the seed's file")
OUTPUT_SCALE = TensorName("output.scale", "", "head_scale", "some quant formats: multiplies the logits")
OUTPUT_HC_NORM = TensorName(
    "output_hc_norm.weight", "model.hyper_connection_mixer.hc_norm.weight", "onorm",
    "F32, folded 1+w in GGUF (HF stores w); [hc*n] or [n, hc]-as-ne, stream-major",
)
OUTPUT_HC_DOWN = TensorName(
    "output_hc_down.weight", "model.hyper_connection_mixer.input_mix_weight_down.weight", "odown",
    "[r(+extra), hc*n]; rows 0..r-1 used",
)
OUTPUT_HC_UP = TensorName("output_hc_up.weight", "model.hyper_connection_mixer.input_mix_weight_up.weight", "oup",
                          "[hc*n, r]")

# Per-layer tensors.
_L = "model.layers.{L}."
ATTN_HC_NORM = TensorName("blk.{L}.hc_attn_norm.weight", _L + "attn_hyper_connection.hc_norm.weight", None)
ATTN_HC_DOWN = TensorName("blk.{L}.hc_attn_down.weight", _L + "attn_hyper_connection.input_mix_weight_down.weight", None)
ATTN_HC_UP = TensorName("blk.{L}.hc_attn_up.weight", _L + "attn_hyper_connection.input_mix_weight_up.weight", None)
ATTN_HC_INJECT = TensorName("blk.{L}.hc_attn_inject.weight", _L + "attn_hyper_connection.block_inject_weight.weight", None)
FFN_HC_NORM = TensorName("blk.{L}.hc_ffn_norm.weight", _L + "mlp_hyper_connection.hc_norm.weight", None)
FFN_HC_DOWN = TensorName("blk.{L}.hc_ffn_down.weight", _L + "mlp_hyper_connection.input_mix_weight_down.weight", None)
FFN_HC_UP = TensorName("blk.{L}.hc_ffn_up.weight", _L + "mlp_hyper_connection.input_mix_weight_up.weight", None)
FFN_HC_INJECT = TensorName("blk.{L}.hc_ffn_inject.weight", _L + "mlp_hyper_connection.block_inject_weight.weight", None)
# Some files merge the inject rows into the down projection: rows r..r+hc-1 of this tensor.
FFN_HC_DOWN_INJECT = TensorName("blk.{L}.hc_ffn_down_inject.weight", "", None, "merged: rows 0..r-1 down, r..r+hc-1 inject")
FFN_GATE_INP = TensorName("blk.{L}.ffn_gate_inp.weight", _L + "mlp.gate.weight", None, "router")
FFN_GATE_UP_EXPS = TensorName("blk.{L}.ffn_gate_up_exps.weight", _L + "mlp.experts.gate_up_proj", None)
FFN_DOWN_EXPS = TensorName("blk.{L}.ffn_down_exps.weight", _L + "mlp.experts.down_proj", None)
FFN_GATE_SHEXP = TensorName("blk.{L}.ffn_gate_shexp.weight", _L + "mlp.shared_expert.gate_proj.weight", None)
FFN_UP_SHEXP = TensorName("blk.{L}.ffn_up_shexp.weight", _L + "mlp.shared_expert.up_proj.weight", None)
FFN_DOWN_SHEXP = TensorName(
    "blk.{L}.ffn_down_shexp.weight", _L + "mlp.shared_expert.down_proj.weight", "W_sd",
    "[n, f]; THE edited tensor (Q8_0 in the seed's file)",
)
FFN_GATE_INP_SHEXP = TensorName("blk.{L}.ffn_gate_inp_shexp.weight", _L + "mlp.shared_expert_gate.weight", None,
                                "shared-expert gate [1, n]")
# attention (indexed / full)
ATTN_Q = TensorName("blk.{L}.attn_q.weight", _L + "self_attn.q_proj.weight", None)
ATTN_K = TensorName("blk.{L}.attn_k.weight", _L + "self_attn.k_proj.weight", None)
ATTN_V = TensorName("blk.{L}.attn_v.weight", _L + "self_attn.v_proj.weight", None)
ATTN_O = TensorName("blk.{L}.attn_output.weight", _L + "self_attn.o_proj.weight", None)
ATTN_Q_NORM = TensorName("blk.{L}.attn_q_norm.weight", _L + "self_attn.q_norm.weight", None)
ATTN_K_NORM = TensorName("blk.{L}.attn_k_norm.weight", _L + "self_attn.k_norm.weight", None)
IDX_QK = TensorName("blk.{L}.indexer_qk.weight", _L + "self_attn.indexer.index_qk_proj.weight", None)
IDX_Q_NORM = TensorName("blk.{L}.indexer_q_norm.weight", _L + "self_attn.indexer.q_layernorm.weight", None)
IDX_K_NORM = TensorName("blk.{L}.indexer_k_norm.weight", _L + "self_attn.indexer.k_layernorm.weight", None)
# linear attention (gated delta net)
SSM_DT_BIAS = TensorName("blk.{L}.ssm_dt.bias", _L + "linear_attn.dt_bias", None)
SSM_A_LOG = TensorName("blk.{L}.ssm_a_log", _L + "linear_attn.A_log", None)
SSM_CONV = TensorName("blk.{L}.ssm_conv1d.weight", _L + "linear_attn.conv1d.weight", None)
SSM_NORM = TensorName("blk.{L}.ssm_norm.weight", _L + "linear_attn.norm.weight", None)
SSM_OUT = TensorName("blk.{L}.ssm_out.weight", _L + "linear_attn.out_proj.weight", None)
SSM_QKV = TensorName("blk.{L}.attn_qkv.weight", _L + "linear_attn.in_proj_qkv.weight", None)
SSM_Z = TensorName("blk.{L}.attn_gate.weight", _L + "linear_attn.in_proj_z.weight", None)
SSM_B = TensorName("blk.{L}.ssm_beta.weight", _L + "linear_attn.in_proj_b.weight", None)
SSM_A = TensorName("blk.{L}.ssm_alpha.weight", _L + "linear_attn.in_proj_a.weight", None)

GLOBAL_TENSORS = (TOKEN_EMBD, OUTPUT, OUTPUT_HC_NORM, OUTPUT_HC_DOWN, OUTPUT_HC_UP)
LAYER_TENSORS = (
    ATTN_HC_NORM, ATTN_HC_DOWN, ATTN_HC_UP, ATTN_HC_INJECT, FFN_HC_NORM, FFN_HC_DOWN, FFN_HC_UP, FFN_HC_INJECT,
    FFN_GATE_INP, FFN_GATE_UP_EXPS, FFN_DOWN_EXPS, FFN_GATE_SHEXP, FFN_UP_SHEXP, FFN_DOWN_SHEXP,
    FFN_GATE_INP_SHEXP, ATTN_Q, ATTN_K, ATTN_V, ATTN_O, ATTN_Q_NORM, ATTN_K_NORM, IDX_QK, IDX_Q_NORM,
    IDX_K_NORM, SSM_DT_BIAS, SSM_A_LOG, SSM_CONV, SSM_NORM, SSM_OUT, SSM_QKV, SSM_Z, SSM_B, SSM_A,
)

# Norm weights: HF stores w and multiplies by (1 + w); GGUF stores the folded 1 + w (F32).
FOLDED_NORMS = {ATTN_HC_NORM.gguf, FFN_HC_NORM.gguf, OUTPUT_HC_NORM.gguf}


def gguf_name(t: TensorName, layer: int | None = None) -> str:
    return t.gguf.format(L=layer) if "{L}" in t.gguf else t.gguf


def hf_name(t: TensorName, layer: int | None = None) -> str:
    return t.hf.format(L=layer) if "{L}" in t.hf else t.hf


def hf_to_gguf_map(n_layers: int) -> dict[str, str]:
    """transformers state_dict name → GGUF tensor name, for every tensor the table knows."""
    out = {t.hf: t.gguf for t in GLOBAL_TENSORS}
    for L in range(n_layers):
        for t in LAYER_TENSORS:
            if t.hf:
                out[hf_name(t, L)] = gguf_name(t, L)
    return out


_BLK = re.compile(r"^blk\.(\d+)\.")


def layer_of(gguf_tensor_name: str) -> int | None:
    m = _BLK.match(gguf_tensor_name)
    return int(m.group(1)) if m else None


def is_folded_norm(gguf_tensor_name: str) -> bool:
    generic = _BLK.sub("blk.{L}.", gguf_tensor_name)
    return generic in FOLDED_NORMS or gguf_tensor_name in FOLDED_NORMS


def target_tensor(layer: int) -> str:
    """The one tensor the product edits: layer L's shared-expert down projection."""
    return gguf_name(FFN_DOWN_SHEXP, layer)
