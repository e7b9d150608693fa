"""hydra/launcher=slurm's launcher (conf/hydra/launcher/slurm.yaml). Hydra instantiates launchers only from the
hydra_plugins package, so the class is here; what it does is experiments.runner.slurm_launcher's, imported when a
sweep launches (Hydra imports every plugin module at each start, and submitit costs a tenth of a second)."""

from collections.abc import Sequence

from hydra.core.utils import JobReturn

try:
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher as Upstream
except ImportError:  # no `slurm` extra: no launcher, and no warning from Hydra's plugin scan at every start
    Upstream = None

if Upstream is not None:

    class SlurmLauncher(Upstream):
        """Upstream's, except that a job which leaves no result (scancel, its time limit, a lost node) is a row of
        the sweep's table saying so, not a traceback that ends the sweep."""

        def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
            from experiments.runner.slurm_launcher import launch

            return launch(self, job_overrides, initial_job_idx)
