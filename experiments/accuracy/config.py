"""The composed config of an accuracy run from lm-eval's model args: every arg that is not lm-eval's own is a Hydra
override over conf/ (`system=clo`, `system.eta=0.7`, `dtype=bfloat16`), composed with Hydra's compose API under
`workload=accuracy` unless the args choose another workload."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from experiments.runner import cli_checks, run_settings
from kvoffload.errors import ConfigError

LOGLIKELIHOOD_MODES = ("decode", "prefill")


def override_text(key: str, value: Any) -> str:
    """One model arg (as lm-eval parsed it: strings, numbers, booleans) -> a Hydra override."""
    if isinstance(value, bool):
        value = "true" if value else "false"
    elif value is None:
        value = "null"
    return f"{key}={value}"


def compose_config(overrides: list[str]) -> tuple[DictConfig, str]:
    """(the composed config, the chosen system's name). Unknown keys and unknown options are refused with one
    ConfigError line, before anything is built."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException

    if not any(o.split("=", 1)[0].lstrip("+~") == "workload" for o in overrides):
        overrides = ["workload=accuracy", *overrides]
    cli_checks.check_override_keys(overrides)
    try:
        if GlobalHydra.instance().is_initialized():  # inside a Hydra app: its search path is conf/ already
            cfg = compose("config", overrides=overrides, return_hydra_config=True)
        else:
            with initialize_config_dir(str(cli_checks.CONF), version_base="1.3"):
                cfg = compose("config", overrides=overrides, return_hydra_config=True)
    except HydraException as e:
        raise ConfigError(f"model args {' '.join(overrides)}: {e}") from None
    system = cfg.hydra.runtime.choices.get("system", "?")
    with_hydra = OmegaConf.to_container(cfg, resolve=False)
    with_hydra.pop("hydra", None)
    return OmegaConf.create(with_hydra), system


def check_workload(cfg: DictConfig) -> None:
    """The accuracy workload's own keys that the model reads."""
    mode = cfg.workload.get("loglikelihood", "decode")
    if mode not in LOGLIKELIHOOD_MODES:
        raise ConfigError(f"workload.loglikelihood={mode!r}; valid: {', '.join(LOGLIKELIHOOD_MODES)}")
    run_settings.number(cfg.workload.get("prefill_cache_gb", 0), "workload.prefill_cache_gb", 0.0)
