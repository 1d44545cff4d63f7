"""Device descriptions: what capability checks look at, substitutable in tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DeviceInfo", "describe_device"]


@dataclass(frozen=True)
class DeviceInfo:
    """What a backend's capability check may look at. Build one by hand to pretend to be any GPU."""

    type: str  # "cuda" or "cpu" (or any torch device type)
    name: str = ""
    capability: tuple[int, int] | None = None  # (major, minor) for CUDA devices
    index: int | None = None
    multiprocessors: int | None = None
    l2_bytes: int | None = None

    @property
    def sm(self) -> int | None:
        """Compute capability as one integer (90, 100, 103, 120, ...), or None off CUDA."""
        return None if self.capability is None else self.capability[0] * 10 + self.capability[1]

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.type, self.index) if self.index is not None else torch.device(self.type)

    def __str__(self) -> str:
        if self.type != "cuda":
            return self.type
        return f"{self.name or 'cuda'} (SM{self.sm})"


def describe_device(device: DeviceInfo | torch.device | str | int | None = None) -> DeviceInfo:
    """Describe ``device``; None means the current CUDA device if there is one, else the CPU."""
    if isinstance(device, DeviceInfo):
        return device
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    elif isinstance(device, int):
        device = torch.device("cuda", device)
    else:
        device = torch.device(device)
    if device.type != "cuda":
        return DeviceInfo(type=device.type)
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return DeviceInfo(
        type="cuda",
        name=props.name,
        capability=(props.major, props.minor),
        index=index,
        multiprocessors=props.multi_processor_count,
        l2_bytes=getattr(props, "L2_cache_size", None),
    )
