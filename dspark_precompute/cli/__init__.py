"""The two commands. Their entry points (the console scripts, ``python -m dspark_precompute``) start here.

This module imports nothing: a Ctrl-C while Python imports a command's module, before the command
installs its signal handlers, is one line and exit status 130 too, never a traceback. The commands
install their handlers before any heavy import (hydra, numpy, torch).
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:  # not imported at run time: this module must cost nothing before the handlers are in place
    from typing import NoReturn


def _stopped_while_importing(command: str) -> NoReturn:
    import sys

    sys.stderr.write(f"{command}: stopped by SIGINT before it started; nothing was written\n")
    raise SystemExit(130) from None


def precompute_main() -> None:
    """``dspark-precompute`` and ``python -m dspark_precompute`` (:func:`dspark_precompute.cli.precompute.main`)."""
    try:
        from dspark_precompute.cli.precompute import main
    except KeyboardInterrupt:
        _stopped_while_importing("dspark-precompute")
    main()


def cache_main() -> None:
    """``dspark-cache`` (:func:`dspark_precompute.cli.cache.console`)."""
    try:
        from dspark_precompute.cli.cache import console
    except KeyboardInterrupt:
        _stopped_while_importing("dspark-cache")
    console()
