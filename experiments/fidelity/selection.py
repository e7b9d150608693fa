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
        prompt = self.prompt_k[layer]  # [B, Hkv, T0, D]
        b, hkv, t0, d = prompt.shape
        qg = q.view(b, hkv, -1, d)
        on_prompt = torch.einsum("bkgd,bktd->bkgt", qg, prompt.float())  # q.k of every query head
        on_new = torch.einsum("bkgd,bktd->bkgt", qg, torch.stack(self.new_k[layer], dim=2))
        weights = torch.softmax(torch.cat([on_prompt, on_new], dim=-1) / math.sqrt(d), dim=-1)
        attended = torch.zeros(b, hkv, t0 + 1, dtype=torch.bool, device=q.device)  # the last column takes -1
        attended = attended.scatter_(2, pos % (t0 + 1), True)[..., :t0]
        on_attended = torch.einsum("bkgt,bkt->bkg", weights[..., :t0], attended.to(weights.dtype))
        mass = (on_attended + weights[..., t0:].sum(-1)).mean(dim=(1, 2))  # every generated token is attended
        lo, hi = self.sink, self.t0 - self.recent
        middle = (pos >= lo) & (pos < hi)  # [B, Hkv, n]: the noted positions in the middle (each noted once)
        k = middle.sum(-1)  # [B, Hkv]
        kmax = int(k.max())
        if kmax == 0:
            return torch.stack([torch.ones_like(mass), mass], dim=-1)
        # the group's summed query against each middle key: the oracle retriever's score
        score = torch.einsum("bkd,bktd->bkt", qg.sum(2), prompt[:, :, lo:hi].float())
        top = score.topk(kmax, dim=-1).indices
        exact = torch.zeros(b, hkv, hi - lo, dtype=torch.bool, device=q.device)
        exact.scatter_(2, top, torch.arange(kmax, device=q.device) < k[..., None])
        hit = (exact.gather(2, (pos - lo).clamp(0, hi - lo - 1)) & middle).sum(-1)
        recall = torch.where(k > 0, hit / k.clamp(min=1), 1.0).mean(1)
        return torch.stack([recall, mass], dim=-1)

    def per_layer(self) -> dict[int, torch.Tensor]:
        """layer -> [B, 2]: each document's recall and mass in that layer, averaged over the steps."""
        return {layer: torch.stack(rows).mean(0) for layer, rows in sorted(self.rows.items())}
