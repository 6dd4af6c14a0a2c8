"""Host copies of a rank's checkpoint tensors, for the checkpoint writer to read.

    staging = HostStaging()
    host = staging.stage(tensors, snapshot=True)   # the same dict, every device tensor on the host
    ... write ``host`` (in the background: the originals may change) ...
    host = staging.stage(tensors, snapshot=True)   # the next save: into the same buffers

Device tensors are copied into page-locked (pinned) host buffers with non-blocking copies and one
synchronisation of the device; the buffers are kept and reused by the next ``stage`` while the
shapes are unchanged, because pinning a rank's part costs seconds each time and a copy into pinned
memory runs at the host link's speed, a pageable one several times slower. Host tensors are
copied only for a ``snapshot`` (a background write reads them while training changes the
originals); a foreground write reads them in place. DTensors are staged as DTensors of the
same layout with a host local part, as DCP's own stagers do.

A staging's buffers are what its last ``stage`` returned: a write reading them must be finished
before the next ``stage`` (Trainer.save publishes the previous save first).
"""
from __future__ import annotations

import torch


class HostStaging:
    """Pinned host buffers, one per checkpoint key, reused from save to save (module doc)."""

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        """Host bytes held between saves."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def stage(self, tensors: dict, *, snapshot: bool) -> dict:
        """``tensors`` with each device tensor (and, for a ``snapshot``, each host tensor) replaced
        by its host copy; other values as they are. Returns once every copy is complete."""
        from torch.distributed.tensor import DTensor

        out, devices = {}, set()
        with torch.no_grad():
            for key, value in tensors.items():
                if not torch.is_tensor(value):
                    out[key] = value
                    continue
                local = value.to_local() if isinstance(value, DTensor) else value
                if local.device.type == "cpu" and not snapshot:
                    out[key] = value
                    continue
                buffer = self._buffer(key, local)
                on_device = local.device.type != "cpu"
                buffer.copy_(local.detach(), non_blocking=on_device and buffer.is_pinned())
                if on_device:
                    devices.add(local.device)
                out[key] = buffer if not isinstance(value, DTensor) else DTensor.from_local(
                    buffer, value.device_mesh, value.placements, run_check=False, shape=value.shape,
                    stride=value.stride())
        for device in devices:  # the non-blocking copies are queued on each device's current stream
            torch.get_device_module(device).synchronize(device)
        return out

    def release(self) -> None:
        """Give the buffers back (the next ``stage`` makes new ones)."""
        self._buffers.clear()

    def _buffer(self, key: str, like: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != like.shape or buffer.dtype != like.dtype:
            buffer = self._buffers[key] = _host_empty(like)
        return buffer


def _host_empty(like: torch.Tensor) -> torch.Tensor:
    """A contiguous host tensor of ``like``'s shape and dtype: pinned when ``like`` is on a device
    (where pinning is refused, say a container's locked-memory limit, pageable: slower, not wrong)."""
    if like.device.type != "cpu":
        try:
            return torch.empty(like.shape, dtype=like.dtype, pin_memory=True)
        except RuntimeError:
            pass
    return torch.empty(like.shape, dtype=like.dtype)
