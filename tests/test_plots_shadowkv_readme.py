"""results/shadowkv/README.md's block (plots.shadowkv_readme): the paired fidelity gap the committed records give,
and CLO / ShadowKV-style's throughput at the Figure 10 points where both ran, or a sentence that none did."""

import shutil

from plots import shadowkv_readme
from tests.plot_helpers import RESULTS, run_record, write


def test_fidelity_is_the_paired_gap_at_the_matched_budget():
    (line,) = shadowkv_readme.fidelity_side(RESULTS)
    assert line.startswith("- **Fidelity at 2K**, both at top-k 10 % (64 documents)") and "top-1 agreement -" in line


def test_speed_is_clo_over_shadowkv_where_both_ran(tmp_path):
    assert "no GPU run of ShadowKV-style" in shadowkv_readme.speed(tmp_path)[0]
    recs = {}
    for system, tps in (("clo", 120.0), ("shadowkv", 80.0), ("retroinfer", 60.0)):
        rec = run_record(system, batch=4)
        rec["metrics"]["decode_tokens_per_s"] = tps
        recs[f"record_{system}.json"] = rec
    write(tmp_path / "fig10_throughput", recs)
    assert shadowkv_readme.speed(tmp_path) == [
        "- **Decode throughput**, CLO / ShadowKV-style (`fig10_throughput`): 128K BSZ 4 1.50x."
    ]


def test_memory_waits_for_a_table_with_both(tmp_path):
    shutil.copytree(RESULTS / "tab6_memory_link21", tmp_path / "tab6_memory")
    device, host = shadowkv_readme.memory(tmp_path)
    assert "128K 2.60 / 8.19" in device and "the sequences before it refuses a batch" in host
