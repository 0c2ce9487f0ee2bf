"""The backends that make the samples, by name: DALI's pipelines, or threads and torch ops (``pipeline.loaders`` builds
either; docs/data.md measures them). ``auto`` is ``pipeline.loaders.resolve_backend``'s choice."""

from __future__ import annotations

from typing import Literal

Backend = Literal["dali", "torch"]
DALI: Backend = "dali"
TORCH: Backend = "torch"
BACKENDS: tuple[Backend, ...] = (DALI, TORCH)
AUTO = "auto"
