"""A fake ``pynvml`` for unit tests: the subset of nvidia-ml-py the monitor calls, over a list of cards.

Put it in place of the real binding with ``monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(...))``;
the monitor imports ``pynvml`` at call time, so it reads the fake. Figures of the named cards
are what those cards' NVML reports (names as ``nvidia-smi`` prints them, totals in MiB).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

MIB = 1024**2


class NVMLError(Exception):
    """Like pynvml.NVMLError: carries an NVML return code."""

    def __init__(self, value: int = 999, msg: str = "Unknown Error"):
        super().__init__(msg)
        self.value = value
        self.msg = msg

    def __str__(self) -> str:
        return self.msg


@dataclass
class FakeCard:
    name: str
    total_mib: int
    cc: tuple[int, int]
    used_mib: int = 500
    mem_clock_mhz: int | None = None  # max memory clock
    bus_bits: int | None = None
    sm_clock_mhz: int | None = None
    sms: int | None = None  # None: nvmlDeviceGetAttributes fails (as it does on non-MIG devices)
    cores: int | None = None
    power_mw: int = 300_000
    lost: bool = False  # the card fell off the bus: every query raises
    uuid: str = field(default="")


def h100_sxm() -> FakeCard:
    return FakeCard("NVIDIA H100 80GB HBM3", 81559, (9, 0), mem_clock_mhz=2619, bus_bits=5120, sm_clock_mhz=1980,
                    cores=16896, power_mw=700_000)


def l4() -> FakeCard:
    return FakeCard("NVIDIA L4", 23034, (8, 9), mem_clock_mhz=6251, bus_bits=192, sm_clock_mhz=2040, cores=7424,
                    power_mw=72_000)


def t4() -> FakeCard:
    return FakeCard("Tesla T4", 15360, (7, 5), mem_clock_mhz=5001, bus_bits=256, sm_clock_mhz=1590, cores=2560,
                    power_mw=70_000)


def unknown_ada() -> FakeCard:
    """A card no catalog lists: an Ada workstation part with made-up but plausible NVML figures."""
    return FakeCard("NVIDIA RTX 5000 Ada Generation", 32760, (8, 9), mem_clock_mhz=9001, bus_bits=256,
                    sm_clock_mhz=2550, cores=12800, power_mw=250_000)


class FakeNvml:
    """Module-shaped: the functions and constants of ``pynvml`` that ``control/registry/monitor.py`` uses."""

    NVMLError = NVMLError
    NVML_CLOCK_SM = 1
    NVML_CLOCK_MEM = 2

    def __init__(self, cards: list[FakeCard], *, init_error: str | None = None,
                 driver_version: str | None = "580.65.06", cuda_driver_version: int | None = 13000):
        """``driver_version`` / ``cuda_driver_version`` (NVML's encoding: 13000 is CUDA 13.0): the
        node's driver, by default the CUDA 13.0 GA one that vLLM 0.32 needs; None: Not Supported."""
        self.cards = cards
        self.init_error = init_error
        self.driver_version = driver_version
        self.cuda_driver_version = cuda_driver_version
        self.initialised = 0
        self.calls: list[str] = []

    def nvmlInit(self) -> None:
        if self.init_error:
            raise NVMLError(9, self.init_error)
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self.initialised -= 1

    def _live(self) -> None:
        if self.initialised <= 0:
            raise NVMLError(1, "Uninitialized")

    def nvmlDeviceGetCount(self) -> int:
        self._live()
        return len(self.cards)

    def nvmlSystemGetDriverVersion(self) -> str:
        self._live()
        if self.driver_version is None:
            raise NVMLError(3, "Not Supported")
        return self.driver_version

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        self._live()
        if self.cuda_driver_version is None:
            raise NVMLError(3, "Not Supported")
        return self.cuda_driver_version

    def nvmlDeviceGetHandleByIndex(self, i: int) -> FakeCard:
        self._live()
        card = self.cards[i]
        if card.lost:
            raise NVMLError(15, "GPU is lost")
        return card

    def nvmlDeviceGetName(self, h: FakeCard) -> str:
        return h.name

    def nvmlDeviceGetUUID(self, h: FakeCard) -> str:
        return h.uuid or f"GPU-fake-{self.cards.index(h)}"

    def nvmlDeviceGetMemoryInfo(self, h: FakeCard):
        return SimpleNamespace(total=h.total_mib * MIB, used=h.used_mib * MIB, free=(h.total_mib - h.used_mib) * MIB)

    def nvmlDeviceGetCudaComputeCapability(self, h: FakeCard) -> tuple[int, int]:
        return h.cc

    def nvmlDeviceGetMaxClockInfo(self, h: FakeCard, kind: int) -> int:
        value = h.mem_clock_mhz if kind == self.NVML_CLOCK_MEM else h.sm_clock_mhz
        if value is None:
            raise NVMLError(3, "Not Supported")
        return value

    def nvmlDeviceGetMemoryBusWidth(self, h: FakeCard) -> int:
        if h.bus_bits is None:
            raise NVMLError(3, "Not Supported")
        return h.bus_bits

    def nvmlDeviceGetAttributes(self, h: FakeCard):
        if h.sms is None:
            raise NVMLError(3, "Not Supported")
        return SimpleNamespace(multiprocessorCount=h.sms)

    def nvmlDeviceGetNumGpuCores(self, h: FakeCard) -> int:
        if h.cores is None:
            raise NVMLError(3, "Not Supported")
        return h.cores

    def nvmlDeviceGetPowerManagementDefaultLimit(self, h: FakeCard) -> int:
        return h.power_mw

    def nvmlDeviceGetPowerManagementLimit(self, h: FakeCard) -> int:
        return h.power_mw
