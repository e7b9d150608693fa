"""A lean decoder for the Llama and Qwen2 families (gpt-fast style). Module names mirror HuggingFace's so a
checkpoint's state dict loads as it is. Prefill attends densely over the prompt, a chunk of queries at a time,
and hands each layer's K/V to the KV system; decode asks the KV system for attention, one layer at a time."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kvoffload.kernels.dense_ops import rms_norm, rms_norm_pair, rope, silu_mul
from kvoffload.kernels.gemv import linear, linear_pair, linear_silu_mul
from kvoffload.kv.interface import KVOffloadSystem
from kvoffload.model.chunk_attention import causal_attention
from kvoffload.model.config import ModelConfig
from kvoffload.model.rope import Rotary, apply_rotary

# Prefill runs a layer over at most this many tokens at a time (Decoder.prefill_chunk, the run's `prefill_chunk`):
# q, the attention output and the MLP's intermediates exist for one chunk only. At 128K tokens an unchunked
# Llama-3-8B MLP intermediate alone is 3.7 GB, and q and the attention output 1 GB each.
PREFILL_CHUNK = 8192


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)[0]

    def add_and_norm(self, x: torch.Tensor, add: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (norm(x + add), x + add): the residual addition and the next norm in one kernel (add None: x)."""
        return rms_norm(x, self.weight, self.eps, add)


class Attention(nn.Module):
    """q, k and v come from one fused projection (HF's three are concatenated at load, see fuse_hf_state): one
    GEMV per decode step instead of three."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, bias = cfg.head_dim, cfg.attention_bias
        self.qkv_proj = nn.Linear(cfg.hidden_size, (cfg.num_heads + 2 * cfg.num_kv_heads) * d, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, cfg.hidden_size, bias=False)
        self.h, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, d

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x: [B, T, hidden] -> post-RoPE q [B, H, T, D], post-RoPE k and v [B, Hkv, T, D]."""
        b, t, _ = x.shape
        y = self.qkv_proj(x).view(b, t, -1, self.d).transpose(1, 2)
        q, k, v = y.split([self.h, self.hkv, self.hkv], dim=1)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def decode_qkv(self, x: torch.Tensor, position: torch.Tensor, inv_freq: torch.Tensor):
        """One decode step: x [B, 1, hidden] (normed) -> q [B, H, D], k and v [B, Hkv, D], RoPE'd at position[0]
        in place (one kernel for q and k)."""
        y = linear(x, self.qkv_proj.weight, self.qkv_proj.bias).view(x.shape[0], -1, self.d)
        y = rope(y, self.h + self.hkv, position, inv_freq)
        return tuple(t.contiguous() for t in y.split([self.h, self.hkv, self.hkv], dim=1))  # views when B = 1

    def query_weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """W_Q and its bias: the q rows of the fused projection (the speculative query's, docs/systems.md)."""
        n, bias = self.h * self.d, self.qkv_proj.bias
        return self.qkv_proj.weight[:n], None if bias is None else bias[:n]


class MLP(nn.Module):
    """gate and up in one fused projection (concatenated at load): one GEMV and one SiLU-multiply kernel, and at
    one decode row a single kernel for both (`decode`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x)))

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """One decode step's MLP: at one row, two GEMV kernels (gate/up with the SiLU-multiply, then down)."""
        return linear(linear_silu_mul(x, self.gate_up_proj.weight), self.down_proj.weight)


# HF's separate projections and the fused one each group is loaded into (gpt-fast's wqkv, vLLM's qkv_proj)
FUSED_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def fuse_hf_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A HF Llama/Qwen2 state dict -> ours, in place: each group of projections concatenated into its fused one.
    Keys already fused, or groups with a part missing, are left as they are (load_state_dict then reports them)."""
    layers = {k.rsplit(".", 3)[0] for k in state if k.endswith((".self_attn.q_proj.weight", ".mlp.gate_proj.weight"))}
    for layer in layers:  # "model.layers.3"
        for fused, parts in FUSED_PROJECTIONS.items():
            for kind in ("weight", "bias"):
                names = [f"{layer}.{p}.{kind}" for p in parts]
                if all(n in state for n in names):
                    state[f"{layer}.{fused}.{kind}"] = torch.cat([state.pop(n) for n in names])
    return state


class Layer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def prefill(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary, chunk: int):
        """The layer over the whole prompt, in place on x [B, T, hidden], `chunk` tokens at a time -> post-RoPE k, v
        [B, Hkv, T, D] of every token. A chunk's attention and MLP run before the next chunk's projections: its
        queries need only the keys up to its own end, and its rows of x nothing of the chunks after it."""
        attn = self.self_attn
        b, t, _ = x.shape
        k, v = x.new_empty(b, attn.hkv, t, attn.d), x.new_empty(b, attn.hkv, t, attn.d)
        for s in range(0, t, chunk):
            e = min(s + chunk, t)
            xc = x[:, s:e]  # a view: the residual additions below write into x
            cos, sin = rotary.cos_sin(positions[s:e], x.dtype)
            q, k[:, :, s:e], v[:, :, s:e] = attn.qkv(self.input_layernorm(xc), cos, sin)
            o = causal_attention(q, k[:, :, :e], v[:, :, :e], s)
            del q
            xc += attn.o_proj(o.transpose(1, 2).flatten(2))
            del o
            # the MLP (the widest temporaries, 4 x intermediate per token) one sequence's chunk at a time: its
            # bytes alive are bounded by the chunk, not by batch x chunk (16x fewer at BSZ 16)
            for row in xc:
                row += self.mlp(self.post_attention_layernorm(row))
        return k, v

    def decode_mlp(self, x: torch.Tensor, o: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step after attention: x [B, 1, hidden] the layer's input, o [B, H, D] its attention output
        -> (x + o_proj(o), the MLP's output). The MLP's residual addition is left to the next norm's kernel."""
        o = linear(o.reshape(o.shape[0], 1, -1), self.self_attn.o_proj.weight)
        h, x = self.post_attention_layernorm.add_and_norm(x, o)
        return x, self.mlp.decode(h)

    def decode_inputs(
        self,
        x: torch.Tensor,
        add: torch.Tensor | None,
        position: torch.Tensor,
        inv_freq: torch.Tensor,
        nxt: Layer | None = None,
    ) -> tuple:
        """One decode step into this layer's attention: x [B, 1, hidden] plus `add` (the previous layer's MLP output, or
        None) -> (x + add, q [B, H, D], k, v [B, Hkv, D], q_spec [B, H, D] or None), RoPE'd at position[0]. With `nxt`,
        q_spec is the next layer's speculative query from the same input (docs/systems.md, "Speculative query":
        RoPE(W_Q^{l+1} RMSNorm_{l+1}(x))), made beside q/k/v: both norms in one kernel, both projections written into
        one buffer (linear_pair), one RoPE launch for q_spec, q and k."""
        attn, norm = self.self_attn, self.input_layernorm
        if nxt is None:
            h, x = norm.add_and_norm(x, add)
            return (x, *attn.decode_qkv(h, position, inv_freq), None)
        h, x, h_next = rms_norm_pair(x, norm.weight, nxt.input_layernorm.weight, norm.eps, add)
        spec = nxt.self_attn
        y = linear_pair(h_next, *spec.query_weights(), h, attn.qkv_proj.weight, attn.qkv_proj.bias)
        y = rope(y.view(x.shape[0], -1, attn.d), spec.h + attn.h + attn.hkv, position, inv_freq)
        q_spec, q, k, v = (t.contiguous() for t in y.split([spec.h, attn.h, attn.hkv, attn.hkv], dim=1))
        return x, q, k, v, q_spec


class Body(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Body(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._rotary: Rotary | None = None
        self.prefill_chunk = PREFILL_CHUNK  # the runner sets the run's `prefill_chunk`
        # Optional synthetic query process (experiments.workloads.query_process) replacing the queries the KV system
        # sees.
        self.query_process = None
        # Optional synthetic key process (experiments.workloads.key_process): Decoder.fill's keys, for synthetic
        # weights.
        self.key_process = None
        # a HF checkpoint's state dict loads as it is: its q/k/v and gate/up projections are fused on the way in
        self.register_load_state_dict_pre_hook(lambda module, state, *_: fuse_hf_state(state))

    def rotary(self) -> Rotary:
        dev = self.lm_head.weight.device
        if self._rotary is None or self._rotary.inv_freq.device != dev:
            self._rotary = Rotary(self.cfg, dev)
        return self._rotary

    @torch.inference_mode()
    def prefill(
        self,
        tokens: torch.Tensor,
        kv: KVOffloadSystem,
        all_logits: bool = False,
        on_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """tokens [B, T] -> logits of the last position [B, V] (or of every position [B, T, V]). Alive at once: the
        residual stream x, one layer's K/V of the whole prompt and one chunk's q, attention output and MLP
        temporaries (experiments.runner.preflight.prefill_peak_bytes counts them)."""
        t = tokens.shape[1]
        x = self.model.embed_tokens(tokens)
        positions = torch.arange(t, device=tokens.device)
        for i, layer in enumerate(self.model.layers):
            k, v = layer.prefill(x, positions, self.rotary(), self.prefill_chunk)
            kv.prefill(i, k, v)
            del k, v
            if on_layer is not None:
                on_layer(i)
        kv.end_prefill(t)
        if all_logits:
            return self._chunked_logits(x)
        return self.lm_head(self.model.norm(x[:, -1])).float()

    @torch.inference_mode()
    def fill(
        self, tokens: torch.Tensor, kv: KVOffloadSystem, on_layer: Callable[[int], None] | None = None
    ) -> torch.Tensor:
        """A KV cache for decode-throughput runs without the prompt's attention and MLP (experiments'
        workload.kv_fill=projection): each layer's K/V are that layer's own K/V projection (RMSNorm, W_K / W_V,
        RoPE) of the prompt's token embeddings, handed to the system's prefill as Decoder.prefill does, so its
        own prefill work (offload, hash encoding, clustering) runs as usual. tokens [B, T] -> the last position's
        logits from its embedding alone [B, V]. With a key_process (workload.kv_fill=key_process) the keys are
        drawn from it instead, a chunk at a time, after the projections' temporaries are gone. Alive at once: one
        layer's K/V of the whole prompt, the system's staged copy of them, and one sequence's chunk of embeddings
        and projections or drawn keys (experiments.runner.preflight.fill_peak_bytes)."""
        b, t = tokens.shape
        positions = torch.arange(t, device=tokens.device)
        for i, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            k = torch.empty(b, attn.hkv, t, attn.d, device=tokens.device, dtype=self.lm_head.weight.dtype)
            v = torch.empty_like(k)
            for s in range(0, t, self.prefill_chunk):
                e = min(s + self.prefill_chunk, t)
                cos, sin = self.rotary().cos_sin(positions[s:e], k.dtype)
                for r in range(b):  # one sequence's chunk at a time: temporaries bounded by the chunk
                    x = layer.input_layernorm(self.model.embed_tokens(tokens[r : r + 1, s:e]))
                    _, k[r : r + 1, :, s:e], v[r : r + 1, :, s:e] = attn.qkv(x, cos, sin)
                    del x
            if self.key_process is not None:
                self.key_process.fill(i, k, self.prefill_chunk)
            kv.prefill(i, k, v)
            del k, v
            if on_layer is not None:
                on_layer(i)
        kv.end_prefill(t)
        return self.lm_head(self.model.norm(self.model.embed_tokens(tokens[:, -1]))).float()

    def _chunked_logits(self, x: torch.Tensor) -> torch.Tensor:
        c = self.prefill_chunk
        return torch.cat([self.lm_head(self.model.norm(x[:, s : s + c])).float() for s in range(0, x.shape[1], c)], 1)

    @torch.inference_mode()
    def decode(self, token: torch.Tensor, position: torch.Tensor, kv: KVOffloadSystem) -> torch.Tensor:
        """One step for every sequence of the batch. token [B] at position ([1] long, on the model's device;
        a tensor so that the step can be replayed from a CUDA graph) -> logits [B, V]."""
        x = o = None
        for i in range(self.cfg.num_layers):
            x, q, k, v, q_spec = self.dense_segment(i, token, x, o, position, kv.wants_speculative_query)
            o = self.attend(i, q, k, v, q_spec, kv)
        return self.dense_segment(self.cfg.num_layers, token, x, o, position, False)[0]

    def dense_segment(
        self,
        i: int,
        token: torch.Tensor,
        x: torch.Tensor | None,
        o: torch.Tensor | None,
        position: torch.Tensor,
        speculative: bool,
    ) -> tuple:
        """The model's own work between attention i-1 and attention i, which touches no KV system: layer i-1's o_proj
        and MLP (or the embedding, for i = 0), then layer i's q, k, v and, with `speculative`, layer i+1's query from
        layer i's input (docs/systems.md, "Speculative query"). Returns (x, q [B, H, D], k, v [B, Hkv, D],
        q_spec [B, H, D] or None); for i = num_layers, (logits [B, V],). x [B, 1, hidden] is layer i-1's input,
        o [B, H, D] its attention output."""
        layers = self.model.layers
        if i == 0:
            x, add = self.model.embed_tokens(token)[:, None, :], None  # [B, 1, hidden]
        else:
            x, add = layers[i - 1].decode_mlp(x, o)
        if i == len(layers):
            return (linear(self.model.norm.add_and_norm(x, add)[0], self.lm_head.weight)[:, 0].float(),)
        nxt = layers[i + 1] if speculative and i + 1 < len(layers) else None
        return layers[i].decode_inputs(x, add, position, self.rotary().inv_freq, nxt)

    def attend(
        self,
        i: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_spec: torch.Tensor | None,
        kv: KVOffloadSystem,
    ) -> torch.Tensor:
        """Layer i's attention by the KV system -> [B, H, D]. With a speculative query, layer i+1's lookups and
        transfers are started first, so that they overlap layer i's work."""
        q, q_next = self.attention_queries(i, q, q_spec, kv.wants_speculative_query)
        if q_next is not None:
            kv.prepare(i + 1, q_next)
        return kv.decode(i, q, k, v)

    def attention_queries(
        self, i: int, q: torch.Tensor, q_spec: torch.Tensor | None, wants_speculative: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(layer i's query, layer i+1's speculative query or None) as the KV system sees them: through the
        synthetic query process when there is one. Touches no KV system, so kvoffload.piecewise captures it
        with the dense work (it is a workload's cost, not a system's)."""
        q_next = None if q_spec is None else self._query(i + 1, q_spec, advance=True, speculative=True)
        advance = not (wants_speculative and i > 0)  # layers 1.. advanced at their prepare
        return self._query(i, q, advance), q_next

    def _query(self, layer: int, q: torch.Tensor, advance: bool, speculative: bool = False) -> torch.Tensor:
        return q if self.query_process is None else self.query_process.query(layer, q, advance, speculative)
