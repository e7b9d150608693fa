"""Key geometry of a real model, and why it decides a block cache's hit rate (docs/workloads.md, "Key process").

A top-k set moves between decode steps as much as the scores q_t . k_j over the tokens j decorrelate. For keys
with mean m and covariance S that correlation is q_t' S q_{t-1} / sqrt(q_t' S q_t q_{t-1}' S q_{t-1}) (the mean
adds the same q . m to every token, so it moves no top-k): for isotropic keys it is cos(q_t, q_{t-1}), for keys
with a steep spectrum whose queries' steady part lies in the high-variance directions it is far higher. Random
weights give near-isotropic keys, so a synthetic workload that reproduces only the query cosines under-states
token-level reuse.

Over a greedy decode with real weights (post-RoPE keys of the prompt's middle, as the KV systems index them; every
step's real query), per layer and KV head:

  mean_ratio     |mean(k)| / sqrt(E |k|^2): the share of the keys' size that is one common direction
  key_rms        sqrt(E |k|^2 / D): the keys' per-dimension size
  eig            the centred keys' covariance eigenvalues, descending, divided by their sum
  query_energy   E (q . v_i)^2 / E |q|^2 over the key principal directions v_i (same order; each query head of
                 the group), and of the query's steady part (its mean over steps) and its fluctuation
  overlap        adjacent-step top-k overlap |S_t & S_{t-1}| / k (exact scores summed over the group, the shared
                 10 % budget) of: the real queries; the synthetic query process (experiments/workloads/query_process.py,
                 `workload.query_process` profile) started from the real first query and from a random one; on the
                 real keys, on isotropic random keys, and on keys drawn from the fitted key process
                 (experiments/workloads/key_process.py, with and without its token correlation), with the process's
                 first query also drawn by the key process (key-aligned; with or without the group's coherence).
                 `block_overlap`: the same for RetroInfer-style's 8-token blocks scored by their best token.
  token_corr     the correlation of adjacent tokens' centred scores under the group's summed real query
  group_cos      the mean pairwise cosine of a KV head's query heads at one step

Writes the generator's profile (data/profiles/<model>-keys.json, or +keys_out=) and a record with the overlaps
(results/key_profile_<model>/record.json, or +record_out=); refuses existing files unless force=true.

    python -m experiments.producers.key_profile model=smollm2 seqlen=4096 workload.gen_tokens=32 \\
        workload.stop_at_eos=false
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from baselines.fullattn import FullAttn
from experiments.producers.profile import decode_real
from experiments.producers.reuse_profile import command_line, topk_overlap
from experiments.runner import run_settings
from experiments.runner.records import environment, git_commit, refuse
from experiments.workloads.key_process import KeyProcess, fit_fields
from experiments.workloads.query_process import ProfileQueryProcess
from kvoffload.errors import ConfigError
from kvoffload.offload.budget import select_budget, split_prompt
from kvoffload.paths import ROOT, repo_path, write_json_atomic

BUDGET = {"topk_ratio": 0.1, "sink": 16, "recent": 64}
BLOCK = 8  # RetroInfer-style's block (conf/system/retroinfer.yaml block_size)
QUERY_PROCESS = "data/profiles/smollm2-process.json"


class KeyProbe(FullAttn):
    """FullAttn (its tokens are FullAttn's) that keeps the prompt middle's keys and every decode step's query."""

    def __init__(self, prompt_len: int):
        super().__init__()
        self.sink, _, self.n_mid = split_prompt(prompt_len, BUDGET["sink"], BUDGET["recent"])
        self.k_sel = select_budget(prompt_len, BUDGET["topk_ratio"], BUDGET["sink"], BUDGET["recent"])
        self.keys: dict[int, torch.Tensor] = {}
        self.queries: dict[int, list[torch.Tensor]] = {}

    def prefill(self, layer, k, v):
        super().prefill(layer, k, v)
        self.keys[layer] = k[0, :, self.sink : self.sink + self.n_mid].float().cpu().clone()  # [Hkv, T, D]

    def decode(self, layer, q, k, v):
        self.queries.setdefault(layer, []).append(q[0].float().cpu().clone())  # [H, D]
        return super().decode(layer, q, k, v)


def adjacent_overlap(keys: torch.Tensor, q: torch.Tensor, k: int, block: int = 0) -> float:
    """keys [T, D], q [S, G, D] one KV head's queries over S steps -> mean |S_t & S_{t-1}| / size of the exact
    top-k (scores summed over the group); block > 0: of the top k // block blocks of `block` tokens, each scored
    by its best token (RetroInfer-style's selection)."""
    scores = q.sum(1) @ keys.T  # [S, T]
    if block:
        t = scores.shape[1] // block * block
        scores, k = scores[:, :t].unflatten(1, (-1, block)).amax(-1), k // block
    sel = scores.topk(k, dim=-1).indices
    return float(topk_overlap(sel[:-1], sel[1:]).mean())


def process_queries(proc: ProfileQueryProcess, layer: int, q0: torch.Tensor, steps: int) -> torch.Tensor:
    """The synthetic process's queries for `steps` steps of one layer, started from q0 [H, D] -> [S, H, D]."""
    proc.state[layer] = proc.err[layer] = None
    out = [proc.query(layer, q0[None], advance=i > 0)[0] for i in range(steps)]
    return torch.stack(out)


def measure(cfg: DictConfig) -> tuple[dict, dict]:
    git = git_commit(ROOT)
    t0 = time.perf_counter()
    model_cfg, probe, desc = decode_real(cfg, lambda model_cfg, prompt_len: KeyProbe(prompt_len))
    wall = time.perf_counter() - t0
    L, hkv, g, d = model_cfg.num_layers, model_cfg.num_kv_heads, model_cfg.group_size, model_cfg.head_dim
    keys = torch.stack([probe.keys[i] for i in range(L)])  # [L, Hkv, T, D]
    queries = torch.stack([torch.stack(probe.queries[i]) for i in range(L)])  # [L, S, H, D]
    queries = queries.unflatten(2, (hkv, g)).permute(0, 2, 1, 3, 4)  # [L, Hkv, S, G, D]
    fields, energy = fit_fields(keys, queries)
    profile = {
        "model": model_cfg.name,
        "source": f"experiments.producers.key_profile of {desc}",
        **{name: _round(val) for name, val in fields.items()},
    }

    qpath = cfg.get("key_query_process") or QUERY_PROCESS
    torch.manual_seed(int(cfg.seed))
    proc = ProfileQueryProcess.from_profile(qpath, L, hkv, g, torch.device("cpu"))
    keyproc = KeyProcess(fields, int(cfg.seed))
    k, steps = probe.k_sel, queries.shape[2]
    iid = KeyProcess({**fields, "token_corr": torch.zeros(L, hkv)}, int(cfg.seed))
    names = ("real", "process_real_q0", "process_random_q0", "process_aligned_q0", "process_group_q0")
    keysets = ("real_keys", "isotropic_keys", "iid_process_keys", "process_keys")
    over = {f"{w}/{ks}": torch.zeros(L, hkv) for w in names for ks in keysets}
    block = {name: torch.zeros(L, hkv) for name in over}
    for i in range(L):
        q_real = queries[i]  # [Hkv, S, G, D]
        q0 = q_real[:, 0].flatten(0, 1)  # [H, D]
        q_rand = torch.randn_like(q0) * q0.norm(dim=-1, keepdim=True) / d**0.5
        q_align = keyproc.first_query(i, q_rand[None], coherent=False)[0]
        q_group = keyproc.first_query(i, q_rand[None])[0]
        drawn = {
            "real": q_real,
            "process_real_q0": process_queries(proc, i, q0, steps).unflatten(1, (hkv, g)).transpose(0, 1),
            "process_random_q0": process_queries(proc, i, q_rand, steps).unflatten(1, (hkv, g)).transpose(0, 1),
            "process_aligned_q0": process_queries(proc, i, q_align, steps).unflatten(1, (hkv, g)).transpose(0, 1),
            "process_group_q0": process_queries(proc, i, q_group, steps).unflatten(1, (hkv, g)).transpose(0, 1),
        }
        n = keys.shape[2]
        sampled = keyproc.sample(i, n, torch.device("cpu"), torch.float32)  # [Hkv, T, D]
        sampled_iid = iid.sample(i, n, torch.device("cpu"), torch.float32)
        for h in range(hkv):
            kset = {
                "real_keys": keys[i, h],
                "isotropic_keys": torch.randn(n, d) * fields["key_rms"][i, h],
                "iid_process_keys": sampled_iid[h],
                "process_keys": sampled[h],
            }
            for w, q in drawn.items():
                for ks, kk in kset.items():
                    over[f"{w}/{ks}"][i, h] = adjacent_overlap(kk, q[h], k)
                    block[f"{w}/{ks}"][i, h] = adjacent_overlap(kk, q[h], k, BLOCK)
    sparse = slice(2, None)  # the systems' dense layers (dense_layers: 2) select nothing
    summary = {
        "mean_ratio": _stats(fields["mean_ratio"]),
        "top1_eig_share": _stats(fields["eig"][..., 0]),
        "top8_eig_share": _stats(fields["eig"][..., :8].sum(-1)),
        "query_energy_top8": _stats(fields["query_energy"][..., :8].sum(-1)),
        "steady_query_energy_top8": _stats(energy["steady"][..., :8].sum(-1)),
        "fluct_query_energy_top8": _stats(energy["fluct"][..., :8].sum(-1)),
        "isotropic_top8": round(8 / d, 4),
        "token_corr": _stats(fields["token_corr"]),
        "group_cos": _stats(fields["group_cos"]),
        "topk_overlap_layers_2+": {name: round(float(v[sparse].mean()), 4) for name, v in over.items()},
        "block_overlap_layers_2+": {name: round(float(v[sparse].mean()), 4) for name, v in block.items()},
    }
    record = {
        "experiment": "key_profile",
        "model": model_cfg.name,
        "source": desc,
        "query_process": qpath,
        "budget": {**BUDGET, "k": k, "middle_tokens": probe.n_mid, "block": BLOCK},
        "decode_steps": steps,
        "summary": summary,
        "per_head": {
            "topk_overlap": {name: _round(v) for name, v in over.items()},
            "block_overlap": {name: _round(v) for name, v in block.items()},
            "steady_query_energy": _round(energy["steady"]),
            "fluct_query_energy": _round(energy["fluct"]),
        },
        "provenance": {"command": command_line(cfg).replace("reuse_profile", "key_profile"), "git": git},
        "wall_s": round(wall, 1),
        "environment": environment(run_settings.resolve_device(cfg.device)),
        "config": OmegaConf.to_container(cfg, resolve=True),
    }
    return profile, record


def _round(x: torch.Tensor) -> list:
    return (x.double() * 1e5).round().div(1e5).tolist()


def _stats(x: torch.Tensor) -> dict:
    x = x.flatten().double()
    return {k: round(float(v), 4) for k, v in (("mean", x.mean()), ("min", x.min()), ("max", x.max()))}


def outputs(cfg: DictConfig) -> tuple[Path, Path]:
    name = cfg.model.name
    paths = (
        repo_path(cfg.get("keys_out") or f"data/profiles/{name}-keys.json"),
        repo_path(cfg.get("record_out") or f"results/key_profile_{name}/record.json"),
    )
    for p in paths:
        if p.exists() and not cfg.get("force", False):
            raise ConfigError(f"{p} exists: force=true overwrites it (or +keys_out= / +record_out=)")
    return paths


@hydra.main(config_path="../../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        prof_path, rec_path = outputs(cfg)
        profile, record = measure(cfg)
    except ConfigError as e:
        refuse(e)
    write_json_atomic(prof_path, profile)
    write_json_atomic(rec_path, record)
    s = record["summary"]
    for key in ("mean_ratio", "top1_eig_share", "top8_eig_share", "query_energy_top8", "token_corr", "group_cos"):
        print(f"{key:>26}: {s[key]}")
    for key in ("topk_overlap_layers_2+", "block_overlap_layers_2+"):
        print(key)
        for name, v in s[key].items():
            print(f"  {name:>40}: {v:.3f}")
    print(f"-> {prof_path}, {rec_path}", file=sys.stderr)


if __name__ == "__main__":
    main()
