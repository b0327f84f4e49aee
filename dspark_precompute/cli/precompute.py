"""``python -m dspark_precompute [overrides]`` (also ``dspark-precompute``): the precompute command.

Thin Hydra entry point: compose ``conf/`` against the typed schema, call ``run``.
Examples::

    python -m dspark_precompute                                   # embedded default, seconds on a CPU
    python -m dspark_precompute model=qwen3_0_6b data.path=/data/chat.jsonl seq_length=4096
    python -m dspark_precompute -m seq_length=1024,2048           # one cache per value
    python -m dspark_precompute data.path=/data/chat.jsonl dry_run=true   # the plan: counts, bytes, time

Before Hydra runs anything, every override is checked against the schema (each value of
a sweep too): all bad values are reported together, one line each, with exit status 2.
What the machine says about the values (CUDA devices, whether paths exist) is checked by
each job where it runs, before weights load: a SLURM sweep is submitted from a login node.

This module is the only place (with ``dspark-cache``) that changes the process: the job's
log level and SIGINT/SIGTERM handlers are set here, for the job, never by the library. The
handlers go in first, before hydra, numpy or torch is imported, so a Ctrl-C at any moment of
the start-up is one line and 130 (this module imports only the standard library at its top).
"""

from __future__ import annotations

import errno
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dspark_precompute import signals
from dspark_precompute.errors import ConfigError, DsparkError, StoppedBySignal, StorageWriteError

if TYPE_CHECKING:
    from omegaconf import DictConfig

log = logging.getLogger("dspark_precompute")


def _app(dcfg: DictConfig) -> None:
    """One job, in this process or in a launcher's (a submitit task runs this function, not ``main``).

    :func:`main` wraps it in ``hydra.main`` once the signal handlers are in place.
    """
    provenance = _provenance(dcfg)  # in memory, now: Hydra's files on disk may belong to another run
    try:
        with signals.handled():  # a signal stops the job with one line and 128+signal, never a traceback
            from dspark_precompute.write.config.compose import from_dictconfig
            from dspark_precompute.write.run import run

            signals.checkpoint()  # a stop swallowed by a finalizer while torch was imported
            cfg = from_dictconfig(dcfg)
            # Hydra's job logging installed the handlers; the level is the job's (rank 0 only: the others warn)
            log.setLevel(cfg.log_level.upper() if _rank() == 0 else logging.WARNING)
            for name in ("httpx", "httpx2"):  # the openai client's transport logs every request at INFO
                logging.getLogger(name).setLevel(logging.WARNING)
            if cfg.regenerate.only:  # regenerate=server regenerate.only=true: the responses, no capture
                from dspark_precompute.write.plan.regenerated import regenerate_stage

                regenerate_stage(cfg)
                return
            if cfg.dry_run:
                from dspark_precompute.write.dryrun import dry_run

                sys.stdout.write(dry_run(cfg).table())
                sys.stdout.flush()
                return
            run(cfg, provenance=provenance)
    except (DsparkError, StoppedBySignal) as exc:
        log.error("%s", exc)
        raise SystemExit(getattr(exc, "exit_code", 2)) from None


def _provenance(dcfg: DictConfig) -> dict[str, Any]:
    """The command line, Hydra overrides and composed config of this job, as this process holds them."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    out: dict[str, Any] = {"argv": list(sys.argv)}
    try:
        hc = HydraConfig.get()
    except ValueError:
        return out
    overrides = list(hc.overrides.task)
    out["overrides"] = overrides
    out["files"] = {
        "config.yaml": OmegaConf.to_yaml(dcfg),
        "overrides.yaml": OmegaConf.to_yaml(OmegaConf.create(overrides)),
        "hydra.yaml": OmegaConf.to_yaml(OmegaConf.create({"hydra": OmegaConf.to_container(hc)})),
    }
    return out


def _rank() -> int:
    """This process's rank: torchrun's, SLURM's, or submitit's local executor's; 0 alone."""
    env = os.environ
    return int(env.get("RANK") or env.get("SLURM_PROCID") or env.get("SUBMITIT_LOCAL_GLOBALID") or 0)


def _fail(problems: list[str]) -> None:
    sys.stderr.write(f"dspark-precompute: {ConfigError(problems)}\n")
    raise SystemExit(ConfigError.exit_code)


def _preflight(argv: list[str]) -> None:
    """Check every override (and every value of every sweep) before Hydra launches a job."""
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from dspark_precompute.write.config.compose import composition_problem

    args, _ = get_args_parser().parse_known_args(argv)
    if args.help or args.hydra_help or args.cfg or args.info or args.shell_completion:
        return
    try:
        parsed = OverridesParser.create().parse_overrides(args.overrides)
    except Exception as exc:  # noqa: BLE001 - Hydra's parser error
        _fail([f"the command line cannot be parsed: {' '.join(str(exc).split())}"])
        return
    choices: list[list[str]] = []
    for text, o in zip(args.overrides, parsed):
        if o.key_or_group.startswith("hydra"):
            continue  # Hydra's own settings (launcher, run dir): Hydra checks those
        if o.is_sweep_override():
            key = o.get_key_element()
            choices.append([f"{key}={v}" for v in o.sweep_string_iterator()])
        else:
            choices.append([text])
    first = [c[0] for c in choices]
    problem = composition_problem(first)
    if problem is None and all(len(c) == 1 for c in choices):
        return
    problems: list[str] = []
    if problem is not None:
        # find every culprit: each override on its own, then (if none alone) the combination
        for c in choices:
            for alt in c:
                p = composition_problem([alt], check_values=False)
                if p and p not in problems:
                    problems.append(p)
        if not problems:
            problems.append(problem)
        else:  # the values of the overrides that compose are checked too: every problem at once
            good = [c[0] for c in choices if not composition_problem([c[0]], check_values=False)]
            rest = composition_problem(good) if good else None
            problems += [line for line in (rest or "").split("\n") if line and line not in problems]
    for i, c in enumerate(choices):  # the other values of each sweep: alone, then with the rest as given
        for alt in c[1:]:
            p = composition_problem([alt], check_values=False) or composition_problem(first[:i] + [alt] + first[i + 1:])
            if p and p not in problems:
                problems.append(p)
    if problems:
        _fail([line for p in problems for line in p.split("\n")])


def _run_dir_problem(argv: list[str]) -> str | None:
    """Hydra writes each job's record under ``outputs/`` (``multirun/``) of the working directory before the job
    runs, so an unwritable one would end in Hydra's own traceback: say so first (the default place only; a
    ``hydra.run.dir`` / ``hydra.sweep.dir`` given is the user's choice)."""
    from hydra._internal.utils import get_args_parser

    args, _ = get_args_parser().parse_known_args(argv)
    if args.help or args.hydra_help or args.cfg or args.info or args.shell_completion:
        return None  # nothing is written
    if any(a.startswith(("hydra.run.dir=", "hydra.sweep.dir=")) for a in args.overrides):
        return None
    base = Path.cwd() / ("multirun" if args.multirun else "outputs")
    where = base if base.is_dir() else base.parent
    if os.access(where, os.W_OK | os.X_OK):
        return None
    code = errno.EROFS if os.statvfs(where).f_flag & os.ST_RDONLY else errno.EACCES
    exc = OSError(code, os.strerror(code), str(where))
    key = "hydra.sweep.dir" if args.multirun else "hydra.run.dir"
    return str(StorageWriteError.of(exc, f"writing Hydra's record of the run under {base}", "run the command again",
                                    f"run it from a writable directory (or pass {key}=DIR)"))


def main() -> None:
    """The ``dspark-precompute`` command: check the overrides, then let Hydra run the job(s).

    The signal handlers go in before anything heavy is imported. ``sys.argv`` is read, never
    changed: a torchrun rank > 0 hands Hydra a copy with its extra overrides, and the caller's
    list is back in place when this returns or raises.
    """
    argv = sys.argv
    try:
        signals.install()
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # HF tokenizers and our helper processes
        import hydra

        from dspark_precompute.write.config.compose import CONF_DIR, register_configs

        register_configs()
        if not CONF_DIR.is_dir():
            sys.exit(f"dspark-precompute: config directory {CONF_DIR} is missing; install the project with "
                     "`pip install -e .` from its checkout")
        problem = _run_dir_problem(argv[1:]) if _rank() == 0 else None
        if problem is not None:
            sys.stderr.write(f"dspark-precompute: {problem}\n")
            raise SystemExit(StorageWriteError.exit_code)
        _preflight(argv[1:])
        signals.checkpoint()  # a stop swallowed by a finalizer while hydra was imported or the config composed
        if _rank() > 0 and "-m" not in argv and "--multirun" not in argv:
            # torchrun: every rank composes the same config, only rank 0 writes Hydra's output dir and log.
            # Hydra reads sys.argv: it gets its own list for the call. Logging left unconfigured ("none", not
            # "disabled": that one disables every logger that exists, so a rank's warnings and errors vanished).
            sys.argv = [*argv, "hydra.output_subdir=null", "hydra.run.dir=.", "hydra/job_logging=none",
                        "hydra/hydra_logging=none"]
        hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")(_app)()
        signals.checkpoint()
    except StoppedBySignal as exc:  # a signal outside the run (while importing, composing)
        sys.stderr.write(f"dspark-precompute: {exc}\n")
        raise SystemExit(exc.exit_code) from None
    except KeyboardInterrupt:  # before the handlers were installed
        sys.stderr.write("dspark-precompute: stopped by SIGINT; resume with the same command\n")
        raise SystemExit(130) from None
    finally:
        sys.argv = argv
        if signals.STATE.signum is not None:  # stopped: what a half-imported module logs at exit is noise
            logging.disable(logging.INFO)
        signals.exiting()  # a second Ctrl-C or SIGTERM during shutdown: exit at once, no traceback


if __name__ == "__main__":
    main()
