"""The command line, checked before Hydra composes it and before any job starts: its keys (a typo, a `+key` that
nothing reads), its config groups' options (`system=cl0`), and, for experiments.run, every job it would run
composed and its numbers checked (`seqlen=1k,abc` is refused before the 1k job, not after it; what does not fit
is the job's to refuse and record). Each problem is one `error:` line and exit status 2, where Hydra would print
a block or a sweep would fail half-way."""

from __future__ import annotations

import copy
import difflib
import functools
import re
import sys
from pathlib import Path

from kvoffload.errors import ConfigError

CONF = Path(__file__).resolve().parents[2] / "conf"
# Sections whose keys are all in their yaml: a `+section.key=` append adds a setting that nothing reads.
SECTIONS = ("model", "system", "workload", "hardware", "wandb")


@functools.cache  # the files do not change while a command runs
def top_level_keys() -> tuple[set[str], set[str]]:
    """(keys, config groups) that a command line may name at the top level: the primary config's keys, those the
    experiment bundles (package _global_) set, and the config groups (conf/<group>/, e.g. +experiment=...)."""
    from omegaconf import OmegaConf

    keys = {"hydra"}
    for path in [CONF / "config.yaml", *sorted((CONF / "experiment").glob("*.yaml"))]:
        keys |= {str(k) for k in OmegaConf.load(path) if k != "defaults"}
    groups = {p.name for p in CONF.iterdir() if p.is_dir() and p.name != "hydra" and any(p.glob("*.yaml"))}
    return keys - groups, groups


def check_override_keys(overrides: list[str], extra: tuple[str, ...] = (), choices: bool = True) -> None:
    """Refuses a command-line override whose top-level key is no key of the config (a typo such as `sytem=clo`,
    or `+sytem=clo`, which Hydra would add and the run would ignore), a `+section.key=` append into one of the
    project's own sections (the key is new, so nothing reads it), and with `choices` an option a config group of
    conf/ does not have. `extra`: top-level keys the entry point itself reads (e.g. experiments.producers.profile's
    +profile_out). Overrides Hydra cannot parse are left to Hydra."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    keys, groups = top_level_keys()
    valid = keys | groups | set(extra)
    parser = OverridesParser.create()
    for text in overrides:
        try:
            o = parser.parse_override(text)
        except HydraException:
            continue
        key = o.key_or_group
        top = re.split(r"[./]", key)[0]
        if top not in valid:
            near = difflib.get_close_matches(top, sorted(valid), n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise ConfigError(
                f"unknown key {top!r} in {text!r}{hint}; the top-level keys are {', '.join(sorted(keys | set(extra)))}"
                f" and the config groups {', '.join(sorted(groups))}"
            )
        if choices and key in groups and not o.is_delete():
            check_group_choice(o, text)
        if o.is_add() and top in SECTIONS and "." in key:
            where = f"conf/{top}/*.yaml" if top in groups else "conf/config.yaml"
            raise ConfigError(
                f"{text!r} adds a setting {key!r} that nothing reads: {top}'s settings are the keys in "
                f"{where}, set without '+'"
            )


# Hydra's flags that take the next argument as their value (hydra._internal.utils.get_args_parser).
_VALUE_FLAGS = {
    "--shell-completion",
    "-sc",
    "--config-path",
    "-cp",
    "--config-name",
    "-cn",
    "--config-dir",
    "-cd",
    "--cfg",
    "-c",
    "--package",
    "-p",
    "--info",
    "-i",
    "--experimental-rerun",
}


def command_line_overrides(argv: list[str]) -> list[str]:
    """The overrides of a Hydra command line: its arguments that are neither flags nor a flag's value."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a.startswith("-"):
            skip = a in _VALUE_FLAGS
        elif "=" in a or a.startswith("~"):
            out.append(a)
    return out


def refuse_unknown_keys(argv: list[str] | None = None, extra: tuple[str, ...] = (), jobs: bool = False) -> list:
    """check_override_keys() on a command line (before Hydra composes it), and with `jobs` check_jobs() (the run
    command's): one `error:` line, exit status 2. A command line that brings its own config (--config-dir, ...)
    has only its keys checked: its groups' options are Hydra's to find. Returns check_jobs()'s numbers, if run."""
    argv = sys.argv[1:] if argv is None else argv
    ours = not {a.split("=", 1)[0] for a in argv} & _CONFIG_FLAGS
    try:
        check_override_keys(command_line_overrides(argv), extra, choices=ours)
        check_launcher(argv)
        if jobs and ours and not _PRINT_FLAGS & set(argv):
            return check_jobs(argv)
        return []
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def check_launcher(argv: list[str]) -> None:
    """A --multirun with hydra/launcher=slurm on a machine that cannot submit (no sbatch or srun on PATH, no
    cluster they reach, or no hydra-submitit-launcher): refused before any work, where submitit would end the sweep
    in a traceback."""
    import importlib.util
    import shutil
    import subprocess

    launchers = [o.split("=", 1)[1] for o in command_line_overrides(argv) if o.split("=", 1)[0] == "hydra/launcher"]
    if "slurm" not in launchers or not {"-m", "--multirun"} & set(argv):
        return
    missing = [b for b in ("sbatch", "srun") if shutil.which(b) is None]
    if missing:
        raise ConfigError(
            f"hydra/launcher=slurm needs Slurm's sbatch and srun on PATH; {' and '.join(missing)} not found: run it "
            "where jobs can be submitted (a cluster's login node), or start a one-node cluster here with "
            "scripts/slurm_local.sh (docs/scaleout.md)"
        )
    try:  # the commands may be installed with no cluster configured (Debian's packages alone): ask it
        p = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=30)
        reason = (p.stderr.strip().splitlines() or [f"exit status {p.returncode}"])[-1] if p.returncode else None
    except (OSError, subprocess.TimeoutExpired) as e:
        reason = str(e)
    if reason:
        raise ConfigError(
            f"hydra/launcher=slurm: sbatch and srun are here but reach no Slurm cluster ({reason}); set "
            "SLURM_CONF to your cluster's slurm.conf, or start a one-node cluster with scripts/slurm_local.sh "
            "(docs/scaleout.md)"
        )
    if importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None:
        raise ConfigError(
            "hydra/launcher=slurm needs hydra-submitit-launcher: pip install -e '.[slurm]' (docs/scaleout.md)"
        )


def group_options(group: str) -> list[str]:
    """The options of a config group: conf/<group>/<option>.yaml."""
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def values_of(override) -> list[str]:
    """The values a parsed override sets: one, or each of a choice sweep's (a range or interval: none, Hydra's)."""
    if override.is_sweep_override():
        return [str(v) for v in override.sweep_string_iterator()] if override.is_discrete_sweep() else []
    value = override.value()
    return [str(value)] if isinstance(value, str | int | float) else []


def check_group_choice(override, text: str) -> None:
    """`system=cl0` (or `system=clo,cl0`): an option the group does not have, refused with the options."""
    group = override.key_or_group
    options = group_options(group)
    for value in values_of(override):
        if value not in options and not value.startswith("${"):
            near = difflib.get_close_matches(value, options, n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise ConfigError(
                f"{group}={value!r} in {text!r} is no {group} config{hint}; the options: {', '.join(options)}"
            )


# ---- every job of a run command, composed and checked before the first starts -------------------------------
# flags that point Hydra at another config, and flags after which it prints instead of running
_CONFIG_FLAGS = {"--config-dir", "-cd", "--config-path", "-cp", "--config-name", "-cn"}
_PRINT_FLAGS = {"--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "-i", "--shell-completion", "-sc"}


def compose(overrides: list[str], hydra: bool = False):
    """The config the overrides compose to (Hydra's compose API; the `hydra` section only with hydra=True). The
    launcher's and Hydra's own overrides are left out: they do not change a job's config."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    job = [o for o in overrides if not o.lstrip("+~").startswith("hydra")]
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return hydra_compose("config", job, return_hydra_config=hydra)


def job_overrides(argv: list[str]) -> list[list[str]]:
    """The overrides of each job a command line runs: itself, or under --multirun its sweeps crossed with its
    bundle's hydra.sweeper.params, as Hydra's basic sweeper crosses them (the command line's value of a key wins);
    none where Hydra cannot parse them (its own error says why)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    overrides = command_line_overrides(argv)
    parser = OverridesParser.create()
    try:
        parsed = parser.parse_overrides(overrides)
    except HydraException:  # Hydra says what it cannot parse, before any job
        return []
    if not {"-m", "--multirun"} & set(argv):
        return [overrides]
    fixed = [t for t, o in zip(overrides, parsed) if not o.is_sweep_override()]
    try:
        params = compose(fixed, hydra=True).hydra.sweeper.get("params") or {}
    except HydraException as e:  # as Hydra's own sweep would end, before any job
        swept = {o.key_or_group: t for t, o in zip(overrides, parsed) if o.is_sweep_override()}
        raise ConfigError(composition_error(e, fixed, swept)) from e
    bundle = [f"{k}={v}" for k, v in params.items()]
    return BasicSweeper.split_arguments(parser.parse_overrides(bundle + overrides), None)[0]


def composition_error(error: Exception, job: list[str], swept: dict[str, str] | None = None) -> str:
    """Hydra's composition error as one line; a setting the job's config group option lacks (Hydra: `Key 'eta' is
    not in struct`, and a `+system.eta` hint that the key check then refuses) names the options that have it.
    swept: a --multirun's sweeps by key, whose config Hydra composes from the overrides that do not sweep, so a
    setting of a swept group's options (`system=clo,retroinfer system.sink=32`) meets the group's default: that
    is said, with the override that sets it in each job (`++`: add or replace)."""
    message = f"{error}\n{error.__cause__ or ''}"
    lines = [x.strip() for x in message.splitlines() if x.strip()]
    m = re.match(r"Could not override '([\w.]+)'", lines[0]) if lines else None
    if not (m and any("not in struct" in x for x in lines)):
        return lines[0] if lines else message
    key = m.group(1)
    group, _, setting = key.partition(".")
    text = next((t for t in job if t.lstrip("+~").split("=", 1)[0] == key), None)
    if swept and group in swept and group in top_level_keys()[1] and text is not None:
        return (
            f"{key}: a --multirun composes its config before it sweeps {swept[group]}, with the default {group}, "
            f"which has no setting {setting!r}; write ++{text.lstrip('+')} to set it in each job"
        )
    return missing_setting(key, job) or lines[0]


def missing_setting(key: str, job: list[str]) -> str | None:
    """`system.eta: system=fullattn has no setting 'eta'; clo has it` (None: key is not in a config group)."""
    group, _, setting = key.partition(".")
    if group not in top_level_keys()[1] or not setting:
        return None
    chosen = next((o.split("=", 1)[1] for o in job if o.split("=", 1)[0].lstrip("+") == group), None)
    have = [g for g in group_options(group) if has_setting(CONF / group / f"{g}.yaml", setting)]
    which = f"{group}={chosen}" if chosen else f"this run's {group} (its default)"
    where = f"{', '.join(have)} {'has' if len(have) == 1 else 'have'} it" if have else f"no {group} config has it"
    near = [] if have or not chosen else close_settings(CONF / group / f"{chosen}.yaml", setting)
    return f"{key}: {which} has no setting {setting!r}; {where}" + (f" (did you mean {near[0]}?)" if near else "")


def close_settings(path: Path, setting: str) -> list[str]:
    """The top-level settings of a config file spelt like `setting` (a typo's likely meaning)."""
    from omegaconf import OmegaConf

    try:
        keys = [str(k) for k in OmegaConf.load(path).keys() if not str(k).startswith("_")]
    except OSError:
        return []
    return difflib.get_close_matches(setting, keys, n=1)


def has_setting(path: Path, dotted: str) -> bool:
    """Whether a config file sets the dotted key (`topk` or `policy.eta`)."""
    from omegaconf import OmegaConf

    node = OmegaConf.load(path)
    for part in dotted.split("."):
        if not hasattr(node, "keys") or part not in node:
            return False
        node = node[part]
    return True


def job_config(job: list[str], composed: dict):
    """The config a job's overrides give: its config group choices composed by Hydra (once per distinct choice,
    kept in `composed`: composing costs a quarter second), then its values set on a copy as Hydra sets them (a
    key the config lacks is refused unless added with `+`). A ConfigError says what is wrong."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    groups = top_level_keys()[1]
    parsed = OverridesParser.create().parse_overrides(job)
    choices = tuple(
        t
        for t, o in zip(job, parsed)
        if re.split(r"[/@]", o.key_or_group)[0] in groups or t.lstrip("+~").startswith("hydra")
    )
    if choices not in composed:
        try:
            composed[choices] = compose(list(choices))
        except HydraException as e:
            raise ConfigError(composition_error(e, job)) from e
    cfg = copy.deepcopy(composed[choices])  # a job's values must not reach the next job's config
    for text, o in zip(job, parsed):
        if text in choices or o.is_delete():
            continue
        try:
            OmegaConf.update(cfg, o.key_or_group, o.value(), merge=True, force_add=o.is_add() or o.is_force_add())
        except OmegaConfBaseException as e:
            raise ConfigError(missing_setting(o.key_or_group, job) or f"{text}: {str(e).splitlines()[0]}") from e
    return cfg


def check_jobs(argv: list) -> list:
    """Every job of an experiments.run command line composed and its numbers checked, before the first starts: a
    ConfigError naming the first bad job. What depends on the model or the machine (a length beyond the model's
    context, a batch beyond the memory) is left to the job, which records the refusal and lets the sweep go on, as
    Figure 10's grid wants. Returns each job's run_settings.RunNumbers (None for a job this check cannot read)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from experiments.runner import run_settings
    from experiments.runner.setting_types import check_system_settings

    jobs = job_overrides(argv)
    swept = {o.split("=", 1)[0] for job in jobs for o in job if sum(o in j for j in jobs) < len(jobs)}
    composed: dict = {}
    numbers = []
    for i, job in enumerate(jobs):
        numbers.append(None)
        try:
            run_settings.check_decode_workload(cfg := job_config(job, composed))
            numbers[-1] = run_settings.check_numbers(cfg)
            run_settings.check_kv_fill(cfg, numbers[-1].kv_fill)
            run_settings.check_model_path(cfg)
            run_settings.check_output_paths(cfg)  # last: a trace_dir naming ${hydra:...} does not resolve here
            if any(o.lstrip("+~").startswith("system.") for o in job):  # the defaults are tested: imports spared
                check_system_settings(OmegaConf.to_container(cfg.system, resolve=True))
        except ConfigError as e:
            if len(jobs) == 1:
                raise
            shown = " ".join(o for o in job if o.split("=", 1)[0] in swept)
            raise ConfigError(f"{e} (job {i + 1} of {len(jobs)}: {shown})") from e
        except OmegaConfBaseException:  # a config this check cannot read: the job meets it too, and records it
            continue
    return numbers
