"""CPU: the planner plans without NVLink (issue 16): ranks sharing one GPU use the device copy bandwidth, GPUs on
PCIe the link's, `explain()` says which (`scaleup_path`), and the argument / EPKIT_NVLINK_GBS still win. nvidia-smi
and the driver are faked."""

from __future__ import annotations

import pytest
from ep_core import planner
from ep_core.errors import EPConfigError
from ep_core.topology import Topology

NVLINK = "GPU 0: NVIDIA H200 (UUID: GPU-x)\n\t Link 0: 26.562 GB/s\n\t Link 1: 26.562 GB/s\n"
NO_LINKS = "GPU 0: NVIDIA L40S (UUID: GPU-x)\n"


def _smi(monkeypatch, *, nvlink="", gpus=1, pcie="5, 16"):
    def run(cmd):
        if cmd[:2] == ["nvidia-smi", "nvlink"]:
            return nvlink
        if cmd[:2] == ["nvidia-smi", "-L"]:
            return "".join(f"GPU {i}: NVIDIA L40S (UUID: GPU-{i})\n" for i in range(gpus))
        if cmd[0] == "nvidia-smi" and cmd[1].startswith("--query-gpu=pcie"):
            return pcie
        return ""

    monkeypatch.delenv("EPKIT_NVLINK_GBS", raising=False)
    monkeypatch.setattr(planner, "_run", run)
    monkeypatch.setattr(planner, "_device_copy_gbs", lambda: 2000.0)


def _plan(n=4, **kw):
    return planner.explain(Topology(n), 64, 8, num_device_sms=132, **kw)


def test_nvlink_when_links_are_reported(monkeypatch):
    _smi(monkeypatch, nvlink=NVLINK)
    p = _plan()
    assert p.scaleup_path == "nvlink" and p.nvlink_gbs == pytest.approx(2 * 26.562 * 0.9)


def test_ranks_sharing_one_gpu_use_the_device_copy_bandwidth(monkeypatch):
    _smi(monkeypatch, nvlink=NO_LINKS, gpus=1)
    p = _plan()
    assert p.scaleup_path == "same_gpu" and p.nvlink_gbs == 2000.0 and p.bound == "nvlink"
    assert 4 <= p.num_sms <= 132
    assert planner.get_theoretical_num_sms(Topology(4), 64, 8, num_device_sms=132) == p.num_sms


def test_gpus_on_pcie_use_the_link(monkeypatch):
    _smi(monkeypatch, nvlink=NO_LINKS, gpus=4, pcie="5, 16\n5, 16\n")
    p = _plan()
    assert p.scaleup_path == "pcie" and p.nvlink_gbs == pytest.approx(3.938 * 16 * 0.9)
    assert p.num_sms < _plan(nvlink_gbs=2000.0).num_sms  # a slower link needs fewer SMs to saturate


def test_one_gpu_without_a_device_bandwidth_falls_back_to_pcie(monkeypatch):
    _smi(monkeypatch, nvlink=NO_LINKS, gpus=1, pcie="4, 16")
    monkeypatch.setattr(planner, "_device_copy_gbs", lambda: 0.0)
    assert _plan().scaleup_path == "pcie"


def test_argument_and_env_override_win(monkeypatch):
    _smi(monkeypatch, nvlink=NO_LINKS, gpus=1)
    p = _plan(nvlink_gbs=123.0)
    assert (p.scaleup_path, p.nvlink_gbs) == ("argument", 123.0)
    monkeypatch.setenv("EPKIT_NVLINK_GBS", "77")
    p = _plan()
    assert (p.scaleup_path, p.nvlink_gbs) == ("env", 77.0)


def test_nothing_detectable_still_names_the_knob(monkeypatch):
    _smi(monkeypatch, nvlink="", gpus=0, pcie="")
    with pytest.raises(EPConfigError, match="EPKIT_NVLINK_GBS"):
        _plan()
    assert _plan(n=1).scaleup_path == ""  # one rank: no scale-up traffic, no bandwidth needed


def test_parse_pcie():
    assert planner.parse_nvidia_smi_pcie("4, 16\n") == pytest.approx(1.969 * 16)
    assert planner.parse_nvidia_smi_pcie("[N/A], [N/A]\n") == 0.0
    assert planner.parse_nvidia_smi_pcie("") == 0.0
