"""The example notebook runs headless, top to bottom, against a real cache (so it cannot rot)."""

from __future__ import annotations

from pathlib import Path

import nbformat
from helpers import REPO
from nbclient import NotebookClient

from dspark_precompute import open_cache

NOTEBOOK = REPO / "examples" / "reading_a_cache.ipynb"


def outputs(nb, kind: str) -> list:
    return [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs if o.output_type == kind]


def test_the_example_notebook_opens_summarises_and_plots_a_cache(default_run, tmp_path, monkeypatch):
    _, result = default_run
    monkeypatch.setenv("DSPARK_CACHE", result.path)
    monkeypatch.setenv("DSPARK_OUT", str(tmp_path))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    assert not outputs(nb, "error")
    printed = "".join(o.text for o in outputs(nb, "stream"))
    assert open_cache(result.path).describe() in printed  # the summary, exactly as the API gives it
    assert "layer 1: (" in printed and "float32" in printed and "padding:" in printed
    images = [o for o in outputs(nb, "display_data") + outputs(nb, "execute_result") if "image/png" in o.data]
    assert len(images) == 1
    report = Path(tmp_path) / "report.png"
    assert report.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and report.stat().st_size > 10_000
