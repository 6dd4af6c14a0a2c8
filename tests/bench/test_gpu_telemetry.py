"""bench/gpu_telemetry.py: nvidia-smi's lines read into samples, a window's summary, and the
sampler run against a stand-in nvidia-smi (a script that answers as the real one does)."""
import datetime
import os
import stat
import sys
import textwrap
import time

import pytest

from bench.gpu_telemetry import FIELDS, GpuSampler, clock_note, parse_line, summarize


def test_parse_line_reads_numbers_hex_reasons_and_missing_values():
    s = parse_line("2026/12/05 07:10:11.250, 1755, 3201, 689.51, 700.00, 61, 0x0000000000000004, 100\r\n")
    assert s.pop("time") == datetime.datetime(2026, 12, 5, 7, 10, 11, 250000).timestamp()  # local time
    assert s == {"sm_clock_mhz": 1755.0, "mem_clock_mhz": 3201.0, "power_w": 689.51, "power_limit_w": 700.0,
                 "temperature_c": 61.0, "reasons": 4, "utilization": 100.0}
    s = parse_line("2026/12/05 07:10:11.300, 1980, 3201, [N/A], [N/A], 40, [N/A], 0")
    assert s["power_w"] is None and s["reasons"] is None and s["sm_clock_mhz"] == 1980.0
    assert parse_line("No devices were found") is None
    assert parse_line("2026/12/05 07:10:11.300, [N/A], 1, 2, 3, 4, 0x0, 5") is None  # no clock: not a sample
    assert parse_line("yesterday, 1980, 3201, 1, 2, 40, 0x0, 0") is None  # no time: not a sample


def test_summarize_takes_medians_extremes_and_the_share_of_each_reason():
    rows = [dict(sm_clock_mhz=c, mem_clock_mhz=3201.0, power_w=p, power_limit_w=700.0, temperature_c=t,
                 reasons=r, utilization=100.0)
            for c, p, t, r in [(1980, 500, 50, 0x0), (1700, 699, 60, 0x4), (1650, 701, 62, 0x4 | 0x20),
                               (1600, 700, 63, 0x4)]]
    out = summarize(rows)
    assert out["gpu_samples"] == 4
    assert out["gpu_sm_clock_mhz"] == 1675 and out["gpu_sm_clock_mhz_min"] == 1600
    assert out["gpu_power_w"] == 699.5 and out["gpu_power_w_max"] == 701 and out["gpu_power_limit_w"] == 700
    assert out["gpu_temperature_c_max"] == 63
    assert out["gpu_power_capped"] == 0.75 and out["gpu_thermal_slowdown"] == 0.25 and out["gpu_hw_slowdown"] == 0
    assert summarize([]) == {}
    note = clock_note(out)
    assert "SM 1675 MHz" in note and "700/700 W" in note and "power-capped 75%" in note and "thermal 25%" in note
    assert clock_note({}) == ""


def _fake_smi(tmp_path, accepted: tuple[str, ...]):
    """An nvidia-smi that knows only the field set ``accepted`` and GPU "GPU-good": a one-shot
    query prints one line; with -lms it prints a line every few milliseconds, the SM clock
    falling by 1 MHz a line, until it is killed. It writes through C stdio's buffering as the
    real one does (print without flush: whole blocks into a pipe, lines into a terminal)."""
    script = tmp_path / "nvidia-smi"
    script.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import datetime, os, sys, time
        sys.stdout = os.fdopen(1, "w", buffering=-1)  # C stdio's: lines to a terminal, else blocks
        args = sys.argv[1:]
        query = next(a.split("=", 1)[1] for a in args if a.startswith("--query-gpu="))
        if query != "{','.join(accepted)}":
            print("Field is not a valid field to query."); sys.exit(2)
        if args[args.index("-i") + 1] != "GPU-good":
            print("No devices were found"); sys.exit(6)
        clock = 1980
        while True:
            now = datetime.datetime.now().strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
            print(f"{{now}}, {{clock}}, 3201, 690.5, 700.00, 60, 0x0000000000000004, 100")
            if "-lms" not in args:
                break
            clock -= 1
            time.sleep(0.005)
        """))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


@pytest.mark.parametrize("accepted", FIELDS, ids=["newer-driver", "older-driver"])
def test_sampler_finds_the_gpu_and_fields_the_driver_takes_and_windows_its_samples(tmp_path, accepted):
    smi = _fake_smi(tmp_path, accepted)
    sampler = GpuSampler.open(smi, ["GPU-unknown", "GPU-good"])
    assert sampler is not None
    try:
        time.sleep(0.1)
        t0 = time.time()
        time.sleep(0.2)
        t1 = time.time()
        inside = sampler.window(t0, t1)  # at once: the lines must come as they are written
        time.sleep(0.2)
        everything = sampler.window(0, time.time())
    finally:
        sampler.stop()
    assert 0 < inside["gpu_samples"] < everything["gpu_samples"]
    assert inside["gpu_power_capped"] == 1.0 and inside["gpu_power_limit_w"] == 700.0
    # the window holds the samples that arrived inside it: later ones have lower clocks
    assert everything["gpu_sm_clock_mhz_min"] < inside["gpu_sm_clock_mhz_min"]
    assert sampler._proc.poll() is not None  # stopped: no nvidia-smi left behind


def test_no_sampler_without_a_gpu_or_an_answer(tmp_path):
    import torch

    assert GpuSampler.start(torch.device("cpu")) is None
    assert GpuSampler.open(_fake_smi(tmp_path, FIELDS[0]), ["GPU-unknown", "0"]) is None
    assert GpuSampler.open(os.devnull, ["GPU-good"]) is None  # not a program
