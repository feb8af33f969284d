"""Where tensors go: the one reading of a device name ("auto", "cpu", "cuda", "cuda:N").

"auto" is CUDA when this process sees a GPU, else the CPU. A CUDA device this process cannot
see is refused naming the setting it came from (`what`), unless the device is for another
process to open (a server launched elsewhere: `here=False`).
"""

from __future__ import annotations

import torch


def resolve_device(name: str, what: str = "cluster.device", here: bool = True) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)  # RuntimeError naming the device types torch knows
    if here and dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{what}={name} but torch sees no CUDA device here")
    return dev
