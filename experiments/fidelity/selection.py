"""What a sparse system attended, layer by layer, against exact attention at the same step (docs/fidelity.md):

  recall  of the exact top-k of the real query among the middle of the prompt (between the sink and the recent
          window, which every system attends whole): the share of the k middle positions with the highest score
          that the system attended, k being how many middle positions it attended. The score is the oracle
          retriever's (the query group's summed query, dotted with each key), so the exact top-k oracle has recall 1.
  mass    of exact attention's weights that fall on the positions the system attended (the prompt positions it
          noted, and every generated token), averaged over query heads: 1 where nothing of weight was left out.

The system notes its positions through the seam (KVOffloadSystem.attended_positions); the queries and the new keys
are read as the decoder hands them to the system's decode."""

from __future__ import annotations

import math

import torch

from kvoffload.kv.interface import KVOffloadSystem
from kvoffload.offload.budget import split_prompt


class SelectionProbe:
    def __init__(self, system: KVOffloadSystem, prefix_k: list[torch.Tensor], sink: int, recent: int):
        """prefix_k: every layer's prompt keys [B, Hkv, T0, D] (post-RoPE, as the system received them)."""
        self.system, self.prompt_k = system, prefix_k
        self.t0 = prefix_k[0].shape[2]
        self.sink, self.recent, _ = split_prompt(self.t0, sink, recent)
        self.new_k: list[list[torch.Tensor]] = [[] for _ in prefix_k]
        self.seen: dict[int, torch.Tensor] = {}
        self.rows: dict[int, list[torch.Tensor]] = {}  # layer -> per step [B, 2] (recall, mass)
        system.keep_selections()
        decode = system.decode

        def recording(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            self.seen[layer] = q.detach().float()
            self.new_k[layer].append(k.detach().float())
            return decode(layer, q, k, v)

        system.decode = recording  # an instance attribute: the decoder calls it in place of the method

    def after_step(self) -> None:
        for layer, q in self.seen.items():
            pos = self.system.attended_positions(layer)
            if pos is not None:
                self.rows.setdefault(layer, []).append(self.measure(layer, q, pos))
        self.seen = {}

    def measure(self, layer: int, q: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """[B, 2]: recall and mass of one layer at this step."""
        prompt = self.prompt_k[layer].float()  # [B, Hkv, T0, D]
        keys = torch.cat([prompt, torch.stack(self.new_k[layer], dim=2)], dim=2)  # and every generated token
        b, hkv, t, d = keys.shape
        qg = q.view(b, hkv, -1, d)
        attended = torch.zeros(b, hkv, t + 1, dtype=torch.bool, device=q.device)  # the last column takes -1
        attended.scatter_(2, pos.clamp(min=-1) % (t + 1), True)
        attended = attended[..., :t]
        attended[..., self.t0 :] = True
        weights = torch.softmax(torch.einsum("bkgd,bktd->bkgt", qg, keys) / math.sqrt(d), dim=-1)
        mass = (weights * attended[:, :, None]).sum(-1).mean(dim=(1, 2))
        lo, hi = self.sink, self.t0 - self.recent
        picked = attended[..., lo:hi]
        k = picked.sum(-1, keepdim=True)  # [B, Hkv, 1]
        score = torch.einsum("bkd,bktd->bkt", qg.sum(2), prompt[:, :, lo:hi])
        rank = score.argsort(-1, descending=True).argsort(-1)  # each position's place in the exact order
        hit = (picked & (rank < k)).sum(-1).float()
        recall = torch.where(k[..., 0] > 0, hit / k[..., 0].clamp(min=1), torch.ones_like(hit)).mean(1)
        return torch.stack([recall, mass], dim=-1)

    def per_layer(self) -> dict[int, torch.Tensor]:
        """layer -> [B, 2]: each document's recall and mass in that layer, averaged over the steps."""
        return {layer: torch.stack(rows).mean(0) for layer, rows in sorted(self.rows.items())}
