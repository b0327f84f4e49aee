"""From Hydra to the typed schema: compose ``conf/``, check overrides, register the structured configs.

Kept apart from :mod:`~dspark_precompute.write.config.schema` so the dataclasses (what a run is)
stand without Hydra, and everything that knows Hydra's and OmegaConf's ways lives here.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from dspark_precompute.errors import ConfigError
from dspark_precompute.write.config.schema import PrecomputeConfig


def _leaves(values: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """Dotted ``(key, value)`` pairs of a nested dict; lists and scalars are leaves."""
    if isinstance(values, dict) and (values or not prefix):
        out: list[tuple[str, Any]] = []
        for k, v in values.items():
            out += _leaves(v, f"{prefix}{k}.")
        return out
    return [(prefix[:-1], values)]


def _schema_keys() -> list[str]:
    """Every dotted key the schema knows (for "did you mean" suggestions)."""
    from omegaconf import OmegaConf

    base = OmegaConf.structured(PrecomputeConfig)
    return [k for k, _ in _leaves(OmegaConf.to_container(base))]


def describe_key_problem(key: str, value: Any, exc: Exception) -> str:
    """One line for a value OmegaConf refused: the key, the value, why, and a suggestion."""
    import difflib

    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    if isinstance(exc, (ConfigKeyError, ConfigAttributeError)):
        known = _schema_keys()
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else ""
        group = key.rsplit(".", 1)[0] if "." in key else ""
        depth = key.count(".")
        siblings = sorted({k.split(".")[depth] for k in known
                           if k.count(".") >= depth and (not group or k.startswith(group + "."))})
        return f"unknown key {key}{hint} (keys here: {', '.join(siblings)})"
    return f"{key}={value!r} is not valid: {plain_reason(exc)}"


_TYPE_WORDS = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false", "String": "a string"}


def plain_reason(exc: BaseException) -> str:
    """OmegaConf's first line, said the way a user needs it (what the key must be)."""
    text = str(exc).splitlines()[0].strip()
    m = re.match(r"Value '.*' of type '(\w+)' could not be converted to (\w+)", text)
    if m:
        return f"it must be {_TYPE_WORDS.get(m.group(2), m.group(2))}, not a {m.group(1)}"
    m = re.match(r"Invalid value '.*', expected one of \[(.*)\]", text)
    if m:
        return f"it must be one of [{m.group(1)}]"
    if "is not Optional" in text:
        return "it must have a value, not null"
    if "is not a ListConfig, list or tuple" in text:
        return "it must be a list, e.g. [1,14,27]"
    return text


def _typed(values: dict[str, Any]) -> tuple[Any, list[str], set[str]]:
    """Merge plain values into the structured schema one key at a time, keeping every failure."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    base = OmegaConf.structured(PrecomputeConfig)
    problems: list[str] = []
    failed: set[str] = set()
    for key, value in _leaves({k: v for k, v in values.items() if k != "hydra"}):
        try:
            OmegaConf.update(base, key, value, merge=True, force_add=False)
        except OmegaConfBaseException as exc:
            problems.append(describe_key_problem(key, value, exc))
            failed.add(key)
    for key in sorted(OmegaConf.missing_keys(base)):
        problems.append(f"{key} is required and has no value (???): set it on the command line, e.g. {key}=...")
        failed.add(key)
    return base, problems, failed


def from_dict(values: dict[str, Any]) -> PrecomputeConfig:
    """Build and validate a config from a plain (resolved) dict: types first, then values.

    Every problem is reported at once: a value of the wrong type, an unknown key (with
    the closest known one), a required value left out, and every value check of the
    dataclasses whose key was well typed.
    """
    from omegaconf import OmegaConf

    base, problems, failed = _typed(values)
    if problems:
        # the keys that failed keep their defaults: check the rest, drop what the defaults would trip
        try:
            cfg = OmegaConf.to_object(base)
        except ConfigError as exc:
            problems += [p for p in exc.problems if not any(p.startswith(k) for k in failed)]
        except Exception:  # noqa: BLE001 - the type problems above already explain it
            pass
        raise ConfigError(problems)
    cfg = OmegaConf.to_object(base)  # runs PrecomputeConfig.__post_init__: the value checks
    assert isinstance(cfg, PrecomputeConfig)
    return cfg


def from_dictconfig(cfg: Any) -> PrecomputeConfig:
    """Resolve an OmegaConf/Hydra config (interpolations included) into a typed config."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError([f"{k} is required and has no value (???): set it on the command line, e.g. {k}=..."
                           for k in missing if not k.startswith("hydra.")])
    try:
        values = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as exc:  # an interpolation that cannot resolve (e.g. an unset env var)
        raise ConfigError([f"the configuration cannot be resolved: {str(exc).splitlines()[0]}"]) from None
    if not isinstance(values, dict):
        raise ConfigError([f"the configuration is a {type(values).__name__}, not a mapping of keys"])
    return from_dict({str(k): v for k, v in values.items()})


def _conf_dir() -> Path:
    """The Hydra config groups: ``dspark_precompute.conf`` wherever the install put it, else a checkout's ``conf/``.

    A wheel carries the checkout's top-level ``conf/`` as ``dspark_precompute/conf``; an editable install
    maps that name to the checkout's ``conf/``; a checkout used through ``PYTHONPATH`` (the GPU bench)
    has no such module, and its ``conf/`` sits beside the package.
    """
    import importlib.util

    spec = importlib.util.find_spec("dspark_precompute.conf")
    if spec is not None and spec.origin:
        return Path(spec.origin).resolve().parent
    return Path(__file__).resolve().parents[3] / "conf"


CONF_DIR = _conf_dir()


def composition_problem(overrides: list[str], check_values: bool = True) -> str | None:
    """Why ``overrides`` do not compose against the schema (a line per problem), or None.

    ``check_values`` also runs the typed value checks; those only mean something for a
    whole command line (``batch.max_tokens=1024`` alone is below the default seq_length).
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    from dspark_precompute.errors import StoppedBySignal

    register_configs()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = hydra_compose(config_name="config", overrides=list(overrides))
    except StoppedBySignal:
        raise
    except Exception as exc:  # noqa: BLE001 - Hydra raises several types; each becomes one line
        cause = exc.__cause__ or exc
        if isinstance(cause, StoppedBySignal):
            raise cause from None
        if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and len(overrides) == 1 and "=" in overrides[0]:
            key, value = overrides[0].split("=", 1)
            return describe_key_problem(key.lstrip("+~"), value, cause)
        text = plain_reason(cause) if cause is not exc else " ".join(str(exc).split())
        text = text.split(" Config search path:")[0]
        return f"{' '.join(overrides)}: {text}" if overrides else text
    if not check_values:
        return None
    try:
        from_dictconfig(cfg)
    except ConfigError as exc:
        return "\n".join(exc.problems)
    return None


def compose(overrides: list[str] | None = None) -> PrecomputeConfig:
    """The typed config the command line builds for ``overrides``; ConfigError lists every problem.

    For notebooks, tests and scripts: the same schema, defaults and checks as
    ``python -m dspark_precompute``, without Hydra's run directory or logging.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException

    register_configs()
    overrides = list(overrides or [])
    failed = False
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        try:
            dcfg = hydra_compose(config_name="config", overrides=overrides)
        except HydraException:
            failed = True
    if failed:  # outside Hydra's context: each override is composed on its own to name every culprit
        bad = {o: p for o in overrides if (p := composition_problem([o], check_values=False))}
        problems = list(bad.values()) or [composition_problem(overrides) or "the overrides do not compose"]
        rest = [o for o in overrides if o not in bad]
        if bad and rest:  # the values of the others are checked too: every problem at once
            problems += [line for line in (composition_problem(rest) or "").split("\n") if line]
        raise ConfigError(problems) from None
    return from_dictconfig(dcfg)


def register_configs() -> None:
    """Register the schema in Hydra's ConfigStore as ``precompute_schema``.

    ``conf/config.yaml`` lists it first in its defaults, so every YAML file and every
    command-line override is checked against these dataclasses' types as Hydra composes.
    """
    from hydra.core.config_store import ConfigStore
    from omegaconf import MISSING, OmegaConf

    schema = OmegaConf.structured(PrecomputeConfig)
    # A `???` in a group file cannot make a key required once the schema gave it a value
    # (merging MISSING keeps the old value): the paths start missing here, and each group
    # option sets its own (model/tiny.yaml: tiny; model/hf.yaml leaves it required).
    schema.model.path = MISSING
    schema.data.path = MISSING
    ConfigStore.instance().store(name="precompute_schema", node=schema)
