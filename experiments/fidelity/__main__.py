"""`python -m experiments.fidelity [system=...] [workload.length=2k] [workload.steps=256] [workload.documents=24]`

The fidelity workload (conf/workload/fidelity.yaml, chosen unless the command line names another): real weights,
long natural-language documents (experiments/fidelity/documents.py), the last `steps` tokens of each teacher-forced
through the system, every step compared with exact attention (experiments/fidelity/measure.py). `--multirun
system=fullattn,clo,...` compares systems; the jobs of one process share the weights and each document's reference
pass. Each run writes <results_dir>/<its overrides>/record.json: per document the means of KL, top-1 agreement and
the true token's log-likelihood, with intervals over documents, the hit rate and bytes per step of the same run.
Bad input is one `error:` line and exit status 2, before the weights are loaded."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from experiments.accuracy.backbone import PrefillCache, backbone_for
from experiments.accuracy.job import default_workload, run_job
from experiments.fidelity import documents as docs
from experiments.fidelity.measure import METRICS, prefix_tokens, reference, teacher_forced
from experiments.runner import cli_checks, run_settings
from experiments.runner.execute import build_system, load_tokenizer
from experiments.runner.records import environment
from kvoffload.errors import ConfigError
from kvoffload.kv.interface import GB, KVOffloadSystem
from kvoffload.model.config import ModelConfig
from plots.bootstrap import interval

_REFERENCES: PrefillCache | None = None  # documents' reference passes, kept for the sweep's next jobs
_DOCUMENTS: dict[tuple, list[docs.Document]] = {}


def settings(cfg: DictConfig) -> dict:
    """The workload's settings, checked against the model before any work."""
    w = cfg.workload
    if w.get("name") != "fidelity":
        raise ConfigError(f"workload={w.get('name')}: experiments.fidelity runs workload=fidelity")
    model = ModelConfig.from_mapping(OmegaConf.to_container(cfg.model, resolve=True))
    cap = model.max_position_embeddings
    length = run_settings.parse_tokens(w.length, "workload.length")
    if length > cap:
        raise ConfigError(f"workload.length={w.length}: {length} tokens exceed model={model.name}'s context of {cap}")
    steps = run_settings.integer(w.steps, "workload.steps", 1)
    if steps >= length - 1:
        raise ConfigError(
            f"workload.steps={steps} must be below workload.length - 1 = {length - 1} (a prefix is needed)"
        )
    return {
        "source": w.source,
        "folder": docs.sources_dir(w.source, w.get("docs_dir")),
        "length": length,
        "steps": steps,
        "prefix": prefix_tokens(length, steps),
        "documents": run_settings.integer(w.documents, "workload.documents", 2),
        "batch": run_settings.integer(w.get("batch", 1), "workload.batch", 1),
        "seed": run_settings.integer(w.seed, "workload.seed", 0),
        "min_tokens": cap,  # every length reads the first tokens of the same files
        "resamples": run_settings.integer(w.get("resamples", 2000), "workload.resamples", 100),
        "cache_gb": run_settings.number(w.get("cache_gb", 0), "workload.cache_gb", 0.0),
    }


def documents(s: dict, tokenizer) -> list[docs.Document]:
    folder = s["folder"]
    key = (str(folder), s["documents"], s["min_tokens"], s["length"], s["seed"])
    if key not in _DOCUMENTS:
        _DOCUMENTS.clear()
        _DOCUMENTS[key] = docs.select(folder, tokenizer, s["documents"], s["min_tokens"], s["length"], s["seed"])
    return _DOCUMENTS[key]


def references(gb: float) -> PrefillCache:
    global _REFERENCES
    if _REFERENCES is None or _REFERENCES.max_bytes != int(gb * GB):
        _REFERENCES = PrefillCache(int(gb * GB))
    return _REFERENCES


def planned(backbone, cache: PrefillCache, *args) -> KVOffloadSystem:
    """backbone.system(*args); a system refused while the reference cache holds documents gets the cache's memory:
    the cache only saves recomputing references for the sweep's next jobs, so it must not stop this one."""
    try:
        return backbone.system(*args)
    except ConfigError:
        if not cache.entries:
            raise
        print(f"[fidelity] {cache.used / GB:.1f} GB of cached references dropped for the system", file=sys.stderr)
        cache.clear()
        return backbone.system(*args)


def run(cfg: DictConfig, system_name: str, identity: list[str]) -> dict:
    s = settings(cfg)
    # the system's own settings and kv_dtype refused now, before the weights load
    run_settings.kv_dtype(cfg, build_system(cfg.system, system_name), system_name)
    source = run_settings.weights_source(cfg.model)
    if source == "synthetic":
        raise ConfigError(f"model={cfg.model.name} has synthetic weights: fidelity needs real ones")
    tokenizer = load_tokenizer(source, cfg.model)
    if tokenizer is None:
        raise ConfigError(f"model={cfg.model.name}: no tokenizer files next to its weights")
    chosen = documents(s, tokenizer)
    backbone = backbone_for(cfg)
    cache = references(s["cache_gb"])
    cache.begin_job()
    per_doc, batches, state, computed, t_start = [], [], None, 0, time.perf_counter()
    for at in range(0, len(chosen), s["batch"]):
        group, refs = chosen[at : at + s["batch"]], []
        for doc in group:
            key = ("fidelity", s["steps"], *doc.ids)
            ref = cache.get(key)
            if ref is None:
                ref, computed = reference(backbone, doc, s["steps"]), computed + 1
                cache.put(key, ref)
            refs.append(ref)
        # the documents share a batch only to share the CPU's weight reads: each is planned as one sequence (Eq. 12
        # divides a layer's time among the batch's sequences, so the batch gets the time of as many layers)
        layer_s = backbone.layer_time_s * len(group)
        system = planned(backbone, cache, cfg.system, system_name, s["prefix"], s["steps"], len(group), layer_s)
        results, cost = teacher_forced(backbone, system, group, refs, window(cfg.system, system, s["prefix"]))
        state = system.describe()
        del system, refs
        per_doc += results
        batches.append(cost)
        top1 = sum(r["top1"] for r in results) / len(results)
        print(
            f"[fidelity] {system_name}: documents {at + 1}-{at + len(group)} of {len(chosen)}, top-1 {top1:.3f}"
            f"{resident()}",
            file=sys.stderr,
        )
    for d in per_doc:
        d["dll"] = d["ll"] - d["ll_ref"]
    measured = [m for m in (*METRICS, "dll", "recall", "mass") if all(m in d for d in per_doc)]
    summary = {
        m: dict(zip(("mean", "low", "high"), interval([d[m] for d in per_doc], s["resamples"]))) for m in measured
    }
    lookups = sum(b["lookups"] for b in batches)
    folder = s["folder"]
    return {
        "system": system_name,
        "label": label(system_name, identity),
        "model": backbone.model_cfg.name,
        "weights": backbone.weights,
        "workload": {k: v for k, v in s.items() if k != "folder"},
        "documents": [{"name": d.name, "sha256": d.sha256} for d in chosen],
        "document_source": {"package": docs.package_version(folder), "folder_name": folder.name},
        "plan_inputs": backbone.plan_inputs,
        "per_document": per_doc,
        "summary": summary,
        "hit_rate": sum(b["hits"] for b in batches) / lookups if lookups else None,
        "bytes_h2d_per_step": _mean(b["bytes_h2d_per_step"] for b in batches),  # per sequence
        "decode_ms_per_step": _mean(b["decode_ms_per_step"] for b in batches),  # per batch of `batch` documents
        "batches": batches,
        "per_layer": per_layer(batches),
        "references_computed": computed,
        "wall_s": round(time.perf_counter() - t_start, 2),
        "system_state": state,
        "environment": environment(backbone.device),
    }


def window(system_cfg: DictConfig, system: KVOffloadSystem, prompt_len: int) -> tuple[int, int] | None:
    """A sparse system's (sink, recent), for SelectionProbe: what it says it attends whole of the prompt, else its
    settings; None for one that attends everything."""
    said = system.always_attended(prompt_len)
    if said is not None:
        return said
    if "sink" not in system_cfg or "recent" not in system_cfg:
        return None
    return int(system_cfg.sink), int(system_cfg.recent)


def per_layer(batches: list[dict]) -> dict[str, dict[str, float]]:
    """Per sparse layer, recall and mass over every document (each batch weighted by its documents)."""
    out: dict[str, dict[str, float]] = {}
    total = sum(b["docs"] for b in batches if "per_layer" in b)
    for b in batches:
        for layer, (recall, mass) in b.get("per_layer", {}).items():
            row = out.setdefault(layer, {"recall": 0.0, "mass": 0.0})
            row["recall"] += recall * b["docs"] / total
            row["mass"] += mass * b["docs"] / total
    return out


def label(system_name: str, identity: list[str]) -> str:
    """The system and the settings that tell this run from the others of its sweep (not the workload's)."""
    shared = ("workload.", "workload=", "system=", "+experiment=")
    return " ".join([system_name, *(o for o in identity if not o.startswith(shared))])


def resident() -> str:
    """The process's resident memory, for the progress line: a long sweep that grows shows it before it is refused."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):  # not Linux
        return ""
    return f", resident {pages * os.sysconf('SC_PAGE_SIZE') / GB:.2f} GB"


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def summary_lines(rec: dict) -> list[str]:
    s, w = rec["summary"], rec["workload"]

    def show(m: str, scale: float = 1.0) -> str:
        return f"{s[m]['mean'] * scale:.4g} [{s[m]['low'] * scale:.4g}, {s[m]['high'] * scale:.4g}]"

    return [
        f"== fidelity | {rec['label']} | {rec['model']} ({rec['weights']}) | {w['documents']} documents of "
        f"{w['length']} tokens, the last {w['steps']} teacher-forced",
        f"   KL(ref || system) {show('kl')} nats; top-1 agreement {show('top1', 100)} %; "
        f"log-likelihood vs ref {show('dll')} nats/token",
        f"   hit rate {rec['hit_rate']}, {rec['bytes_h2d_per_step']} bytes/step host->device, "
        f"{rec['decode_ms_per_step']:.1f} ms/step",
    ]


@hydra.main(config_path="../../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> dict:
    return run_job("fidelity", cfg, run, summary_lines)


def cli() -> None:
    default_workload("fidelity")
    cli_checks.refuse_unknown_keys()
    main()


if __name__ == "__main__":
    cli()
