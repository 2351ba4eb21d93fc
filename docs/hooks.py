"""MkDocs hook: the benchmark plots of ``benchmarks/results/`` are part of the site.

The performance page shows them from there, without a copy in ``docs/`` that could drift from what the benchmarks
wrote.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Add every PNG of ``benchmarks/results/`` under the same path in the site."""
    for plot in sorted((ROOT / "benchmarks" / "results").glob("*.png")):
        files.append(File(str(plot.relative_to(ROOT)), str(ROOT), config["site_dir"], config["use_directory_urls"]))
    return files
