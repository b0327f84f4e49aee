"""``python -m dspark_precompute``: the precompute command (see ``dspark_precompute.cli.precompute``)."""

from dspark_precompute.cli import precompute_main

if __name__ == "__main__":
    precompute_main()
