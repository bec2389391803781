"""Benchmarks: this project's trainer measured side by side with the original demo (issue #7).

Each benchmark is a module run from the repository root (``python -m bench.<name>``), prints
a Markdown table and writes it to ``bench/results/<name>.md`` and ``.json`` together with the
machine it ran on. ``--quick`` runs a tiny version in seconds (used by ``tests/bench``).
"""
