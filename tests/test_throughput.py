"""course_lib.throughput's peak table: which card's dense bf16 peak MFU is measured against, told from the name
torch reports (``torch.cuda.get_device_name``) and, on ROCm, the architecture. A pure function of those strings, so
every card's decision is checked here without the card."""

import pytest
import torch

from course_lib import throughput

TFLOPS = 1e12


@pytest.mark.parametrize("name,card,tflops", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.4),  # what an H100 SXM5 reports
    ("NVIDIA H100 PCIe", "H100 PCIe", 756.5),
    ("NVIDIA H100 NVL", "H100 NVL", 835.5),
    ("NVIDIA H200", "H200 SXM", 989.4),
    ("NVIDIA H200 NVL", "H200 NVL", 835.5),
    ("NVIDIA GH200 480GB", "GH200", 989.4),  # "H200" is inside "GH200": the superchip's GPU is an H100 SXM's
    ("NVIDIA A100-SXM4-80GB", "A100", 312),
    ("NVIDIA A100 80GB PCIe", "A100", 312),
    ("NVIDIA L40S", "L40S", 362.05),
    ("AMD Instinct MI300X", "MI300X", 1307.4),
    ("AMD Instinct MI300X VF", "MI300X", 1307.4),
    ("AMD Instinct MI325X", "MI325X", 1307.4),
    ("AMD Instinct MI300A", "MI300A", 980.6),
    ("AMD Instinct MI250X", "MI250X", 383.0),
])
def test_each_card_gets_its_own_peak(name, card, tflops):
    peak = throughput.peak_for_name(name)
    assert peak is not None and peak.card == card and peak.flops == pytest.approx(tflops * TFLOPS)
    assert name in peak.reason  # the reason says which name told the card


def test_the_h100_variants_are_told_apart():
    """The defect: "H100" is in every H100's name, so the PCIe (756) and NVL (835) cards got the SXM's 989."""
    names = ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H100 NVL")
    peaks = {n: throughput.peak_for_name(n).flops for n in names}
    assert len(set(peaks.values())) == 3, peaks
    assert peaks["NVIDIA H100 PCIe"] < peaks["NVIDIA H100 NVL"] < peaks["NVIDIA H100 80GB HBM3"]


def test_unknown_cards_get_no_peak_and_a_bare_gfx942_is_taken_for_an_mi300x():
    for name in ("NVIDIA GeForce RTX 4090", "Tesla T4", "AMD Radeon Graphics", ""):
        assert throughput.peak_for_name(name) is None, name
    bare = throughput.peak_for_name("AMD Radeon Graphics", arch="gfx942:sramecc+:xnack-")
    assert bare.card == "MI300X" and "gfx942" in bare.reason and "assumed" in bare.reason
    assert throughput.peak_for_name("AMD Radeon Graphics", arch="gfx90a:sramecc+:xnack-") is None
    assert throughput.peak_for_name("AMD Instinct MI300A", arch="gfx942").card == "MI300A"  # the name wins


def test_the_description_says_the_figure_the_card_and_why():
    text = throughput.peak_for_name("NVIDIA H100 PCIe").describe()
    assert text.startswith("756 TFLOP/s dense bf16") and "H100 PCIe" in text and "'NVIDIA H100 PCIe'" in text


def test_a_cpu_claims_no_peak():
    assert throughput.device_peak("cpu") is None and throughput.peak_bf16_flops("cpu") is None
    assert throughput.device_peak(None) is None
    assert throughput.peak_bf16_flops(torch.device("cpu")) is None
