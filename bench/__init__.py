"""Benchmarks and probes (not tests). What they share without torch lives here, so that bench/device_run.sh
can call it before any benchmark starts."""

from __future__ import annotations

import re


def gpu_tag(name: str) -> str:
    """A short, lower-case tag for a device name in result file names and labels: its model ("NVIDIA
    H100 80GB HBM3" -> "h100", "NVIDIA H200" -> "h200"), else its last word ("NVIDIA GeForce RTX 4090" ->
    "4090"). Found with an H100's results: the last word alone named them "hbm3"."""
    model = re.search(r"\b[A-Z]{1,2}\d{2,3}[A-Z]?\b", name)
    return (model.group(0) if model else name.split()[-1]).lower()
