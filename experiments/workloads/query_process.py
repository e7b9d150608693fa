"""A synthetic query process for speed runs with synthetic weights, whose queries have no realistic dynamics.

Two forms, chosen by the profile (data/profiles/*.json) it is built from:

- AR(1) (a profile with only `s_hat`, as data/profiles/smollm2.json; what every record before the
  persistent form used): per layer and query head the unit query direction follows
  u_t = normalise(rho * u_{t-1} + sqrt(1 - rho^2) * e), e a fresh random unit vector, rho = the head's s_hat. The
  adjacent-step cosine is then close to rho, but lag L gives rho^L: the chain forgets far faster than real queries
  do (results/reuse_profile_smollm2: lag 8 0.704 measured, 0.296 AR(1)).
- persistent + AR(1) (a profile with `persistent` and `rho`, fitted by --fit from a reuse record of
  experiments.producers.reuse_profile): u_t = sqrt(c) p + sqrt(1 - c) a_t with p a fixed unit direction and a_t an AR(1)
  chain of unit directions orthogonal to p, so cos(u_t, u_{t-L}) = c + (1 - c) rho^L per head (c = `persistent`).
  At the first step p and a_0 are drawn so that u_0 is the model's own query direction.

Speculative query (the one-layer-ahead hook's, docs/systems.md, "Speculative query"): with `spec_cos` in the profile it
is the layer's query direction u_t turned towards an error direction w_t: g u_t + sqrt(1 - g^2) w_t (w_t's part
orthogonal to u_t), g = the head's spec_cos, so its cosine with the real query is g. w_t is a chain of its own with the
query's dynamics (not fresh noise each step: the speculative queries of different steps must stay as alike as the real
ones, which CLO's lookups compare). Without `spec_cos` it equals the real query (perfect speculation). The model's own
query keeps its norm. All state lives on the device and is updated in place: a step replayed from a CUDA graph advances
the chain, with no host sync. On CUDA a call of the persistent form is one launch (kvoffload.kernels.query_chain; this
torch code is its specification), with the same random draws.

    python -m experiments.workloads.query_process data/profiles/smollm2-reuse.json --fit \\
        --out data/profiles/smollm2-process.json        # fit c, rho, spec_cos from a reuse record
    python -m experiments.workloads.query_process data/profiles/smollm2-process.json --layers 32 --kv-heads 8 \\
        --out data/profiles/llama3-from-smollm2-reuse.json   # a profile at another model's shape
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from clo.policy.persistent import load_profile
from kvoffload.errors import ConfigError
from kvoffload.kernels import query_chain
from kvoffload.paths import repo_path, write_json_atomic

FIT_LAGS = (1, 2, 4, 8)
PROCESS_FIELDS = ("persistent", "rho", "spec_cos")


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)


def _orthogonal_noise(like: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """A random unit vector per row orthogonal to the unit rows of u."""
    e = torch.randn_like(like)
    return _unit(e - (e * u).sum(-1, keepdim=True) * u)


class ProfileQueryProcess:
    def __init__(
        self,
        s_hat: torch.Tensor,
        group: int,
        device: torch.device,
        source: str,
        persistent: torch.Tensor | None = None,
        rho: torch.Tensor | None = None,
        spec_cos: torch.Tensor | None = None,
        fused: bool = True,
    ):
        # fused: on CUDA, each call of the persistent form in one launch (kvoffload.kernels.query_chain) instead of
        # some thirty: the process is a workload's cost inside every system's timed step, and should be small
        self.fused = fused and query_chain.triton is not None
        per_q_head = lambda t: t.float().repeat_interleave(group, dim=1).to(device)  # [L, Hkv] -> [L, H]
        self.persistent_form = persistent is not None
        if self.persistent_form:
            if rho is None:
                raise ConfigError("a persistent query process needs rho as well as persistent")
            self.c = per_q_head(persistent.clamp(0.0, 1.0))
            self.rho = per_q_head(rho.clamp(0.0, 1.0))
            self.description = (
                f"synthetic persistent + AR(1) query directions, cos(lag L) = c + (1 - c) rho^L "
                f"per head (c mean {persistent.mean():.3f}, rho mean {rho.mean():.3f}) of {source}"
            )
        else:
            self.rho = s_hat.clamp(-1.0, 1.0).repeat_interleave(group, dim=1).to(device)  # [L, H]
            self.description = f"synthetic AR(1) query directions, rho per head = s_hat of {source}"
        self.spec = None if spec_cos is None else per_q_head(spec_cos.clamp(-1.0, 1.0))
        if self.spec is not None:
            self.description += f"; speculative query at cos spec_cos per head (mean {spec_cos[1:].mean():.3f})"
        if self.fused and self.persistent_form and torch.device(device).type == "cuda":
            self.description += "; one launch a call (kvoffload.kernels.query_chain)"
        self.state: list = [None] * s_hat.shape[0]
        self.err: list = [None] * s_hat.shape[0]  # the speculative error's chain, with spec_cos only
        # (layer, q) -> q: the first query's direction where the model's own means nothing (synthetic weights
        # with a key process: experiments.workloads.key_process.KeyProcess.first_query, group-coherent and key-aligned)
        self.first_query = None

    @classmethod
    def from_profile(
        cls, path: str, num_layers: int, num_kv_heads: int, group: int, device: torch.device, fused: bool = True
    ):
        s_hat, source = load_profile(path, num_layers, num_kv_heads)
        data = json.loads(repo_path(path).read_text())
        fields = {}
        for name in PROCESS_FIELDS:
            if data.get(name) is not None:
                t = torch.tensor(data[name], dtype=torch.float32)
                if t.shape != (num_layers, num_kv_heads):
                    raise ConfigError(
                        f"profile {Path(path).name}: {name} has shape {tuple(t.shape)}, the model "
                        f"needs ({num_layers}, {num_kv_heads})"
                    )
                fields[name] = t
        return cls(s_hat, group, device, source, fused=fused, **fields)

    def query(self, layer: int, q: torch.Tensor, advance: bool, speculative: bool = False) -> torch.Tensor:
        """q [B, H, D] from the model -> the process's query for this layer and step, with q's norms.
        `speculative`: the one-layer-ahead query for this layer (perturbed by spec_cos when the profile has it)."""
        if self.state[layer] is None and self.first_query is not None:
            q = self.first_query(layer, q)
        head_dim = q.shape[-1]
        one_launch = q.is_cuda and self.persistent_form and head_dim & (head_dim - 1) == 0  # Triton: D a power of 2
        if self.fused and one_launch and self.state[layer] is not None:
            err = None if self.spec is None else self.err[layer]
            if self.spec is None or err is not None:  # both chains drawn: their first call is the torch one
                g = None if self.spec is None else self.spec[layer]
                return query_chain.query_chain(
                    q, self.state[layer], err, self.c[layer], self.rho[layer], g, advance, speculative
                )
        norm = q.norm(dim=-1, keepdim=True)
        u = self._persistent(layer, q, norm, advance) if self.persistent_form else self._ar1(layer, q, norm, advance)
        if self.spec is not None:
            w = self._error(layer, u, advance)
            if speculative:
                g = self.spec[layer][None, :, None]
                w = _unit(w - (w * u).sum(-1, keepdim=True) * u)  # the error's part orthogonal to the query
                u = g * u + (1 - g * g).clamp_min(0).sqrt() * w
        return u.to(q.dtype) * norm

    def _error(self, layer: int, u: torch.Tensor, advance: bool) -> torch.Tensor:
        """The speculative query's error direction: a chain of its own with the query's dynamics (c + (1 - c)
        rho^L; AR(1) at rho for the AR(1) form), so that speculative queries of different steps are as alike as
        the real ones are (a fresh error each step would make them alike by only spec_cos^2 times that, and
        CLO's lookups, which compare speculative queries, would miss far too often)."""
        c = self.c[layer][None, :, None] if self.persistent_form else torch.zeros_like(self.rho[layer])[None, :, None]
        if self.err[layer] is None:
            uf = u.float()
            p = _unit(torch.randn_like(uf))
            self.err[layer] = (p, _orthogonal_noise(p, p))
        elif advance:
            p, a = self.err[layer]
            rho = self.rho[layer][None, :, None].float()
            new = rho * a + (1 - rho * rho).clamp_min(0).sqrt() * _orthogonal_noise(a, p)
            a.copy_(_unit(new))
        p, a = self.err[layer]
        return (c.sqrt() * p + (1 - c).sqrt() * a).to(u.dtype)

    def _ar1(self, layer: int, q: torch.Tensor, norm: torch.Tensor, advance: bool) -> torch.Tensor:
        state = self.state[layer]
        if state is None:
            state = self.state[layer] = q / norm.clamp_min(1e-6)
        elif advance:
            rho = self.rho[layer][None, :, None].to(q.dtype)
            noise = torch.randn_like(q)
            noise = noise / noise.norm(dim=-1, keepdim=True)
            new = rho * state + (1 - rho * rho).clamp_min(0).sqrt() * noise
            # in place: a CUDA graph replays reads and writes of this very buffer, so the chain advances on
            # every replay (rebinding a new tensor would replay the captured step's input forever)
            state.copy_(new / new.norm(dim=-1, keepdim=True))
        return state

    def _persistent(self, layer: int, q: torch.Tensor, norm: torch.Tensor, advance: bool) -> torch.Tensor:
        c = self.c[layer][None, :, None]
        sc, sa = c.sqrt(), (1 - c).sqrt()
        if self.state[layer] is None:
            # p and a_0 orthonormal with sqrt(c) p + sqrt(1 - c) a_0 = the model's query direction
            qh = (q / norm.clamp_min(1e-6)).float()
            r = _orthogonal_noise(qh, qh)
            self.state[layer] = (sc * qh + sa * r, sa * qh - sc * r)  # (p, a), fp32, updated in place
        elif advance:
            p, a = self.state[layer]
            rho = self.rho[layer][None, :, None]
            new = rho * a + (1 - rho * rho).clamp_min(0).sqrt() * _orthogonal_noise(a, p)
            a.copy_(_unit(new))  # in place, as in _ar1: graph replays advance the chain
        p, a = self.state[layer]
        return sc * p + sa * a


def fit_persistent(lag_cos: torch.Tensor, lags=FIT_LAGS, grid: int = 1001) -> tuple[torch.Tensor, torch.Tensor]:
    """lag_cos [len(lags), ...] mean query cosines at each lag -> (c, rho) [...], the least-squares fit of
    c + (1 - c) rho^L, c in [0, 1], rho in [0, 1] (a grid over rho, c in closed form for each, then clamped)."""
    shape = lag_cos.shape[1:]
    y = lag_cos.flatten(1).T.float()  # [N, lags]
    r = torch.linspace(0, 1, grid)
    rl = r[:, None] ** torch.tensor(lags, dtype=torch.float32)  # [R, lags]
    a = 1 - rl
    c = (((y[:, None, :] - rl) * a).sum(-1) / (a * a).sum(-1).clamp_min(1e-12)).clamp(0, 1)  # [N, R]
    err = ((c[..., None] * a + rl - y[:, None, :]) ** 2).sum(-1)
    best = err.argmin(1)
    idx = torch.arange(len(y))
    return c[idx, best].view(shape), r[best].view(shape)


def fit_reuse_record(record: dict) -> dict:
    """A reuse record (experiments.producers.reuse_profile) -> the process fields: s_hat, persistent, rho, spec_cos and
    the fit's per-lag mean against the measurement."""
    lag_cos = torch.tensor([record["lags"]["query_cos"][str(lag)]["per_head_mean"] for lag in FIT_LAGS])
    c, rho = fit_persistent(lag_cos)
    spec = torch.tensor(
        [[1.0 if v is None else v for v in row] for row in record["metrics"]["spec_query_cos"]["per_head"]["mean"]]
    )
    lags = torch.tensor(FIT_LAGS, dtype=torch.float32)[:, None, None]
    pred = c + (1 - c) * rho**lags
    return {
        "s_hat": record["s_hat"],
        "persistent": c.tolist(),
        "rho": rho.tolist(),
        "spec_cos": spec.tolist(),
        "fit": {
            "lags": list(FIT_LAGS),
            "measured_mean": lag_cos.mean((1, 2)).tolist(),
            "fitted_mean": pred.mean((1, 2)).tolist(),
            "rmse": ((pred - lag_cos) ** 2).mean().sqrt().item(),
        },
    }


def map_profile(s_hat: torch.Tensor, layers: int, kv_heads: int, seed: int = 0) -> torch.Tensor:
    """Another model's shape from a measured profile: values at evenly spaced quantiles of the measured
    distribution, placed on the heads in a seeded random order."""
    return s_hat.flatten()[_map_index(s_hat, layers, kv_heads, seed)]


def _map_index(s_hat: torch.Tensor, layers: int, kv_heads: int, seed: int) -> torch.Tensor:
    """[layers, kv_heads] indices into s_hat.flatten(): the source heads map_profile places on each head."""
    order = s_hat.flatten().sort().indices
    n = layers * kv_heads
    picks = order[torch.linspace(0, len(order) - 1, n).round().long()]
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return picks[perm].view(layers, kv_heads)


def map_process_fields(fields: dict[str, torch.Tensor], layers: int, kv_heads: int, seed: int = 0) -> dict:
    """map_profile for every field: s_hat, persistent and rho move together (each target head gets one source
    head's triple, so their joint distribution is kept); spec_cos, which depends on depth (the first layers'
    speculation is poor), is the source layer at the same relative depth's mean, on all of that layer's heads."""
    idx = _map_index(fields["s_hat"], layers, kv_heads, seed)
    out = {name: fields[name].flatten()[idx] for name in ("s_hat", "persistent", "rho") if name in fields}
    if "spec_cos" in fields:
        src = fields["spec_cos"].mean(1)  # [Ls]
        pick = (torch.arange(layers) * (len(src) - 1) / max(layers - 1, 1)).round().long()
        out["spec_cos"] = src[pick][:, None].expand(layers, kv_heads).clone()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile")
    ap.add_argument("--fit", action="store_true", help="profile is a reuse record: fit persistent, rho, spec_cos")
    ap.add_argument("--layers", type=int, help="map to this many layers (default: the profile's)")
    ap.add_argument("--kv-heads", type=int, help="map to this many KV heads (default: the profile's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    src = json.loads(repo_path(args.profile).read_text())
    if "s_hat" not in src:
        raise ConfigError(f"{args.profile} has no s_hat")
    name = Path(args.profile).name
    fit = None
    if args.fit:
        fitted = fit_reuse_record(src)
        fit = fitted.pop("fit")
        fields = {k: torch.tensor(v) for k, v in fitted.items()}
        what = f"c + (1 - c) rho^L least-squares fit at lags {list(FIT_LAGS)} of {name}"
    else:
        fields = {k: torch.tensor(src[k]) for k in ("s_hat",) + PROCESS_FIELDS if src.get(k) is not None}
        what = name
    shape = tuple(fields["s_hat"].shape)
    layers, kv_heads = args.layers or shape[0], args.kv_heads or shape[1]
    if (layers, kv_heads) != shape:
        if set(fields) == {"s_hat"}:  # an s_hat-only profile maps as it always has
            fields = {"s_hat": map_profile(fields["s_hat"], layers, kv_heads, args.seed)}
        else:
            fields = map_process_fields(fields, layers, kv_heads, args.seed)
        what = f"quantile map of {what} (seed {args.seed})"
    out = {k: v.tolist() for k, v in fields.items()}
    out["source"] = f"{what}; measured on: {src.get('source', 'unknown')}"
    if fit is not None:
        out["fit"] = fit
    write_json_atomic(args.out, out)
    s = fields["s_hat"]
    msg = f"{args.out}: s_hat mean {s.mean():.3f}, {(s > 0.8).float().mean() * 100:.0f}% above 0.8"
    if "persistent" in fields:
        msg += f"; c mean {fields['persistent'].mean():.3f}, rho mean {fields['rho'].mean():.3f}"
    if "spec_cos" in fields:
        msg += f"; spec_cos mean (layers 1..) {fields['spec_cos'][1:].mean():.3f}"
    print(msg)


if __name__ == "__main__":
    main()
