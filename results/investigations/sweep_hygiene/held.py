"""What an inline sweep's first job leaves on the device: live tensors, the caching allocator's reserve, cuBLAS
workspaces, and the rest (the context's loaded code). A two-job inline sweep whose release between jobs is done in
steps, each step's free memory printed.
    python results/investigations/sweep_hygiene/held.py   # on a GPU machine, from the repository root"""

import gc
import sys
from pathlib import Path

import torch

import experiments.run as run

plain = run.release_memory  # the runner's own release, after the steps below


def show(step: str) -> None:
    free, gb = torch.cuda.mem_get_info()[0], 1e9
    print(f"[held] {step}: free {free / gb:.3f}, allocated {torch.cuda.memory_allocated() / gb:.3f}, "
          f"reserved {torch.cuda.memory_reserved() / gb:.3f} GB", flush=True)  # fmt: skip


def release_in_steps() -> None:
    if torch.cuda.is_initialized():
        show("job's end")
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        show("after gc and empty_cache")
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()
        show("after cuBLAS workspaces")
    plain()


# Hydra finds conf/ from the task's file when its module is __main__ (as `python -m experiments.run` runs it), so the
# runner's source runs here as __main__, with its last line's cli() left for after the patch
source = Path(run.__file__).read_text().replace('if __name__ == "__main__":\n    cli()', "")
namespace = {"__name__": "__main__", "__file__": run.__file__}
exec(compile(source, run.__file__, "exec"), namespace)
namespace["release_memory"] = release_in_steps
sys.argv = ["run", "--multirun", "model.weights=synthetic", "seqlen=4k", "workload.gen_tokens=4",
            "wandb.enabled=false", "results_dir=/tmp/held", "job_process=inline", "system=clo,fullattn"]  # fmt: skip
namespace["cli"]()
