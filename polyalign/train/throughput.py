"""Tokens per second, per device, and model FLOPs utilisation for every logged training step.

MFU = tokens/s x FLOPs per token (polyalign/model/flops.py) / (devices x peak FLOP/s). The peak is
`train.peak_tflops` when set, else the dense bf16 peak of the device kind from its datasheet; on a
device not listed (a CPU) MFU is left out rather than guessed. Tokens are the real tokens of the
batch (padding not counted), so MFU is the useful share of the peak.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Dense (no sparsity) bf16 tensor peaks in TFLOP/s per device, from the datasheets, by the device kind
# exactly as jax reports it (case aside): "NVIDIA H200 NVL" is not an H200 SXM. A kind not listed gets
# no MFU unless train.peak_tflops gives its peak.
PEAK_BF16_TFLOPS: dict[str, float] = {
    "NVIDIA H200": 989.0,  # SXM
    "NVIDIA H200 NVL": 835.0,
    "NVIDIA H100 80GB HBM3": 989.0,  # SXM
    "NVIDIA H100 NVL": 835.0,
    "NVIDIA H100 PCIe": 756.0,
    "NVIDIA A100-SXM4-80GB": 312.0,
    "NVIDIA A100-SXM4-40GB": 312.0,
    "NVIDIA A100 80GB PCIe": 312.0,
    "NVIDIA A100-PCIE-40GB": 312.0,
    "TPU v4": 275.0,
    "TPU v5 lite": 197.0,  # v5e
    "TPU v5e": 197.0,
    "TPU v5": 459.0,  # v5p
    "TPU v5p": 459.0,
    "TPU v6 lite": 918.0,  # v6e (Trillium)
    "TPU v6e": 918.0,
}
_PEAKS_BY_KIND = {kind.lower(): peak for kind, peak in PEAK_BF16_TFLOPS.items()}


def known_peak_tflops(device_kind: str) -> float | None:
    """The datasheet peak of this device kind, or None when it is not listed."""
    return _PEAKS_BY_KIND.get(device_kind.strip().lower())


@dataclass(frozen=True)
class Throughput:
    """What one step's tokens and seconds mean: `flops_per_token` None leaves MFU out."""

    devices: int
    flops_per_token: float | None = None
    peak_tflops: float | None = None  # per device

    @classmethod
    def for_devices(cls, devices, flops_per_token: float | None, configured_peak: float | None) -> Throughput:
        devices = list(devices)
        peak = configured_peak if configured_peak is not None else known_peak_tflops(devices[0].device_kind)
        return cls(len(devices), flops_per_token, peak)

    def __call__(self, tokens: float, seconds: float) -> dict[str, Any]:
        rate = tokens / seconds
        out = {"tokens_per_s": round(rate, 1), "tokens_per_s_per_device": round(rate / self.devices, 1)}
        if self.flops_per_token is not None and self.peak_tflops:
            out["mfu"] = round(rate * self.flops_per_token / (self.devices * self.peak_tflops * 1e12), 6)
        return out
