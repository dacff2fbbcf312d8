"""benchmarks/gpu_sampler.py: samples taken in a thread only while a block runs; medians and the
share of samples under each clock-limit reason; no NVML, no samples, no failure."""

from __future__ import annotations

import itertools
import sys
import time
import types

import pytest
import torch

from scripts import load_benchmark


@pytest.fixture(scope="module")
def sampler_mod():
    return load_benchmark("gpu_sampler")


def _reader(power_cap_every: int = 2):
    """NVML-shaped readings: power 600, 610, ... W; the power-cap bit on every other one."""
    count = itertools.count()

    def read() -> dict:
        i = next(count)
        cap = 0x4 if i % power_cap_every == 0 else 0
        return {"power_w": 600.0 + 10 * i, "sm_mhz": 1500.0 + i, "temp_c": 60.0,
                "reasons": cap | 0x1, "power_limit_w": 700.0}  # fmt: skip

    return read, count


def test_samples_only_while_the_block_runs(sampler_mod):
    read, count = _reader()
    sampler = sampler_mod.GpuSampler(read, interval_s=0.005)
    with sampler.collect() as samples:
        time.sleep(0.1)
    taken = len(samples)
    assert taken >= 3
    time.sleep(0.05)
    assert len(samples) == taken and next(count) == taken  # the thread stopped with the block
    s = sampler.summary(samples)
    assert s["samples"] == taken and s["power_limit_w"] == 700.0 and s["temp_c"] == 60.0
    assert s["power_w"] == pytest.approx(600.0 + 10 * (taken - 1) / 2)
    assert s["sm_mhz"] == pytest.approx(1500.0 + (taken - 1) / 2)
    assert s["power_p90_w"] >= s["power_w"]
    assert s["share_sw_power_cap"] == pytest.approx(((taken + 1) // 2) / taken)
    assert s["share_hw_slowdown"] == 0.0  # bit 0x1 (idle) is not a limit reason


def test_no_reader_or_failing_reads_lose_nothing_else(sampler_mod):
    with sampler_mod.GpuSampler(None).collect() as samples:
        pass
    assert samples == [] and sampler_mod.GpuSampler.summary(samples) == {}
    read, _ = _reader()
    calls = itertools.count()

    def flaky() -> dict:
        if next(calls) % 2:
            raise RuntimeError("NVML busy")
        return read()

    with sampler_mod.GpuSampler(flaky, interval_s=0.005).collect() as samples:
        time.sleep(0.06)
    assert samples and all(s["power_limit_w"] == 700.0 for s in samples)


def test_bad_interval(sampler_mod):
    with pytest.raises(ValueError, match="interval_s"):
        sampler_mod.GpuSampler(None, interval_s=0)


def test_no_samples_off_cuda(sampler_mod):
    sampler = sampler_mod.GpuSampler.for_device("cpu")
    assert sampler.read is None
    with sampler.collect() as samples:
        pass
    assert samples == []


def test_the_gpu_is_found_by_uuid_not_by_nvml_index(sampler_mod, monkeypatch):
    """NVML ignores CUDA_VISIBLE_DEVICES: a UUID names the process's GPU, an index would name
    the machine's first one. NVML itself is replaced (no GPU here): what is tested is which
    handle the reader asks for and reads."""
    asked = []
    fake = types.ModuleType("pynvml")
    fake.NVML_CLOCK_SM, fake.NVML_TEMPERATURE_GPU = 1, 0
    fake.nvmlInit = lambda: None
    fake.nvmlDeviceGetHandleByUUID = lambda uuid: asked.append(("uuid", uuid)) or uuid
    fake.nvmlDeviceGetHandleByIndex = lambda i: asked.append(("index", i)) or f"index-{i}"
    fake.nvmlDeviceGetCurrentClocksEventReasons = lambda h: 0x4
    fake.nvmlDeviceGetEnforcedPowerLimit = lambda h: 700_000
    fake.nvmlDeviceGetPowerUsage = lambda h: 650_000 if h == "GPU-b" else 100_000
    fake.nvmlDeviceGetClockInfo = lambda h, clock: 1500
    fake.nvmlDeviceGetTemperature = lambda h, sensor: 55
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    read = sampler_mod.nvml_reader("GPU-b")
    assert asked == [("uuid", "GPU-b")] and read()["power_w"] == 650.0
    # the sampler of "cuda" asks for the current device's UUID, whatever its index
    monkeypatch.setattr(sampler_mod.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(sampler_mod, "cuda_uuid", lambda i: "GPU-b" if i == 0 else "GPU-?")
    sampler = sampler_mod.GpuSampler.for_device("cuda")
    assert asked[-1] == ("uuid", "GPU-b") and sampler.read()["power_w"] == 650.0


@pytest.mark.gpu
def test_cuda_uuid_names_the_visible_device_in_nvml(sampler_mod):
    """NVML's GPU of that UUID sits on the PCI address CUDA gives the process's device 0 (run
    with CUDA_VISIBLE_DEVICES naming another GPU than the first, NVML's index 0 would not)."""
    pynvml = pytest.importorskip("pynvml")
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByUUID(sampler_mod.cuda_uuid(0))
    pci, props = pynvml.nvmlDeviceGetPciInfo(handle), torch.cuda.get_device_properties(0)
    if not hasattr(props, "pci_bus_id"):
        pytest.skip("this torch gives no PCI address of a CUDA device")
    assert (pci.domain, pci.bus, pci.device) == (
        props.pci_domain_id,
        props.pci_bus_id,
        props.pci_device_id,
    )
