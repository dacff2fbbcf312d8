"""The GPU's power draw, SM clock, temperature and clock-limit reasons, sampled while work runs.

A GPU lowers its SM clock when it reaches its power limit (or gets hot), so the same kernels run
slower in a row that draws more power: session 29's rows timed in alternation ran fp8-tensorwise
at a lower SM clock than torchao's row. Reading the clock once after a round says little; this
samples NVML from a background thread for as long as a block runs:

    sampler = GpuSampler.for_device("cuda")   # no samples off CUDA or without NVML
    with sampler.collect() as samples:
        run_steps()
    sampler.summary(samples)         # medians and the share of samples under each limit

NVML's calls release the GIL (ctypes), so the sampling thread does not hold up the host's
kernel launches at the default 20 ms interval.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
from collections.abc import Callable, Iterator

import torch

__all__ = ["GpuSampler", "nvml_reader", "cuda_uuid", "LIMIT_REASONS"]

# NVML's clock-event reason bits (nvmlClocksEventReason*), the ones that slow a busy GPU.
LIMIT_REASONS = {
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sw_thermal": 0x20,
    "hw_thermal": 0x40,
    "hw_power_brake": 0x80,
}

Reader = Callable[[], dict]


def nvml_reader(uuid: str) -> Reader | None:
    """A function reading the power (W), SM clock (MHz), temperature (C) and clock reasons (bit
    mask) of the GPU with NVML UUID `uuid` ("GPU-...", `cuda_uuid`), or None where NVML is
    missing or fails. By UUID, not NVML's index: NVML numbers every GPU of the machine and
    ignores CUDA_VISIBLE_DEVICES, so a process given the second GPU that read NVML's index 0
    sampled the first one (before session 61). NVML's power is averaged over about a second
    on recent GPUs; a block's median is what it drew steadily."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        reasons = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        reasons = reasons or pynvml.nvmlDeviceGetCurrentClocksThrottleReasons  # older bindings
        limit_w = pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000.0
    except Exception:  # no NVML library or binding, no device: samples stay empty
        return None

    def read() -> dict:
        return {
            "power_w": pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
            "sm_mhz": float(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)),
            "temp_c": float(pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)),
            "reasons": int(reasons(handle)),
            "power_limit_w": limit_w,
        }

    return read


def cuda_uuid(index: int) -> str:
    """NVML's name ("GPU-<uuid>") of CUDA device `index` as this process numbers it. (A MIG
    instance's UUID is no "GPU-" one: NVML finds no GPU by it, and the sampler takes no
    samples.)"""
    return f"GPU-{torch.cuda.get_device_properties(index).uuid}"


class GpuSampler:
    """Samples `read()` every `interval_s` seconds in a thread while `collect()` is open."""

    def __init__(self, read: Reader | None = None, interval_s: float = 0.02) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.read = read
        self.interval_s = interval_s

    @classmethod
    def for_device(cls, device: str, interval_s: float = 0.02) -> GpuSampler:
        """A sampler of the current CUDA device for `device` "cuda" (found in NVML by its UUID,
        which CUDA_VISIBLE_DEVICES does not renumber); one that takes no samples for any other
        device (a CPU run) or where NVML cannot be read."""
        if device != "cuda":
            return cls(None, interval_s)
        return cls(nvml_reader(cuda_uuid(torch.cuda.current_device())), interval_s)

    @contextlib.contextmanager
    def collect(self) -> Iterator[list[dict]]:
        """A list that fills with samples until the block ends (stays empty without a reader)."""
        samples: list[dict] = []
        if self.read is None:
            yield samples
            return
        stop = threading.Event()

        def loop() -> None:
            while not stop.is_set():
                with contextlib.suppress(Exception):  # a failed read loses one sample
                    samples.append(self.read())
                stop.wait(self.interval_s)

        thread = threading.Thread(target=loop, name="gpu-sampler", daemon=True)
        thread.start()
        try:
            yield samples
        finally:
            stop.set()
            thread.join()

    @staticmethod
    def summary(samples: list[dict]) -> dict:
        """Medians of power, clock and temperature, the 90th percentile of power, and for each
        limit reason the share of samples it was active in; {} without samples."""
        if not samples:
            return {}

        def med(key: str) -> float:
            return statistics.median(s[key] for s in samples)

        power = sorted(s["power_w"] for s in samples)
        out = {
            "samples": len(samples),
            "power_w": med("power_w"),
            "power_p90_w": power[min(len(power) - 1, int(0.9 * len(power)))],
            "power_limit_w": samples[0]["power_limit_w"],
            "sm_mhz": med("sm_mhz"),
            "temp_c": med("temp_c"),
        }
        for name, bit in LIMIT_REASONS.items():
            out[f"share_{name}"] = sum(bool(s["reasons"] & bit) for s in samples) / len(samples)
        return out
