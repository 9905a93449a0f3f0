"""Where and in what precision to run: one place that decides, so every loop agrees.

bf16 autocast is a large win on CPUs with AVX512-BF16 or AMX (about 2-6x for
matmuls) and on Ampere+ GPUs; elsewhere it is slower than fp32 or unsupported,
so it is detected at run time and can always be switched off
(``TWOTOWER_BF16=0`` or ``bf16=False``).

The setting is ``"auto"``, ``True`` or ``False`` (`check_bf16`). ``"auto"`` uses bf16 where the device has it
natively, unless ``TWOTOWER_BF16=0``; an explicit argument wins over the variable: ``True`` asks for bf16
(refused on a device without native bf16, where it would be emulated and slower than fp32) and ``False``
never uses it.
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
    """Whether "auto" runs in bf16 on `device`: it has native bf16 and ``TWOTOWER_BF16`` is not "0"."""
    device = torch.device(device)
    if os.environ.get("TWOTOWER_BF16", "1") == "0":
        return False
    return _native_bf16(device)


def _native_bf16(device: torch.device) -> bool:
    if device.type == "cuda":
        # Native bf16 (Ampere, compute capability 8, and later) on this device, not the current one:
        # is_bf16_supported() also says yes where bf16 is only emulated (V100, T4), slower than fp32.
        return torch.cuda.is_available() and torch.cuda.get_device_properties(device).major >= 8
    if device.type == "cpu":
        return cpu_bf16_supported()
    return False


def check_bf16(bf16: object) -> None:
    """Refuse a bf16 setting other than "auto", True or False (bf16="yes" or "off" read as True)."""
    if not (isinstance(bf16, bool) or (isinstance(bf16, str) and bf16 == "auto")):
        raise ValueError(f"bf16={bf16!r}: give 'auto' (bf16 where the device has it natively), True or False")


def resolve_bf16(bf16: bool | str, device: torch.device | str) -> bool:
    """Whether to run in bf16 on `device`: "auto" -> where it is native (and TWOTOWER_BF16 is not 0); True ->
    yes, on a device with native bf16 only (ValueError elsewhere, whatever TWOTOWER_BF16 says: an explicit
    argument wins over the variable); False -> no. Any other setting is refused (`check_bf16`)."""
    check_bf16(bf16)
    if bf16 == "auto":
        return bf16_supported(device)
    if bf16 and not _native_bf16(torch.device(device)):
        raise ValueError(f"bf16=True: {device} has no native bf16 (an AVX512-BF16 or AMX CPU, an Ampere or newer "
                         "GPU), where it would be emulated, slower than fp32; pass bf16='auto' or False")
    return bool(bf16)


def autocast(device: torch.device | str, enabled: bool):
    """bf16 autocast context for `device`, or a no-op when disabled."""
    device = torch.device(device)
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
