"""InfiniGen's offline skewing (snu-comparch/InfiniGen): from a real model's query activations, per layer and KV
head, the orthogonal basis that concentrates q.k in few channels - the eigenvectors of Q^T Q over the queries of
the head's group, by decreasing eigenvalue (= right singular vectors of Q). The InfiniGen-style baseline scores
on the first channel_fraction of them. Writes data/skew/<model>.pt ([layers, kv_heads, D, D], fp16, columns
ordered) with its provenance beside it.

    python -m experiments.producers.infinigen_skew model=smollm2 seqlen=3k workload.gen_tokens=64 \\
        workload.stop_at_eos=false
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

from experiments.producers.profile import record_queries
from kvoffload.errors import ConfigError
from kvoffload.paths import ROOT


def skew_bases(queries: dict[int, list[torch.Tensor]], num_layers: int, num_kv_heads: int) -> torch.Tensor:
    out = []
    for layer in range(num_layers):
        q = torch.stack(queries[layer]).double()  # [S, B, H, D]
        q = q.unflatten(2, (num_kv_heads, -1)).permute(2, 0, 1, 3, 4).flatten(1, 3)  # [Hkv, S*B*G, D]
        _, vecs = torch.linalg.eigh(q.transpose(1, 2) @ q)  # ascending eigenvalues
        out.append(vecs.flip(-1))
    return torch.stack(out).to(torch.float16)


@hydra.main(config_path="../../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        model_cfg, queries, desc = record_queries(cfg, min_steps=8)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    bases = skew_bases(queries, model_cfg.num_layers, model_cfg.num_kv_heads)
    out = Path(cfg.get("skew_out") or ROOT / "data" / "skew" / f"{model_cfg.name}.pt")
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(bases, out.with_suffix(".tmp"))
    out.with_suffix(".tmp").replace(out)
    out.with_suffix(".json").write_text(json.dumps({"source": desc, "shape": list(bases.shape)}))
    print(f"skew bases {tuple(bases.shape)} -> {out}")


if __name__ == "__main__":
    main()
