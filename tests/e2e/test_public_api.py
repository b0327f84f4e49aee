"""The public API: ``from dspark_precompute import ...`` gives the real, typed objects, loaded on first use."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from helpers import REPO

PUBLIC = ("open_cache", "build_dataloader", "compose", "PrecomputeConfig", "run")


def test_the_public_names_import_and_importing_the_package_alone_loads_neither_torch_nor_transformers():
    code = textwrap.dedent(f"""
        import sys
        import dspark_precompute
        heavy = sorted(m for m in ("torch", "transformers", "zarr", "hydra") if m in sys.modules)
        assert not heavy, heavy
        from dspark_precompute import {", ".join(PUBLIC)}, RunResult, DryRunPlan
        from dspark_precompute.read.reader import open_cache as real_open
        from dspark_precompute.read.training import build_dataloader as real_loader
        from dspark_precompute.write.config.compose import compose as real_compose
        from dspark_precompute.write.config.schema import PrecomputeConfig as real_config
        assert (open_cache, build_dataloader, compose, PrecomputeConfig) == (real_open, real_loader, real_compose,
                                                                             real_config)
        # run's annotations name the exported objects
        assert run.__annotations__ == {{"cfg": "PrecomputeConfig", "return": "RunResult | DryRunPlan"}}
        assert set(dspark_precompute.__all__) >= set({PUBLIC!r}) and set({PUBLIC!r}) <= set(dir(dspark_precompute))
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


MYPY_CONFIG = """\
[mypy]
python_version = 3.11
ignore_missing_imports = True
follow_imports = silent
# the dependencies are not what this checks (and torch alone takes minutes to analyse)
[mypy-torch.*,transformers.*,zarr.*,numcodecs.*,numpy.*,hydra.*,omegaconf.*,safetensors.*,tqdm.*,fsspec.*,tokenizers.*]
follow_imports = skip
"""

SNIPPET = """\
from dspark_precompute import PrecomputeConfig, build_dataloader, compose, open_cache, run

cfg = compose(["seq_length=1024"])
reveal_type(cfg)
reveal_type(run(cfg))
reveal_type(open_cache("caches/x").describe)
reveal_type(build_dataloader("caches/x", max_tokens=4096))
run(["seq_length=1024"])
"""


def test_a_type_checker_sees_the_real_signatures_of_the_public_names(tmp_path):
    (tmp_path / "mypy.ini").write_text(MYPY_CONFIG)
    (tmp_path / "snippet.py").write_text(SNIPPET)
    proc = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(tmp_path / "mypy.ini"), "--cache-dir",
                           str(tmp_path / "cache"), str(tmp_path / "snippet.py")],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    out = proc.stdout
    for line, revealed in ((4, '"dspark_precompute.write.config.schema.PrecomputeConfig"'),
                           (5, '"dspark_precompute.write.run.RunResult | dspark_precompute.write.dryrun.DryRunPlan"'),
                           (6, '"def () -> str"'),
                           (7, '"dspark_precompute.read.loader.CacheLoader"')):
        assert f"snippet.py:{line}: note: Revealed type is {revealed}" in out, out
    assert 'snippet.py:8: error: Argument 1 to "run" has incompatible type "list[str]"; expected ' \
           '"PrecomputeConfig"' in out, out
    assert "Found 1 error" in out, out
