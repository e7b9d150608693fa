"""A synthetic key process for speed runs with synthetic weights (workload.kv_fill=key_process).

Random-weight projections give near-isotropic keys, whose top-k sets move between decode steps as fast as the
query turns; real keys have a common mean direction and a steep covariance spectrum, and real queries put their
energy in the high-variance directions, so real top-k sets (and a block cache's hits) are far steadier
(experiments/key_profile.py measures it). Per layer and KV head this process draws each token's post-RoPE key as

    k = key_rms * sqrt(D) * (r m + sqrt(1 - r^2) V (sqrt(eig) * z)),    z ~ N(0, I_D)

with r = mean_ratio, eig the normalised covariance spectrum (so E |k|^2 = D key_rms^2, |E k| / sqrt(E |k|^2) = r
and the centred covariance's normalised eigenvalues are eig), V a seeded random orthonormal basis and m a seeded
random unit vector. Tokens are independent: the keys' geometry, not their order, is what it reproduces.
`first_query` gives the query process its first direction with the measured energy over V (query_energy),
so that the queries' steady part lies where the keys vary, as real queries' does.

    python -m experiments.key_process data/profiles/smollm2-keys.json --layers 32 --kv-heads 8 --head-dim 128 \\
        --order data/profiles/smollm2-process.json --out data/profiles/llama3-keys-from-smollm2.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from experiments.query_process import _map_index
from kvoffload.errors import ConfigError
from kvoffload.paths import repo_path, write_json_atomic

FIELDS = ("mean_ratio", "key_rms", "eig", "query_energy")  # [L, Hkv], [L, Hkv], [L, Hkv, D], [L, Hkv, D]


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
    fields = {
        "mean_ratio": (mean.norm(dim=-1) / power.sqrt()).float(),
        "key_rms": (power / keys.shape[-1]).sqrt().float(),
        "eig": (lam / lam.sum(-1, keepdim=True)).float(),
        "query_energy": energy(queries.flatten(2, 3)).float(),
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
            f"synthetic keys: mean + covariance-shaped noise per head (mean ratio {r.mean():.3f}, top eigenvalue "
            f"share {e[..., 0].mean():.3f}; queries' first direction key-aligned) of {source}, seed {seed}"
        )

    @classmethod
    def from_profile(cls, path: str, num_layers: int, num_kv_heads: int, head_dim: int, seed: int):
        """Loads and checks a key profile (data/profiles/*-keys*.json) for a model's shape: a ConfigError if the
        file is missing, lacks a field or has another shape."""
        p = repo_path(path)
        if not p.is_file():
            raise ConfigError(f"key profile {path}: no such file")
        data = json.loads(p.read_text())
        fields = {}
        for name in FIELDS:
            if name not in data:
                raise ConfigError(f"key profile {p.name}: no {name}")
            t = torch.tensor(data[name], dtype=torch.float32)
            want = (num_layers, num_kv_heads) + ((head_dim,) if t.dim() == 3 else ())
            if t.shape != want:
                raise ConfigError(
                    f"key profile {p.name}: {name} has shape {tuple(t.shape)}, the model needs {want} "
                    f"(map it: python -m experiments.key_process {path} --layers --kv-heads --head-dim)"
                )
            fields[name] = t
        return cls(fields, seed, p.name)

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
        gen = torch.Generator(out.device).manual_seed(self.seed * 1009 + layer)
        for r in range(out.shape[0]):
            for s in range(0, out.shape[2], chunk):
                e = min(s + chunk, out.shape[2])
                z = torch.randn(out.shape[1], e - s, out.shape[3], device=out.device, generator=gen)
                out[r, :, s:e] = torch.baddbmm(b[:, None], z, a).to(out.dtype)

    def sample(self, layer: int, n: int, device: torch.device, dtype: torch.dtype, chunk: int = 8192):
        """One sequence's keys of a layer: [Hkv, n, D]."""
        out = torch.empty(1, self.shape[1], n, self.shape[2], device=device, dtype=dtype)
        self.fill(layer, out, chunk)
        return out[0]

    def first_query(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q [B, H, D] -> a query with q's norms whose direction has, in expectation, the measured share of its
        energy along each key principal direction of its KV head (query_energy): u = V (sqrt(e) * z)."""
        b, h, d = q.shape
        hkv = self.shape[1]
        e = self.f["query_energy"][layer].clamp_min(0).repeat_interleave(h // hkv, 0).to(q.device)  # [H, D]
        basis = self.basis[layer].repeat_interleave(h // hkv, 0).to(q.device)  # [H, D, D]
        z = torch.randn(b, h, d, device=q.device) * e.sqrt()
        u = torch.einsum("hdi,bhi->bhd", basis, z)
        u = u / u.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        return (u * q.float().norm(dim=-1, keepdim=True)).to(q.dtype)


def resample_spectrum(x: torch.Tensor, d: int) -> torch.Tensor:
    """[..., Ds] shares (sum 1, descending) -> [..., d]: the same curve over the normalised index i / d
    (piecewise constant, each source value on d / Ds target indices), renormalised to sum 1. So head_dim
    64 -> 128 splits every eigenvalue in two: the fraction of directions that hold a given share of the variance
    is kept (a steep spectrum stays steep), not the number of directions."""
    src = x.shape[-1]
    idx = (torch.arange(d) * src // d).clamp_max(src - 1)
    y = x[..., idx]
    return y / y.sum(-1, keepdim=True)


def map_key_fields(fields: dict, order: torch.Tensor, layers: int, kv_heads: int, head_dim: int, seed: int = 0):
    """Another model's shape: every target head gets one source head's fields, chosen as the query profiles are
    mapped (experiments.query_process._map_index over `order`, the source's s_hat, with the same seed: a target
    head's keys and queries then come from the same source head); spectra resampled to head_dim."""
    idx = _map_index(order, layers, kv_heads, seed)
    out = {}
    for name in FIELDS:
        t = fields[name].flatten(0, 1)[idx.flatten()]
        out[name] = resample_spectrum(t, head_dim).view(layers, kv_heads, head_dim) if t.dim() == 2 else (
            t.view(layers, kv_heads)
        )
    return out


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
    src = json.loads(repo_path(args.profile).read_text())
    fields = {name: torch.tensor(src[name]) for name in FIELDS}
    order = torch.tensor(json.loads(repo_path(args.order).read_text())["s_hat"])
    if order.shape != fields["mean_ratio"].shape:
        raise ConfigError(f"--order {args.order}: s_hat of shape {tuple(order.shape)}, the profile's heads differ")
    out = map_key_fields(fields, order, args.layers, args.kv_heads, args.head_dim, args.seed)
    data = {name: (t.double() * 1e5).round().div(1e5).tolist() for name, t in out.items()}
    data["source"] = (
        f"quantile map of {Path(args.profile).name} over the s_hat of {Path(args.order).name} (seed {args.seed}), "
        f"spectra resampled to head_dim {args.head_dim} (experiments.key_process.resample_spectrum); measured on: "
        f"{src.get('source', 'unknown')}"
    )
    write_json_atomic(args.out, data)
    print(f"{args.out}: mean ratio {out['mean_ratio'].mean():.3f}, top eig share {out['eig'][..., 0].mean():.3f}")


if __name__ == "__main__":
    main()
