"""Safetensors files with hostile headers, and what reading them costs.

`crowded_safetensors(n)`: a valid safetensors file whose JSON header is `n` bytes of empty
tensor entries (shape [0]), the way a hostile upstream serves one. `Cost` times a block and
samples the process's resident memory every millisecond while it runs: the peak's growth over
the memory held when the block began.
"""

import threading
import time

import psutil

ENTRY = b'"t%08d":{"dtype":"F16","shape":[0],"data_offsets":[0,0]}'


def crowded_safetensors(header_bytes: int) -> bytes:
    """8 bytes of length, then a header of exactly `header_bytes` (entries, space padded)."""
    count = (header_bytes - 2) // (len(ENTRY % 0) + 1)
    header = b"{" + b",".join(ENTRY % i for i in range(count)) + b"}"
    header += b" " * (header_bytes - len(header))  # the format pads its header with spaces
    return header_bytes.to_bytes(8, "little") + header


class Cost:
    """with Cost() as cost: ...; then cost.seconds and cost.peak_growth (bytes)."""

    def __enter__(self) -> "Cost":
        self._process = psutil.Process()
        self._stop = threading.Event()
        self.start_rss = self.peak_rss = self._process.memory_info().rss
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()
        self._started = time.perf_counter()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak_rss = max(self.peak_rss, self._process.memory_info().rss)

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self._started
        self._stop.set()
        self._sampler.join()
        self.peak_rss = max(self.peak_rss, self._process.memory_info().rss)
        self.peak_growth = self.peak_rss - self.start_rss

    def __str__(self) -> str:
        return f"{self.seconds * 1000:.1f} ms, peak RSS +{self.peak_growth / 2**20:.1f} MiB"
