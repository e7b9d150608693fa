"""The README's tables, printed from the records beside this file:
python results/investigations/link_cap_fig10_h100/table.py"""

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def load(name: str) -> dict:
    return json.loads((HERE / f"record_{name}.json").read_text())


def row(name: str) -> str:
    r = load(name)
    m, plan = r["metrics"], (r.get("system_state") or {}).get("plan") or {}
    link = r["config"]["hardware"].get("link_gb_s")
    heads = f"{plan['persistent_heads']} / {plan['prefetch_heads']}" if plan else "–"
    return (
        f"| {r['system']} | {r['seqlen'] // 1024}K BSZ {r['batch']} | {link or 'native'} | "
        f"{m['decode_tokens_per_s']:.1f} | {m['decode_ms_per_step']:.2f} | {m['system_floor_ms_per_step']:.2f} | "
        f"{m['step_over_system_floor']:.2f} | {m['bytes_h2d_per_step'] / 1e6:.1f} | {heads} |"
    )


def ratio(point: str, link: str) -> str:
    clo = load(f"clo_{point}_{link}")["metrics"]["decode_tokens_per_s"]
    base = {s: load(f"{s}_{point}_{link}")["metrics"]["decode_tokens_per_s"] for s in ("retroinfer", "infinigen")
            if (HERE / f"record_{s}_{point}_{link}.json").exists()}  # fmt: skip
    best = max(base, key=base.get)
    return f"| {point.replace('_b', ' BSZ ').upper()} | {link} | {clo / base[best]:.2f}x ({best}) |"


if __name__ == "__main__":
    print("| system | point | link (GB/s) | tokens/s | ms/step | its floor (ms) | step / floor | MB/step moved "
          "| CLO persistent / prefetch heads |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for point in ("128k_b1", "32k_b8"):
        for system in ("clo", "retroinfer", "infinigen"):
            for link in ("cap21.21", "native"):
                if (HERE / f"record_{system}_{point}_{link}.json").exists():
                    print(row(f"{system}_{point}_{link}"))
    fa = load("fullattn_128k_b1")["metrics"]
    print(f"\nFullAttn 128K BSZ 1: {fa['decode_tokens_per_s']:.1f} tokens/s, {fa['decode_ms_per_step']:.2f} ms/step.\n")
    print("| point | link | CLO / best offloading baseline |")
    print("|---|---|---|")
    for point in ("128k_b1", "32k_b8"):
        for link in ("cap21.21", "native"):
            print(ratio(point, link))
