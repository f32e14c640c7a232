"""Peak memory of a benchmark phase: process RSS sampled on a thread, plus CUDA's own peak."""

from __future__ import annotations

import threading
from pathlib import Path

_PAGE = 4096


def rss_bytes() -> int:
    # NOTE: statm's second field is resident pages; cheap enough to read every few ms.
    return int(Path("/proc/self/statm").read_text().split()[1]) * _PAGE


class PeakMemory:
    """`with PeakMemory() as m: ...` then `m.peak_rss` (bytes) and `m.peak_cuda` (or None)."""

    def __init__(self, interval: float = 0.02) -> None:
        self.interval = interval
        self.peak_rss = 0
        self.peak_cuda: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> PeakMemory:
        import torch

        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self.peak_rss = rss_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        import torch

        self._stop.set()
        self._thread.join()
        self.peak_rss = max(self.peak_rss, rss_bytes())
        if torch.cuda.is_available():
            self.peak_cuda = torch.cuda.max_memory_allocated()

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak_rss = max(self.peak_rss, rss_bytes())
