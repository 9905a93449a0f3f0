"""Where and in what precision to run: one place that decides, so every loop agrees.

bf16 autocast is a large win on CPUs with AVX512-BF16 or AMX (about 2-6x for
matmuls) and on Ampere+ GPUs; elsewhere it is slower than fp32 or unsupported,
so it is detected at run time and can always be switched off
(``TWOTOWER_BF16=0`` or ``bf16=False``).
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@functools.cache
def cpu_bf16_supported() -> bool:
    """True when this CPU has native bf16 matmul (AVX512-BF16 or AMX), as oneDNN reports it."""
    try:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
    except (AttributeError, RuntimeError):
        return False
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = f.read()
        return "avx512_bf16" in flags or "amx_bf16" in flags
    except OSError:  # not Linux: trust oneDNN
        return True


def bf16_supported(device: torch.device | str) -> bool:
    device = torch.device(device)
    if os.environ.get("TWOTOWER_BF16", "1") == "0":
        return False
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return cpu_bf16_supported()
    return False


def resolve_bf16(bf16: bool | str, device: torch.device | str) -> bool:
    """bf16='auto' -> use it where supported; True/False force it (True on an unsupported device raises)."""
    if bf16 == "auto":
        return bf16_supported(device)
    if bf16 and not bf16_supported(device) and os.environ.get("TWOTOWER_BF16", "1") != "0":
        raise ValueError(f"bf16 requested but not supported on {device}")
    return bool(bf16)


def autocast(device: torch.device | str, enabled: bool):
    """bf16 autocast context for `device`, or a no-op when disabled."""
    device = torch.device(device)
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
