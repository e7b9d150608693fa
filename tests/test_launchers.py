"""The sweep launchers: Slurm (one GPU per job, the sbatch script submitit would submit). No Slurm here: this
checks the configuration, not a run on a cluster."""

import os
import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parent.parent


def composed(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=True)


def test_the_default_launcher_is_hydras_basic_one():
    cfg = composed()
    assert cfg.hydra.runtime.choices["hydra/launcher"] == "basic"


# ---- Slurm -----------------------------------------------------------------------------------------------------
def test_slurm_submits_one_gpu_per_job_to_the_partition_given(tmp_path, monkeypatch):
    pytest.importorskip(
        "hydra_plugins.hydra_submitit_launcher", reason="hydra-submitit-launcher is not installed (the `slurm` extra)"
    )
    import submitit
    from hydra.utils import instantiate

    cfg = composed("hydra/launcher=slurm", "hydra.launcher.partition=gpu-a100", f"hydra.sweep.dir={tmp_path}")
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher") and launcher.partition == "gpu-a100"
    assert (launcher.gpus_per_node, launcher.tasks_per_node, launcher.nodes) == (1, 1, 1)

    class Script(Exception):
        pass

    class Recording(submitit.AutoExecutor):  # renders the sbatch script the launcher would submit, submits nothing
        def map_array(self, fn, *args):
            raise Script(self._executor._make_submission_file_text("<the job>", "uid"))

    monkeypatch.setattr(submitit, "AutoExecutor", Recording)
    fake = tmp_path / "bin"  # submitit's Slurm executor checks that srun exists
    fake.mkdir()
    (fake / "srun").write_text("#!/bin/sh\nexit 1\n")
    (fake / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    plugin = instantiate(launcher)
    plugin.setup(hydra_context=None, task_function=None, config=cfg)
    with pytest.raises(Script) as script:
        plugin.launch([["seqlen=4k"], ["seqlen=32k"]], initial_job_idx=0)
    sbatch = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)$", str(script.value), re.M))
    assert sbatch["partition"] == "gpu-a100" and sbatch["gpus-per-node"] == "1"
    assert sbatch["ntasks-per-node"] == "1" and sbatch["nodes"] == "1"
    assert sbatch["time"] == str(launcher.timeout_min) and sbatch["cpus-per-task"] == str(launcher.cpus_per_task)
