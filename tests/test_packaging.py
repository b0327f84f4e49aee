"""The wheel: every package of the checkout and the top-level ``conf/`` ship in it, and the installed command runs."""

from __future__ import annotations

import tomllib

from helpers import CONF, REPO

PKG = REPO / "dspark_precompute"


def _setuptools() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]


def _checkout_packages() -> set[str]:
    """Every directory of the package (code or data) and of conf/, as the dotted names the wheel installs them as."""
    out = set()
    for root, base in ((PKG, "dspark_precompute"), (CONF, "dspark_precompute.conf")):
        for d in [root, *root.rglob("*")]:
            if d.is_dir() and "__pycache__" not in d.parts:
                out.add(".".join([base, *d.relative_to(root).parts]))
    return out


def test_the_package_list_names_every_directory_of_the_checkout_and_maps_conf_from_the_top_level():
    """pyproject lists the packages (a find cannot see conf/ beside the package): a new one must be added there."""
    st = _setuptools()
    assert set(st["packages"]) == _checkout_packages()
    assert st["package-dir"] == {"dspark_precompute.conf": "conf"}
    assert not (PKG / "conf").exists(), "one copy of the config groups: conf/ at the top level"


def test_no_test_skips_for_a_package_of_the_test_extra():
    """A broken test environment fails instead of skipping: only what the README calls optional may skip (the
    trainers' interop packages, ../shared/data, a GPU), so no ``importorskip`` names a package of ``[test]``."""
    import importlib.metadata
    import re

    def norm(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    extra = {norm(re.split(r"[\[<>=!~; ]", r)[0]) for r in
             tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
             ["test"]}
    owners = importlib.metadata.packages_distributions()  # top-level module -> the distributions installing it
    skips = [(f.relative_to(REPO).as_posix(), m.group(1)) for f in sorted((REPO / "tests").rglob("*.py"))
             for m in re.finditer(r"importorskip\(\s*[\"']([\w.]+)", f.read_text(encoding="utf-8"))]
    assert skips, "the scan found no importorskip at all (the interop tests have some)"
    assert [(f, mod) for f, mod in skips if extra & {norm(d) for d in owners.get(mod.split(".")[0], [])}] == []
