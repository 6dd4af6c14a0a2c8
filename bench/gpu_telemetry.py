"""The GPU's clocks, power and clock-limiting reasons while a benchmark times, read by nvidia-smi.

Why: a kernel measured faster alone (bench/kernels.py) can move the training step by far less.
One explanation is power: an H200 running GEMMs near its rate can sit at its power limit, where
the clocks follow the energy a step spends and a kernel that only hides latency does the same
work in the same energy. Whether that happens is a reading, not a guess: these records say, for
each timed window, the SM clock, the power drawn against the enforced limit, and how often the
driver reported a power cap or a thermal slowdown.

    sampler = GpuSampler.start(torch.device("cuda"))   # None where nvidia-smi cannot read this GPU
    t0 = time.time(); ...timed work...; t1 = time.time()
    record.update(sampler.window(t0, t1))               # {"gpu_sm_clock_mhz": ..., ...}
    sampler.stop()

It only reads (`nvidia-smi --query-gpu ... -lms`); it never changes a clock or a limit.
"""
from __future__ import annotations

import atexit
import datetime
import os
import pty
import shutil
import statistics
import subprocess
import threading
import time

# The fields asked for, newest names first; a driver that rejects one set gets the other.
FIELDS = [
    ("timestamp", "clocks.sm", "clocks.mem", "power.draw.instant", "enforced.power.limit", "temperature.gpu",
     "clocks_event_reasons.active", "utilization.gpu"),
    ("timestamp", "clocks.sm", "clocks.mem", "power.draw", "power.limit", "temperature.gpu",
     "clocks_throttle_reasons.active", "utilization.gpu"),
]
# NVML's clock event reasons (nvmlClocksEventReason*): the bits that say why the SM clock is low.
POWER_CAP = 0x4  # SwPowerCap: the driver lowered the clock to hold the power limit
HW_SLOWDOWN = 0x8 | 0x80  # HwSlowdown, HwPowerBrakeSlowdown
THERMAL = 0x20 | 0x40  # SwThermalSlowdown, HwThermalSlowdown
INTERVAL_MS = 20  # a pass of kernel rows timed in turns lasts ~0.1-1 s


def parse_line(line: str) -> dict | None:
    """One line of `--format=csv,noheader,nounits` output in FIELDS' order -> a sample, its
    ``time`` in time.time()'s seconds (None for a line that is not one, e.g. a driver message).
    "[N/A]" and the like read as None."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != len(FIELDS[0]):
        return None
    try:  # the machine's local time, as time.mktime reads it
        stamp = datetime.datetime.strptime(parts.pop(0), "%Y/%m/%d %H:%M:%S.%f").timestamp()
    except ValueError:
        return None

    def number(text: str, kind=float):
        try:
            return kind(text, 0) if kind is int else kind(text)
        except ValueError:
            return None

    sm, mem, power, limit, temp, reasons, util = parts
    sample = {"time": stamp, "sm_clock_mhz": number(sm), "mem_clock_mhz": number(mem), "power_w": number(power),
              "power_limit_w": number(limit), "temperature_c": number(temp), "reasons": number(reasons, int),
              "utilization": number(util)}
    return sample if sample["sm_clock_mhz"] is not None else None


def summarize(samples: list[dict]) -> dict:
    """The window's readings as a record's ``gpu_*`` fields ({} without samples): medians of
    clock and power, the minimum clock, the maximum power and temperature, and the fraction of
    samples in which the driver reported each clock-limiting reason."""
    if not samples:
        return {}

    def values(key):
        return [s[key] for s in samples if s.get(key) is not None]

    def median(key):
        v = values(key)
        return statistics.median(v) if v else None

    def fraction(bits):
        flagged = [s["reasons"] for s in samples if s.get("reasons") is not None]
        return sum(1 for r in flagged if r & bits) / len(flagged) if flagged else None

    return {"gpu_samples": len(samples),
            "gpu_sm_clock_mhz": median("sm_clock_mhz"), "gpu_sm_clock_mhz_min": min(values("sm_clock_mhz")),
            "gpu_mem_clock_mhz": median("mem_clock_mhz"),
            "gpu_power_w": median("power_w"), "gpu_power_w_max": max(values("power_w"), default=None),
            "gpu_power_limit_w": median("power_limit_w"),
            "gpu_temperature_c_max": max(values("temperature_c"), default=None),
            "gpu_utilization": median("utilization"),
            "gpu_power_capped": fraction(POWER_CAP), "gpu_hw_slowdown": fraction(HW_SLOWDOWN),
            "gpu_thermal_slowdown": fraction(THERMAL)}


class GpuSampler:
    """nvidia-smi polling one GPU every INTERVAL_MS in the background, each sample stamped by
    nvidia-smi, so that ``window(t0, t1)`` (time.time() seconds) picks a timed region."""

    def __init__(self, command: list[str]):
        self._samples: list[dict] = []
        self._lock = threading.Lock()
        # A terminal for its output: into a pipe, C's stdio would hand its lines over in blocks
        # of a second or more; into a terminal, a line at a time.
        try:
            reader, writer = pty.openpty()
        except OSError:  # no terminals here: a pipe, later lines, the same timestamps
            self._proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self._output = self._proc.stdout
        else:
            self._proc = subprocess.Popen(command, stdout=writer, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
            os.close(writer)
            self._output = os.fdopen(reader, "r", errors="replace")
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        atexit.register(self.stop)  # nvidia-smi must not outlive the benchmark

    @classmethod
    def start(cls, device, smi: str | None = None) -> "GpuSampler | None":
        """A sampler of ``device`` (a CUDA torch.device), or None where there is nothing to read:
        no CUDA device, no nvidia-smi, or no field set it accepts for this GPU."""
        if getattr(device, "type", None) != "cuda":
            return None
        smi = smi or shutil.which("nvidia-smi")
        return cls.open(smi, _gpu_ids(device)) if smi else None

    @classmethod
    def open(cls, smi: str, gpu_ids: list[str]) -> "GpuSampler | None":
        """A sampler through the nvidia-smi at ``smi`` of the first of ``gpu_ids`` it answers for
        with one of FIELDS' sets (a one-shot query first), else None."""
        for gpu in gpu_ids:
            for fields in FIELDS:
                query = [smi, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits", "-i", gpu]
                try:
                    probe = subprocess.run(query, capture_output=True, text=True, timeout=20)
                except (OSError, subprocess.TimeoutExpired):
                    return None
                if probe.returncode == 0 and parse_line(probe.stdout.strip().split("\n")[0]):
                    return cls([*query, "-lms", str(INTERVAL_MS)])
        return None

    def _read(self) -> None:
        try:
            for line in self._output:
                sample = parse_line(line)
                if sample:
                    with self._lock:
                        self._samples.append(sample)
        except OSError:  # the terminal closes when nvidia-smi ends (EIO)
            pass

    def window(self, t0: float, t1: float) -> dict:
        """The ``gpu_*`` summary of the samples taken between t0 and t1 (time.time() seconds,
        by nvidia-smi's own timestamps); it waits a few intervals for the samples up to t1."""
        deadline = time.time() + 5 * INTERVAL_MS / 1e3
        while time.time() < deadline and self._proc.poll() is None:
            with self._lock:
                if self._samples and self._samples[-1]["time"] >= t1:
                    break
            time.sleep(INTERVAL_MS / 1e3)
        with self._lock:
            inside = [s for s in self._samples if t0 <= s["time"] <= t1]
        return summarize(inside)

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._output.close()


def clock_note(record: dict) -> str:
    """A table's note for a record with readings: "  SM 1755 MHz, 690/700 W, power-capped 80 %"."""
    if not record.get("gpu_samples"):
        return ""
    note = f"  SM {record['gpu_sm_clock_mhz']:.0f} MHz"
    if record.get("gpu_power_w") is not None:
        limit = record.get("gpu_power_limit_w")
        note += f", {record['gpu_power_w']:.0f}" + (f"/{limit:.0f}" if limit else "") + " W"
    for key, label in (("gpu_power_capped", "power-capped"), ("gpu_thermal_slowdown", "thermal"),
                       ("gpu_hw_slowdown", "hw-slowdown")):
        if record.get(key):
            note += f", {label} {record[key]:.0%}"
    return note


def _gpu_ids(device) -> list[str]:
    """How nvidia-smi may name torch's ``device``: its UUID (right whatever CUDA_VISIBLE_DEVICES
    says), else torch's index (right where nothing renumbers the GPUs)."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    ids = []
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    if uuid is not None:
        text = str(uuid)
        ids.append(text if text.startswith("GPU-") else f"GPU-{text}")
    ids.append(str(index))
    return ids
