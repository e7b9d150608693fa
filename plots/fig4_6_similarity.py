"""Paper Figures 4-6 from experiments/producers/fig4_6_similarity.py's record: (a) the distribution of every decode
step's adjacent-step query cosine, per step and query head, and of each head's mean; (b) each head's mean as a heat map
over layers; (c) the adjacent-step overlap of each KV head's exact top-k. The paper's 0.8 line is drawn.

    python -m plots.fig4_6_similarity results/fig4_6_similarity_smollm2 --out fig4_6.png
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from plots import paper  # noqa: E402
from plots.markdown import f1, md, source  # noqa: E402
from plots.records import RecordError, cli, load_files, one_value, plot_arguments, save  # noqa: E402


def data(root: Path) -> dict:
    """{"cos": [L, H, S] array, "overlap": [L, Hkv, S], "head_mean": [L, H], "above": fraction of samples above
    0.8, "heads_above": fraction of heads whose mean is, "model", "steps", "records"}."""
    recs = load_files(root, "record*.json", lambda r: r.get("experiment") == "fig4_6_similarity", "similarity records")
    if len(recs) > 1:
        raise RecordError(f"one similarity record per figure; under {root}: {', '.join(recs.files)}")
    rec = recs.rows[0]["record"]
    cos, overlap = np.array(rec["query_cos"], dtype=float), np.array(rec["topk_overlap"], dtype=float)
    shape = rec["shape"]
    if (
        cos.ndim != 3
        or cos.shape[:2] != (shape["layers"], shape["heads"])
        or overlap.shape[:2]
        != (
            shape["layers"],
            shape["kv_heads"],
        )
    ):
        raise RecordError(f"{recs.files[0]}: sample arrays {cos.shape} / {overlap.shape} do not match {shape}")
    cut = paper.FIG4_6_COSINE
    head_mean = cos.mean(-1)
    return {
        "cos": cos,
        "overlap": overlap,
        "head_mean": head_mean,
        "above": float((cos > cut).mean()),
        "heads_above": float((head_mean > cut).mean()),
        "model": one_value(recs, lambda r: r["model"], "models"),
        "steps": cos.shape[-1],
        "records": recs,
    }


def plot(root: Path, out: Path) -> dict:
    d = data(root)
    cut = paper.FIG4_6_COSINE
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(13, 4), gridspec_kw={"width_ratios": [1.2, 1, 1]})
    bins = np.linspace(-1, 1, 81)
    a.hist(d["cos"].ravel(), bins=bins, density=True, alpha=0.6, label="every step and query head")
    a.hist(d["head_mean"].ravel(), bins=bins, density=True, histtype="step", lw=1.5, label="per-head mean")
    a.axvline(cut, color="black", ls="--", label=f"{paper.FIG4_6}")
    a.set_xlim(min(0.0, float(np.percentile(d["cos"], 1))), 1)
    a.set_xlabel("cos(q_t, q_t-1)")
    a.set_title(
        f"{d['above'] * 100:.0f}% of samples, {d['heads_above'] * 100:.0f}% of heads' means > {cut}", fontsize=8
    )
    a.legend(fontsize=7, loc="upper left")
    im = b.imshow(d["head_mean"], aspect="auto", cmap="viridis", vmin=min(0.5, d["head_mean"].min()), vmax=1)
    b.set_xlabel("query head")
    b.set_ylabel("layer")
    b.set_title("per-head mean cosine", fontsize=8)
    fig.colorbar(im, ax=b)
    c.hist(d["overlap"].ravel(), bins=np.linspace(0, 1, 41), alpha=0.7, density=True)
    c.set_xlabel("|S_t & S_t-1| / k (exact top-k, per KV head)")
    c.set_title(f"top-k overlap, adjacent steps: mean {d['overlap'].mean():.2f}", fontsize=8)
    fig.suptitle(
        f"Query similarity of adjacent steps: {d['model']}, real weights, {d['steps']} step pairs",
        fontsize=9,
    )
    save(fig, out)
    return d


def table(root: Path, folder: str) -> str:
    d = data(root)
    cut = paper.FIG4_6_COSINE
    rows = [
        [f"samples (step x query head) with cosine > {cut}", f1(d["above"] * 100, "%"), paper.FIG4_6],
        [f"heads whose mean cosine > {cut}", f1(d["heads_above"] * 100, "%"), paper.FIG4_6],
        ["mean adjacent-step query cosine", f"{d['cos'].mean():.3f}", None],
        ["mean adjacent-step top-k overlap", f"{d['overlap'].mean():.3f}", None],
    ]
    return (
        md(["quantity", "ours", "paper"], rows)
        + f"\n\n{d['model']}, {d['steps']} step pairs. "
        + source(folder, d["records"])
    )


def main() -> None:
    ap = plot_arguments(__doc__)
    args = ap.parse_args()
    d = plot(args.root, args.out)
    print(f"{d['above'] * 100:.1f}% of samples and {d['heads_above'] * 100:.1f}% of heads above {paper.FIG4_6_COSINE}")


if __name__ == "__main__":
    cli(main)
