"""A synthetic key process for speed runs with synthetic weights (workload.kv_fill=key_process).

Random-weight projections give near-isotropic keys, whose top-k sets move between decode steps as fast as the
query turns; real keys have a common mean direction and a steep covariance spectrum, and real queries put their
energy in the high-variance directions, so real top-k sets (and a block cache's hits) are far steadier
(experiments/producers/key_profile.py measures it). Per layer and KV head this process draws each token's post-RoPE key
as

    k_j = key_rms * sqrt(D) * (r m + sqrt(1 - r^2) V (sqrt(eig) * z_j)),    z_j = a z_{j-1} + sqrt(1 - a^2) e_j

with r = mean_ratio, eig the normalised covariance spectrum (so E |k|^2 = D key_rms^2, |E k| / sqrt(E |k|^2) = r
and the centred covariance's normalised eigenvalues are eig), V a seeded random orthonormal basis, m a seeded
random unit vector, e_j ~ N(0, I_D) and a = token_corr, the correlation of adjacent tokens' scores: real
neighbours are alike, so a query's top tokens come in runs, which is what keeps a block cache's blocks (8
consecutive tokens) steady from step to step. `first_query` gives the query process its first query per KV head:
the group's query heads at mean pairwise cosine group_cos (real GQA heads point alike, and the systems score with
the group's summed query, whose steady part is then larger), each with the measured energy over V (query_energy).

    python -m experiments.workloads.key_process data/profiles/smollm2-keys.json \\
        --layers 32 --kv-heads 8 --head-dim 128 \\
        --order data/profiles/smollm2-process.json --out data/profiles/llama3-keys-from-smollm2.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from experiments.workloads.query_process import _map_index
from kvoffload.errors import ConfigError
from kvoffload.paths import repo_path, write_json_atomic

# [L, Hkv] each, but eig and query_energy [L, Hkv, D]
FIELDS = ("mean_ratio", "key_rms", "eig", "query_energy", "token_corr", "group_cos")


def fit_fields(keys: torch.Tensor, queries: torch.Tensor) -> tuple[dict, dict]:
    """keys [L, Hkv, T, D] (a prompt's, post-RoPE), queries [L, Hkv, S, G, D] (each decode step's, per KV head's
    group) -> the process's FIELDS, and the queries' energy over the key principal directions split into their
    steady part (the mean over steps) and the fluctuation around it ({"steady", "fluct"}, [L, Hkv, D])."""
    keys, queries = keys.double(), queries.double()
    mean = keys.mean(2)  # [L, Hkv, D]
    power = keys.pow(2).sum(-1).mean(2)  # E |k|^2
    centred = keys - mean[:, :, None]
    cov = centred.transpose(-1, -2) @ centred / keys.shape[2]
    lam, vec = torch.linalg.eigh(cov)  # ascending
    lam, vec = lam.flip(-1).clamp_min(0), vec.flip(-1)  # descending; vec[..., :, i] the i-th direction

    def energy(q):  # [L, Hkv, N, D] -> share of E |q|^2 along each direction [L, Hkv, D]
        return (q @ vec).pow(2).mean(2) / q.pow(2).sum(-1).mean(2, keepdim=True)

    steady = queries.mean(2, keepdim=True)  # [L, Hkv, 1, G, D]
    scores = queries.sum(3) @ centred.transpose(-1, -2)  # [L, Hkv, S, T]: the group's summed query, as scored
    g = queries.shape[3]
    unit = queries / queries.norm(dim=-1, keepdim=True)
    pair = (unit.sum(3).pow(2).sum(-1) - g) / max(g * (g - 1), 1)  # mean pairwise cosine in the group [L, Hkv, S]
    fields = {
        "mean_ratio": (mean.norm(dim=-1) / power.sqrt()).float(),
        "key_rms": (power / keys.shape[-1]).sqrt().float(),
        "eig": (lam / lam.sum(-1, keepdim=True)).float(),
        "query_energy": energy(queries.flatten(2, 3)).float(),
        "token_corr": ((scores[..., 1:] * scores[..., :-1]).sum(-1) / scores.pow(2).sum(-1)).mean(2).float(),
        "group_cos": (pair.mean(2) if g > 1 else torch.ones_like(power)).float(),
    }
    return fields, {"steady": energy(steady.flatten(2, 3)).float(), "fluct": energy((queries - steady).flatten(2, 3))}


class KeyProcess:
    def __init__(self, fields: dict[str, torch.Tensor], seed: int, source: str = "a key profile"):
        self.f = {name: fields[name].float() for name in FIELDS}
        L, hkv, d = self.f["eig"].shape
        self.seed, self.shape = seed, (L, hkv, d)
        gen = torch.Generator().manual_seed(seed)
        # the basis V and the mean direction m of every head, once, on the CPU (seeded, device-independent)
        self.basis = torch.linalg.qr(torch.randn(L, hkv, d, d, generator=gen)).Q
        m = torch.randn(L, hkv, d, generator=gen)
        self.mean_dir = m / m.norm(dim=-1, keepdim=True)
        r, e = self.f["mean_ratio"], self.f["eig"]
        self.description = (
            f"synthetic keys: mean + covariance-shaped noise per head, AR(1) over tokens (mean ratio {r.mean():.3f}, "
            f"top eigenvalue share {e[..., 0].mean():.3f}, token correlation {self.f['token_corr'].mean():.3f}; "
            f"first query group-coherent at {self.f['group_cos'].mean():.3f}, key-aligned) of {source}, seed {seed}"
        )

    @classmethod
    def from_profile(cls, path: str, num_layers: int, num_kv_heads: int, head_dim: int, seed: int):
        """Loads and checks a key profile (data/profiles/*-keys*.json) for a model's shape: a ConfigError if the
        file is missing, lacks a field or has another shape."""
        fields = load_fields(path)
        for name, t in fields.items():
            want = (num_layers, num_kv_heads) + ((head_dim,) if t.dim() == 3 else ())
            if t.shape != want:
                raise ConfigError(
                    f"key profile {Path(path).name}: {name} has shape {tuple(t.shape)}, the model needs {want} "
                    f"(map it: python -m experiments.workloads.key_process {path} "
                    "--layers --kv-heads --head-dim --order)"
                )
        return cls(fields, seed, Path(path).name)

    def _layer(self, layer: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(A [Hkv, D, D], b [Hkv, D]): a key is z @ A + b with z ~ N(0, I)."""
        r, rms, eig = (self.f[n][layer] for n in ("mean_ratio", "key_rms", "eig"))
        scale = rms * self.shape[2] ** 0.5  # [Hkv]
        a = (eig.clamp_min(0).sqrt()[:, :, None] * self.basis[layer].transpose(-1, -2)) * (
            scale * (1 - r * r).clamp_min(0).sqrt()
        )[:, None, None]
        b = self.mean_dir[layer] * (scale * r)[:, None]
        return a.to(device), b.to(device)

    def fill(self, layer: int, out: torch.Tensor, chunk: int) -> None:
        """out [B, Hkv, T, D] <- this layer's keys, `chunk` tokens of one sequence at a time (the temporaries are
        one chunk's; drawn on out's device from a generator seeded by (seed, layer): same seed and chunk, same
        keys)."""
        a, b = self._layer(layer, out.device)
        rho = self.f["token_corr"][layer].clamp(0, 0.999).to(out.device)[:, None, None]  # [Hkv, 1, 1]
        gen = torch.Generator(out.device).manual_seed(self.seed * 1009 + layer)
        for r in range(out.shape[0]):
            last = None  # the previous chunk's last z: the chain runs on across chunks
            for s in range(0, out.shape[2], chunk):
                e = min(s + chunk, out.shape[2])
                z = torch.randn(out.shape[1], e - s, out.shape[3], device=out.device, generator=gen)
                z = _ar1_scan(z, rho, last)
                last = z[:, -1:].clone()
                out[r, :, s:e] = torch.baddbmm(b[:, None], z, a).to(out.dtype)

    def sample(self, layer: int, n: int, device: torch.device, dtype: torch.dtype, chunk: int = 8192):
        """One sequence's keys of a layer: [Hkv, n, D]."""
        out = torch.empty(1, self.shape[1], n, self.shape[2], device=device, dtype=dtype)
        self.fill(layer, out, chunk)
        return out[0]

    def first_query(self, layer: int, q: torch.Tensor, coherent: bool = True) -> torch.Tensor:
        """q [B, H, D] -> a query with q's norms: per query head u = sqrt(g) s + sqrt(1 - g) w, s shared by the KV
        head's group (g = group_cos; coherent=False: g = 0), s and w unit draws V (sqrt(e) * z) with, in
        expectation, about the measured share e of their energy along each key principal direction
        (query_energy; a little less along the largest, which normalising a draw shrinks most)."""
        b, h, d = q.shape
        hkv = self.shape[1]
        group = h // hkv
        e = self.f["query_energy"][layer].clamp_min(0).sqrt().to(q.device)  # [Hkv, D]
        basis = self.basis[layer].to(q.device)  # [Hkv, D, D]

        def draw(n):  # [b, Hkv, n, D] unit directions
            u = torch.einsum("kdi,bkni->bknd", basis, torch.randn(b, hkv, n, d, device=q.device) * e[:, None])
            return u / u.norm(dim=-1, keepdim=True).clamp_min(1e-12)

        g = self.f["group_cos"][layer].clamp(0, 1).to(q.device)[None, :, None, None] if coherent else 0.0
        u = (g**0.5 * draw(1) + (1 - g) ** 0.5 * draw(group)).flatten(1, 2)  # [b, H, D]
        u = u / u.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        return (u * q.float().norm(dim=-1, keepdim=True)).to(q.dtype)


def _ar1_scan(x: torch.Tensor, rho: torch.Tensor, last: torch.Tensor | None) -> torch.Tensor:
    """x [H, n, D] fresh N(0, 1) draws -> z with z_j = rho z_{j-1} + sqrt(1 - rho^2) x_j along n (z_{-1} = last;
    without one, z_0 = x_0: stationary from the first token), rho [H, 1, 1]. A doubling scan: log2(n) whole-chunk
    steps instead of n sequential ones, stopped once rho^step is negligible."""
    z = x * (1 - rho * rho).sqrt()
    z[:, :1] = x[:, :1] if last is None else rho * last + z[:, :1]
    step, power = 1, rho
    while step < z.shape[1] and float(power.max()) > 1e-6:
        z[:, step:] = z[:, step:] + power * z[:, :-step]  # the right side is computed before the write
        step, power = 2 * step, power * power
    return z


def resample_spectrum(x: torch.Tensor, d: int) -> torch.Tensor:
    """[..., Ds] shares (sum 1, descending) -> [..., d]: the same curve over the normalised index i / d
    (piecewise constant, each source value on d / Ds target indices), renormalised to sum 1. So head_dim
    64 -> 128 splits every eigenvalue in two: the fraction of directions that hold a given share of the variance
    is kept (a steep spectrum stays steep), not the number of directions."""
    src = x.shape[-1]
    idx = (torch.arange(d) * src // d).clamp_max(src - 1)
    y = x[..., idx]
    return y / y.sum(-1, keepdim=True)


def load_fields(path: str) -> dict[str, torch.Tensor]:
    """A key profile's FIELDS. A mapped profile (written by main) names its measured profile (`from`) and, per
    target head, the source head it takes (`source_head`, flat indices) and the head_dim its spectra are resampled
    to: it stays a few KB, and every target head's fields are exactly a measured head's."""
    p = repo_path(path)
    if not p.is_file():
        raise ConfigError(f"key profile {path}: no such file")
    data = json.loads(p.read_text())
    if "from" in data:
        src = load_fields(data["from"])
        idx = torch.tensor(data["source_head"])
        if idx.min() < 0 or idx.max() >= src["mean_ratio"].numel():
            raise ConfigError(f"key profile {p.name}: source_head out of range of {data['from']}")
        out = {}
        for name, t in src.items():
            t = t.flatten(0, 1)[idx]
            out[name] = resample_spectrum(t, int(data["head_dim"])) if t.dim() == 3 else t
        return out
    missing = [name for name in FIELDS if name not in data]
    if missing:
        raise ConfigError(f"key profile {p.name}: no {', '.join(missing)}")
    return {name: torch.tensor(data[name], dtype=torch.float32) for name in FIELDS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile")
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--kv-heads", type=int, required=True)
    ap.add_argument("--head-dim", type=int, required=True)
    ap.add_argument("--order", required=True, help="the query profile whose s_hat orders the source heads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    fields = load_fields(args.profile)
    order = torch.tensor(json.loads(repo_path(args.order).read_text())["s_hat"])
    if order.shape != fields["mean_ratio"].shape:
        raise ConfigError(f"--order {args.order}: s_hat of shape {tuple(order.shape)}, the profile's heads differ")
    # the query profiles' map (experiments.workloads.query_process._map_index over the source's s_hat, same seed): a
    # target head's keys and queries come from the same source head
    idx = _map_index(order, args.layers, args.kv_heads, args.seed)
    data = {
        "source": f"quantile map of {Path(args.profile).name} over the s_hat of {Path(args.order).name} (seed "
        f"{args.seed}), spectra resampled to head_dim {args.head_dim} "
        "(experiments.workloads.key_process.resample_spectrum)",
        "from": args.profile,
        "head_dim": args.head_dim,
        "source_head": idx.tolist(),
    }
    write_json_atomic(args.out, data)
    out = load_fields(str(args.out))
    print(f"{args.out}: mean ratio {out['mean_ratio'].mean():.3f}, top eig share {out['eig'][..., 0].mean():.3f}")


if __name__ == "__main__":
    main()
