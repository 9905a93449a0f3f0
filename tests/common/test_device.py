"""twotower.common.device: the CPU description benchmarks record, read from a cpuinfo file."""

from __future__ import annotations

from twotower.common.device import cpu_description

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse2 avx avx2 fma
processor\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse2 avx avx2 fma
"""


def test_reads_model_and_the_features_that_decide_speed(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO)
    info = cpu_description(str(path))
    assert info["model"] == "AMD EPYC 7B13"
    assert info["avx2"] and not info["avx512f"] and not info["avx512_bf16"] and not info["amx_bf16"]
    path.write_text(CPUINFO.replace("avx2 fma", "avx2 avx512f avx512_bf16 amx_bf16"))
    info = cpu_description(str(path))
    assert info["avx512f"] and info["avx512_bf16"] and info["amx_bf16"]


def test_missing_file_gives_unknown(tmp_path):
    info = cpu_description(str(tmp_path / "absent"))
    assert info["model"] == "unknown" and not info["avx2"]


def test_training_device_under_torchrun_is_the_ranks_own_gpu(monkeypatch):
    """``--device cuda:0`` (or ``cuda``) on every rank of a 2-GPU torchrun: rank 1 computes on cuda:1, the GPU
    init_distributed made current, not on rank 0's; alone, the device is as given."""
    import torch

    from twotower.common.device import training_device

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert training_device("cuda:0") == torch.device("cuda", 1)
    assert training_device("cuda") == torch.device("cuda", 1)
    assert training_device("cpu") == torch.device("cpu")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert training_device("cuda:1") == torch.device("cuda", 1)
    assert training_device("cuda") == torch.device("cuda")


def test_bf16_on_a_gpu_needs_native_bf16_on_that_gpu(monkeypatch):
    """A V100 (compute capability 7.0) only emulates bf16, although torch.cuda.is_bf16_supported() says yes;
    an A100 (8.0) has it. Each device is judged by its own capability, not by the current device's."""
    from types import SimpleNamespace

    import torch

    from twotower.common.device import bf16_supported

    majors = {0: 7, 1: 8}  # cuda:0 a V100 (the current device), cuda:1 an A100
    monkeypatch.delenv("TWOTOWER_BF16", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d=None: SimpleNamespace(major=majors[0 if d is None or torch.device(d).index is None
                                                                    else torch.device(d).index]))
    assert not bf16_supported("cuda:0") and not bf16_supported("cuda")
    assert bf16_supported("cuda:1")
