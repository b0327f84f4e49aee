"""The contract imported alone, in a fresh interpreter: no torch, transformers, zarr, reader or writer.
"""

from __future__ import annotations


def test_the_format_module_imports_no_torch_transformers_reader_or_writer():
    import subprocess
    import sys

    code = ("import sys, dspark_precompute.contract.spec, dspark_precompute.contract.manifest, "
            "dspark_precompute.contract.layout, dspark_precompute.contract.arrays; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'zarr') or m in "
            "('dspark_precompute.read.reader', 'dspark_precompute.write.store.writer')]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
