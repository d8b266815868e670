"""Host arrays onto the device without waiting for it.

A plain `torch.from_numpy(a).to("cuda")` copies from pageable memory, and CUDA makes such a copy
wait until the stream has run everything queued before it: a host-device synchronisation at
every upload, which in a step of many small uploads (the host loop's forward inputs, the pool
inserts, the tree plan's index arrays) stops the host from running ahead of the GPU. Staged in
pinned memory, the copy is queued like a kernel. torch's caching host allocator keeps a pinned
block from reuse until the copies that read it have run, so the staging buffers need no
bookkeeping here, and the numpy array may change as soon as the call returns.

On a CPU device the arrays are wrapped, not copied (what `.to("cpu")` of `from_numpy` gives):
the CPU path stays as fast as it was. The way back (`to_host`) packs a step's small results the
same way: one device-to-host copy per dtype, one wait. No vLLM imports.

COPY_ON_CPU (tests: OUROBOROS_TEST_CPU_COPIES=1, tests/conftest.py) gives a CPU device the copies
a GPU makes: the tensor uploaded is no view of the array, the array read back no view of the
tensor (snapshotted when the read is queued). Code that read through that sharing on a CPU would
read stale or newer values on a GPU, where no CPU test saw it.
"""

from __future__ import annotations

import numpy as np
import torch

COPY_ON_CPU = False


def to_device(device: torch.device | str, *arrays: np.ndarray) -> list[torch.Tensor]:
    """Each host array as a tensor on `device`, same shape and dtype, in stream order.

    CUDA: the arrays of one dtype go in one pinned staging buffer and one asynchronous copy
    (module docstring), the results being views of its device copy (disjoint, contiguous): a
    step's dozen small uploads cost a copy per dtype, not one each. CPU: a tensor sharing the
    array's memory (contiguous copy first where the array is not)."""
    device = torch.device(device)
    out = [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
    if device.type == "cpu":
        return packed_copy(out, device, pin=False) if COPY_ON_CPU else out
    return packed_copy(out, device, pin=True)


def packed_copy(tensors: list[torch.Tensor], device: torch.device | str, pin: bool) -> list[torch.Tensor]:
    """Host tensors to `device` with one staging buffer (pinned where `pin`) and one copy per
    dtype; returns views of the copies, in the order given, shapes kept."""
    def move(group: list[torch.Tensor]) -> torch.Tensor:
        staging = torch.empty(sum(t.numel() for t in group), dtype=group[0].dtype, pin_memory=pin)
        torch.cat([t.reshape(-1) for t in group], out=staging)
        return staging.to(device, non_blocking=pin)
    return _per_dtype(tensors, move)


def _per_dtype(tensors: list[torch.Tensor], move) -> list:
    """Each dtype's tensors flattened through one `move` (a flat tensor in, a flat tensor or
    array out), split back into the tensors' shapes, in the order given."""
    out: list = [None] * len(tensors)
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    for idx in groups.values():
        moved = move([tensors[i] for i in idx])
        off = 0
        for i in idx:
            n = tensors[i].numel()
            out[i] = moved[off:off + n].reshape(tensors[i].shape)
            off += n
    return out


def copy_into(dst: torch.Tensor, array: np.ndarray) -> None:
    """dst.copy_(array) in stream order without a host wait on CUDA (to_device); dst's shape
    and dtype are the array's (broadcasting as copy_ does)."""
    src = torch.from_numpy(np.ascontiguousarray(array))
    if dst.device.type == "cpu":
        dst.copy_(src)
    else:
        dst.copy_(src.pin_memory(), non_blocking=True)


class PendingRead:
    """Device tensors on their way to the host: the copies are queued at construction (on CUDA
    one asynchronous copy per dtype into pinned memory, behind the work already queued), and
    `arrays()` waits for them. Work queued after it (a drafting round) runs on; whatever waits
    for that work later has waited for these copies too (one stream), so a read queued ahead
    of a round that ends in its own read costs no wait of its own.

    On a CPU device the arrays share the tensors' memory, as to_host's."""

    def __init__(self, *tensors: torch.Tensor):
        self._event = None
        if all(t.device.type == "cpu" for t in tensors):
            self._host = [t.detach().clone() if COPY_ON_CPU else t.detach() for t in tensors]
            return

        def move(group: list[torch.Tensor]) -> torch.Tensor:
            staging = torch.empty(sum(t.numel() for t in group), dtype=group[0].dtype, pin_memory=True)
            staging.copy_(torch.cat([t.detach().reshape(-1) for t in group]), non_blocking=True)
            return staging

        self._host = _per_dtype(list(tensors), move)
        self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(next(t.device for t in tensors if t.device.type != "cpu")))

    def arrays(self) -> list[np.ndarray]:
        """The tensors as host arrays (shapes and dtypes kept), once their copies are done."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return [t.numpy() for t in self._host]


def to_host(*tensors: torch.Tensor) -> list[np.ndarray]:
    """Device tensors as host arrays, same shapes and dtypes, read back with one copy per dtype
    (on a GPU: one synchronisation for the lot, where a `.cpu()` each would wait each time).

    On a CPU device the arrays share the tensors' memory (what `.numpy()` gives): read them,
    do not write them."""
    return PendingRead(*tensors).arrays()
