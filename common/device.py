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


def training_device(device: str | None) -> torch.device:
    """The device a (possibly torchrun-replicated) training process computes on.

    device: ``--device`` ("cpu", "cuda", "cuda:1"; None: a GPU when there is one). Under torchrun with several
    processes a CUDA device means this process's own GPU, ``cuda:{LOCAL_RANK}`` (the one `init_distributed`
    made current for NCCL): the same ``cuda:N`` on every rank would put all ranks on one GPU, with NCCL
    refusing tensors that are not on the current device.
    """
    from twotower.common.distributed import launched_as

    dev = torch.device(device) if device else default_device()
    info = launched_as()
    if dev.type == "cuda" and info.enabled:
        dev = torch.device("cuda", info.local_rank)
    return dev


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


def cpu_description(cpuinfo: str = "/proc/cpuinfo") -> dict:
    """What this CPU is and which of the features that decide training speed it has (benchmarks record it:
    the same code runs ~100x slower bf16 matmuls on a CPU without native bf16)."""
    info = {"model": "unknown", "cores": os.cpu_count(), "avx2": False, "avx512f": False,
            "avx512_bf16": False, "amx_bf16": False}
    try:
        with open(cpuinfo, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return info
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and info["model"] == "unknown":
            info["model"] = value.strip()
        elif key.strip() == "flags":
            flags = set(value.split())
            info.update({k: k in flags for k in ("avx2", "avx512f", "avx512_bf16", "amx_bf16")})
            break
    return info


def bf16_supported(device: torch.device | str) -> bool:
    device = torch.device(device)
    if os.environ.get("TWOTOWER_BF16", "1") == "0":
        return False
    if device.type == "cuda":
        # Native bf16 (Ampere, compute capability 8, and later) on this device, not the current one:
        # is_bf16_supported() also says yes where bf16 is only emulated (V100, T4), slower than fp32.
        return torch.cuda.is_available() and torch.cuda.get_device_properties(device).major >= 8
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
