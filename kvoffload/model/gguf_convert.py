"""Dequantise a llama-architecture GGUF file into a bf16 HuggingFace folder (config.json, model.safetensors,
tokenizer). Done once per machine; the folder is written under a temporary name and renamed when complete."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch

GGUF_TO_HF = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _field(reader, key: str):
    return reader.fields[key].contents()


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp interleaves the two RoPE halves of q/k rows; HF keeps them as halves. Undo it."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")  # "blk.3.attn_q", "weight"
    if base.startswith("blk."):
        _, idx, part = base.split(".", 2)
        return f"model.layers.{idx}.{GGUF_TO_HF[part]}.{suffix}"
    return f"{GGUF_TO_HF[base]}.{suffix}"


def gguf_to_hf_folder(gguf_path: Path, out: Path) -> None:
    import gguf
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    reader = gguf.GGUFReader(str(gguf_path))
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{gguf_path.name}: architecture {arch!r}, only llama is supported")
    n_head = int(_field(reader, "llama.attention.head_count"))
    n_kv = int(_field(reader, "llama.attention.head_count_kv"))
    hidden = int(_field(reader, "llama.embedding_length"))
    state = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if t.name.endswith("attn_q.weight"):
            w = unpermute_qk(w, n_head)
        elif t.name.endswith("attn_k.weight"):
            w = unpermute_qk(w, n_kv)
        state[hf_name(t.name)] = torch.from_numpy(np.ascontiguousarray(w)).to(torch.bfloat16)
    tied = "lm_head.weight" not in state
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": hidden // n_head,
        "vocab_size": state["model.embed_tokens.weight"].shape[0],
        "rope_theta": float(_field(reader, "llama.rope.freq_base")),
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(_field(reader, "llama.context_length")),
        "tie_word_embeddings": tied,
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id")),
        "torch_dtype": "bfloat16",
        "source": f"dequantised from {gguf_path.name} by kvoffload.model.gguf_convert",
    }
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(state, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(str(tmp))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
