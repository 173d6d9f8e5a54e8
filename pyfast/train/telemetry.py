"""Process telemetry for the metrics log: bytes this process sent, its memory, its GPU.

bytes_written() reads /proc/self/io's wchar: every byte this process passed to write()/writev(),
which is how gloo's TCP transport sends (measured: a 64 MB fp32 all-reduce on 2 ranks adds
67,118,080 bytes per rank, a 1 MB send 1,048,672). The job reads it around the step only, where
nothing else writes (metrics and checkpoints are written outside that window). NCCL traffic
(NVLink, InfiniBand) does not pass through write(): on GPUs the number covers gloo only.
"""
from __future__ import annotations

import resource


def bytes_written() -> int:
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:  # not Linux
        pass
    return 0


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


class GPU:
    """Utilisation and memory of this rank's GPU through nvidia-ml-py, where one exists."""

    def __init__(self, device):
        self.handle = None
        if getattr(device, "type", "cpu") != "cuda":
            return
        try:
            import pynvml
            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        except Exception:  # noqa: BLE001  (no driver / no library: telemetry is optional)
            self.handle = None

    def sample(self) -> dict:
        if self.handle is None:
            return {}
        util = self.nvml.nvmlDeviceGetUtilizationRates(self.handle)
        mem = self.nvml.nvmlDeviceGetMemoryInfo(self.handle)
        return {"gpu_util": util.gpu, "gpu_mem_mb": mem.used / 2 ** 20}
