"""A results folder from a reuse profile written by experiments.producers.reuse_profile: record.json (the profile,
copied as it is) and README.md (the distributions, per layer and over all heads, generated from it).

    python -m plots.reuse_profile_readme data/profiles/smollm2-reuse.json results/reuse_profile_smollm2
"""

from __future__ import annotations

import argparse
import json
import shutil

import torch

from kvoffload.paths import repo_path

NAMES = {
    "query_cos": "(a) query cos, adjacent steps",
    "topk_overlap": "(b) top-k overlap, adjacent steps",
    "spec_query_cos": "(c) query cos, speculative vs real",
    "spec_topk_overlap": "(d) top-k overlap, speculative vs real",
}


def _f(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def readme(data: dict, record_name: str = "record.json") -> str:
    prov, budget, m = data["provenance"], data["budget"], data["metrics"]
    git = prov["git"]
    commit = git.get("commit", "unknown")[:7] + (" (dirty tree)" if git.get("dirty") else "")
    p = prov["prompt"]
    steps = data["decode_steps"]
    lines = [
        f"# Token-level reuse of {data['model']}'s decode queries ({prov['weights'].split(' (')[0]}, "
        f"{data['environment']['device']})",
        "",
        "What a synthetic query process has to reproduce besides the head-level query cosine it is calibrated on "
        "today: how much of a KV head's exact top-k survives from one decode step to the next, "
        "and how close the one-layer-ahead speculative query and its top-k are to the real ones.",
        "",
        f"    {prov['command']}",
        "",
        f"- Run: {data['source']}.",
        f"- Prompt: {p.get('resolved') or p['kind']} (workload.prompt={p['kind']}), {p['tokens']} tokens"
        + (f", pass key at depth {p['needle_depth']}" if (p.get("resolved") or p["kind"]) == "needle" else "")
        + f", batch {p['batch']}, seed {p['seed']}; {prov['greedy_tokens']} greedy tokens = {steps} decode steps.",
        f"- Budget: top-k ratio {budget['topk_ratio']}, sink {budget['sink']}, recent {budget['recent']}: "
        f"k = {budget['k']} of {budget['middle_tokens']} middle tokens per KV head (select_budget); exact scores "
        "sum over the query group of q . k (ExactRetriever).",
        f"- Commit {commit}; {prov['wall_s']} s of measurement (model load, prefill and decode) on "
        f"{data['environment']['cpu_count']} CPU cores. Record: `{record_name}` (a copy of the data file), "
        "log: `run.log`.",
        "",
        "Per sample = one decode step of one KV head; (a) and (c) are the mean over the head's query group of each "
        "query head's cosine; (b) and (d) are |S & S'| / k. Layer 0 has no speculative query. The dense layers "
        "(CLO keeps 0 and 1 dense) are measured like the others.",
        "",
        "## Over all heads",
        "",
        "| metric | mean | median | samples per head | layers |",
        "|---|---|---|---|---|",
    ]
    for key, name in NAMES.items():
        a = m[key]["all_heads"]
        layers = m[key]["layers"]
        lines.append(
            f"| {name} | {_f(a['mean'])} | {_f(a['median'])} | {m[key]['samples_per_head']} | "
            f"{layers[0]}..{layers[-1]} |"
        )
    lags = data["lags"]
    lines += [
        "",
        "By lag (mean over all heads): the cosine and the overlap of step t with step t - lag.",
        "",
        "| lag | " + " | ".join(lags["query_cos"]) + " |",
        "|---|" + "---|" * len(lags["query_cos"]),
    ]
    for key in ("query_cos", "topk_overlap"):
        lines.append(f"| {NAMES[key][4:]} | " + " | ".join(_f(v["all_heads_mean"]) for v in lags[key].values()) + " |")
    s_hat = torch.tensor([[float("nan") if v is None else v for v in row] for row in data["s_hat"]])
    ar1 = [float(s_hat.pow(int(lag)).nanmean()) for lag in lags["query_cos"]]
    lines += [
        "| an AR(1) chain at each head's lag-1 mean (s_hat^lag, mean over heads) | "
        + " | ".join(_f(v) for v in ar1)
        + " |",
        "",
    ]
    real_last = lags["query_cos"][list(lags["query_cos"])[-1]]["all_heads_mean"]
    if real_last is not None and real_last > ar1[-1] + 0.05:
        lines.append(
            f"An AR(1) direction process (experiments/workloads/query_process.py) forgets at rho^lag; the real queries "
            f"do not (lag {list(lags['query_cos'])[-1]}: {real_last:.3f} against {ar1[-1]:.3f}): they keep a "
            "persistent part, and the top-k with them."
        )
    lines.append("The process also makes the speculative query equal to the real one: (c) and (d) are 1 under it.")
    lines += comparisons(data)
    lines += [
        "",
        "## Per layer (mean / median over the layer's heads and steps)",
        "",
        "| layer | " + " | ".join(NAMES[k][:3] + " " + NAMES[k][4:] for k in NAMES) + " |",
        "|---|" + "---|" * len(NAMES),
    ]
    L = len(m["query_cos"]["per_layer"]["mean"])
    for layer in range(L):
        cells = [f"{_f(m[k]['per_layer']['mean'][layer])} / {_f(m[k]['per_layer']['median'][layer])}" for k in NAMES]
        lines.append(f"| {layer} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Per KV head: `metrics.<metric>.per_head` (mean, std, q10, q50, q90) and `lags.<metric>.<lag>` "
        "in the record; `s_hat` = (a)'s per-head mean, so the file also reads as a reuse profile.",
        "",
    ]
    return "\n".join(lines)


def comparisons(data: dict) -> list[str]:
    """The same quantities in the tracked measurements of the same model, where they exist."""
    out = []
    model = data["model"]
    s_hat = torch.tensor(data["s_hat"], dtype=torch.float64)
    profile = repo_path(f"data/profiles/{model}.json")
    if profile.is_file():
        ref = json.loads(profile.read_text())
        theirs = torch.tensor(ref["s_hat"], dtype=torch.float64)
        if theirs.shape == s_hat.shape:
            r = torch.corrcoef(torch.stack([s_hat.flatten(), theirs.flatten()]))[0, 1]
            out.append(
                f"- (a) against `data/profiles/{model}.json` ({ref.get('source', '?').split('; ')[-1]}): mean "
                f"{s_hat.mean():.3f} here vs {theirs.mean():.3f} there, "
                f"{(s_hat > 0.8).double().mean() * 100:.0f}% vs {(theirs > 0.8).double().mean() * 100:.0f}% "
                f"of heads above 0.8, per-head correlation {r:.2f}."
            )
    sel = repo_path(f"results/speculative_selection_{model}/record.json")
    if sel.is_file():
        rec = json.loads(sel.read_text())
        first = int(rec["layers"].split("..")[0])
        theirs = torch.tensor(rec["per_head"]["recall_exact_speculative"], dtype=torch.float64)[first:]
        mine = torch.tensor(data["metrics"]["spec_topk_overlap"]["per_head"]["mean"][first:], dtype=torch.float64)
        if theirs.shape == mine.shape:
            r = torch.corrcoef(torch.stack([mine.flatten(), theirs.flatten()]))[0, 1]
            out.append(
                f"- (d) against `results/speculative_selection_{model}/record.json` (its recall of the exact "
                "top-k "
                f"by the speculative query's exact top-k, the same quantity; {rec['source'].split('; ')[-1]}): "
                f"mean over layers {rec['layers']} {mine.mean():.3f} here vs {theirs.mean():.3f} there, "
                f"per-head correlation {r:.2f}."
            )
    return ["", "## Against the other measurements of this model", "", *out] if out else []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile", help="a data file of experiments.producers.reuse_profile")
    ap.add_argument("folder", help="the results folder: record.json and README.md are written there")
    args = ap.parse_args()
    src, folder = repo_path(args.profile), repo_path(args.folder)
    data = json.loads(src.read_text())
    if data.get("experiment") != "reuse_profile":
        raise SystemExit(f"{src}: not a reuse profile (experiment={data.get('experiment')!r})")
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, folder / "record.json")
    (folder / "README.md").write_text(readme(data))
    print(f"{folder / 'record.json'}, {folder / 'README.md'}")


if __name__ == "__main__":
    main()
