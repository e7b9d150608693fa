"""Independent references the system tests compare against: plain loops over the full KV, no system code."""

import math

import torch


def randn(*shape, seed=0, dtype=torch.bfloat16, device="cpu"):
    """Seeded normal samples made on the CPU (the same values on every device), then cast and moved."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


def topk_middle(qs: torch.Tensor, keys: torch.Tensor, sink: int, recent: int, k_sel: int) -> torch.Tensor:
    """One KV head: the k_sel middle tokens with the largest sum over the query group of q_j . k."""
    mid = torch.arange(sink, keys.shape[0] - recent)
    return mid[(qs @ keys[mid].T).sum(0).topk(k_sel).indices]


def top_blocks_middle(
    qs: torch.Tensor, keys: torch.Tensor, sink: int, recent: int, block_size: int, n_blocks: int
) -> torch.Tensor:
    """One KV head: the middle cut into blocks of block_size consecutive tokens (the last one partial when
    block_size does not divide the middle), each block scored by its best token (sum over the query group of
    q_j . k); the tokens of the n_blocks best blocks (a partial block: only its real tokens)."""
    mid = torch.arange(sink, keys.shape[0] - recent)
    tok = (qs @ keys[mid].T).sum(0)
    blocks = list(torch.split(torch.arange(mid.numel()), block_size))
    best = torch.stack([tok[b].max() for b in blocks]).topk(n_blocks).indices if n_blocks else []
    return mid[torch.cat([blocks[int(j)] for j in best])] if n_blocks else mid[:0]


def exact_topk_attention(k0, v0, data, sink, recent, k_sel, dense_layers=0, select=None, block_size=None):
    """Per step and layer, each KV head attends sink + recent + generated + its top-k middle tokens (layers
    below dense_layers: every token), recomputed from scratch. k0, v0 [L, B, Hkv, T0, D]; data[step][layer] =
    (q [B, H, D], k_new, v_new [B, Hkv, D]); select[step][layer] [B, H, D], when given, is the query that picks
    the top-k (q still attends). With block_size, k_sel counts blocks: each head attends the tokens of its k_sel
    best blocks (top_blocks_middle). Returns out[step][layer] [B, H, D]."""
    _, b_, hkv, t0, d = k0.shape
    out = []
    for step, inputs in enumerate(data):
        row = []
        for layer, (q, *_) in enumerate(inputs):
            g = q.shape[1] // hkv
            gen_k = torch.stack([data[s][layer][1] for s in range(step + 1)], 2)  # [B, Hkv, n, D]
            gen_v = torch.stack([data[s][layer][2] for s in range(step + 1)], 2)
            res = torch.empty_like(q)
            for b in range(b_):
                for h in range(hkv):
                    keys, vals, qs = k0[layer, b, h], v0[layer, b, h], q[b, h * g : (h + 1) * g]
                    q_sel = qs if select is None else select[step][layer][b, h * g : (h + 1) * g]
                    top = (
                        topk_middle(q_sel, keys, sink, recent, k_sel)
                        if block_size is None
                        else top_blocks_middle(q_sel, keys, sink, recent, block_size, k_sel)
                    )
                    sel = (
                        torch.arange(t0)
                        if layer < dense_layers
                        else torch.cat([torch.arange(sink), torch.arange(t0 - recent, t0), top])
                    )
                    kk, vv = torch.cat([keys[sel], gen_k[b, h]]), torch.cat([vals[sel], gen_v[b, h]])
                    res[b, h * g : (h + 1) * g] = torch.softmax(qs @ kk.T / math.sqrt(d), -1) @ vv
            row.append(res)
        out.append(row)
    return out


def write_profile(path, s_hat) -> str:
    """A reuse profile in experiments.producers.profile's format, s_hat [layers][kv_heads]; returns its path (a str, as
    CLO's `profile` setting takes it). s_hat -1 makes a head hard to reuse (Eq. 11), 1 easy."""
    import json

    path.write_text(json.dumps({"s_hat": [[float(x) for x in row] for row in s_hat]}))
    return str(path)


def first_head_hard(layers: int, kv_heads: int) -> list[list[float]]:
    """s_hat that makes KV head 0 of every layer hard to reuse and the others easy."""
    return [[-1.0] + [1.0] * (kv_heads - 1)] * layers
