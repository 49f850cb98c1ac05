"""GPU discovery: NVML through ``nvidia-ml-py`` (``import pynvml``), or emulated GPUs.

No NVML library or no driver means the machine has no GPUs; that is a normal
answer, not an error.
"""

from __future__ import annotations

from shoal.events import GpuInfo


def fake_gpus(n: int, gpu_type: str = "V100", memory_mb: int = 16_384) -> tuple[GpuInfo, ...]:
    """``n`` emulated GPUs of one type."""
    return tuple(
        GpuInfo(index=i, gpu_type=gpu_type, memory_mb=memory_mb, uuid=f"fake-{gpu_type}-{i}")
        for i in range(n)
    )


def _short_type(name: str) -> str:
    # "Tesla V100-SXM2-16GB" -> "V100", "NVIDIA H100 80GB HBM3" -> "H100"
    for token in name.replace("-", " ").split():
        if (
            any(c.isdigit() for c in token)
            and any(c.isalpha() for c in token)
            and token.upper() not in {"16GB", "32GB", "80GB", "40GB"}
        ):
            return token.upper()
    return name.replace(" ", "_")[:32]


def discover_nvml() -> tuple[GpuInfo, ...]:
    """The GPUs NVML sees; empty when there is no NVML library or driver."""
    try:
        import pynvml
    except ImportError:
        return ()
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound, DriverNotLoaded …: no GPUs here
        return ()
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            name = name.decode() if isinstance(name, bytes) else name
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
            out.append(
                GpuInfo(index=i, gpu_type=_short_type(name), memory_mb=int(mem.total // 2**20), uuid=uuid)
            )
        return tuple(out)
    finally:
        pynvml.nvmlShutdown()


def read_nvml(index: int) -> tuple[float, int, float] | None:
    """(utilization, memory used MiB, temperature) of GPU ``index``, or None without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        util = pynvml.nvmlDeviceGetUtilizationRates(h)
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        temp = pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)
        return util.gpu / 100.0, int(mem.used // 2**20), float(temp)
    except Exception:
        return None
    finally:
        pynvml.nvmlShutdown()
