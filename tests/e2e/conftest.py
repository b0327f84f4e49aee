"""Every test under tests/e2e/ is in the e2e lane, whatever its module says: the directory decides.

The fast lane (``-m "not e2e and not slow"``) is then exactly the tests outside this directory
minus the slow ones; ``tests/test_architecture.py`` refuses an ``e2e`` marker anywhere else.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before the -m selection looks at the markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.resolve().parents:
            item.add_marker(pytest.mark.e2e)
