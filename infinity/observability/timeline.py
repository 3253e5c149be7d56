"""The store's timeline: the recorder of :mod:`infinity.core.timeline` with its views as files,
a Chrome trace JSON and a PNG of the lanes (drawn by :mod:`infinity.observability.trace_export`).
"""

from __future__ import annotations

from pathlib import Path

from infinity.core import timeline as recorder
from infinity.observability.trace_export import plot_timeline, write_chrome_trace


class Timeline(recorder.Timeline):
    """What the store did and when (see :mod:`infinity.core.timeline`), and its views."""

    def export_chrome(self, path: str | Path) -> Path:
        """Writes a Chrome trace JSON (see :mod:`infinity.observability.trace_export`); returns the
        path."""
        return write_chrome_trace(self.snapshot(), Path(path))

    def plot(self, path: str | Path, title: str | None = None) -> Path:
        """Writes a PNG of the lanes (see :mod:`infinity.observability.trace_export`); returns the
        path."""
        return plot_timeline(self.snapshot(), Path(path), title=title)
