"""host_copy: host arrays onto the device in stream order, without the host waiting for the GPU;
and back, many small tensors in one copy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_ouroboros.host_copy import PendingRead, copy_into, to_device, to_host

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="pinned staging and stream-ordered copies need a CUDA device")


def _arrays():
    rng = np.random.default_rng(0)
    a = rng.integers(-5, 1 << 40, (7, 5))
    return [a, a[:, ::2], np.arange(4, dtype=np.int32), rng.random(3) < 0.5, np.zeros((0, 3), np.int64)]


def test_values_shapes_and_dtypes(device):
    arrays = _arrays()
    out = to_device(device, *arrays)
    assert len(out) == len(arrays)
    for a, t in zip(arrays, out):
        assert t.device.type == torch.device(device).type
        assert t.shape == a.shape and t.dtype == torch.from_numpy(np.ascontiguousarray(a)).dtype
        assert np.array_equal(t.cpu().numpy(), a)


def test_copy_into_fills_the_buffer(device):
    dst = torch.full((6, 4), -1, dtype=torch.long, device=device)
    src = np.arange(24).reshape(6, 4)[:, ::-1]  # not contiguous
    copy_into(dst, src)
    assert np.array_equal(dst.cpu().numpy(), src)


def test_cpu_wraps_without_copying(monkeypatch):
    """The CPU path costs what it did: the tensor is the array's memory."""
    from vllm_ouroboros import host_copy

    monkeypatch.setattr(host_copy, "COPY_ON_CPU", False)
    a = np.arange(10)
    (t,) = to_device("cpu", a)
    a[0] = 99
    assert t[0].item() == 99


def test_copy_on_cpu_copies_as_a_gpu_does(monkeypatch):
    """COPY_ON_CPU (OUROBOROS_TEST_CPU_COPIES=1 in the tests): an upload is no view of its array
    and a read is the tensors' values when it was queued, as on a GPU, so a CPU run of the draft
    side's tests catches code that reads through the CPU's sharing."""
    from vllm_ouroboros import host_copy

    monkeypatch.setattr(host_copy, "COPY_ON_CPU", True)
    a = np.arange(10)
    (t,) = to_device("cpu", a)
    a[0] = 99
    assert t[0].item() == 0 and t.dtype == torch.int64 and t.shape == (10,)
    x = torch.arange(4)
    read = host_copy.PendingRead(x)
    x += 10  # work queued after the read: not in it
    (got,) = read.arrays()
    assert got.tolist() == [0, 1, 2, 3]


@needs_cuda
def test_source_may_change_once_the_call_returns():
    """The copy reads a pinned staging block, not the array: changing the array right after the
    call, with the copy perhaps still queued behind other work, changes nothing on the device."""
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(8):  # queue work so that the copy waits its turn
        busy = busy @ busy
        busy /= busy.norm()
    a = np.arange(1 << 16)
    (t,) = to_device("cuda", a)
    a[:] = -1
    assert np.array_equal(t.cpu().numpy(), np.arange(1 << 16))


@needs_cuda
def test_no_host_sync():
    """Under torch's sync debug mode ("error") a plain pageable upload raises (the check has
    teeth); to_device and copy_into do not."""
    a = np.arange(1000)
    dst = torch.empty(1000, dtype=torch.long, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):
            torch.from_numpy(a).to("cuda")
        to_device("cuda", a, a[::2])
        copy_into(dst, a)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert np.array_equal(dst.cpu().numpy(), a)


def test_packed_copy_one_buffer_per_dtype():
    """What to_device does on CUDA, with an unpinned buffer on the CPU: the arrays of one dtype
    share one copied buffer as disjoint views in the order given, shapes and values kept."""
    from vllm_ouroboros.host_copy import packed_copy

    arrays = _arrays()
    tensors = [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
    out = packed_copy(tensors, "cpu", pin=False)
    for a, t in zip(arrays, out):
        assert t.shape == a.shape and t.is_contiguous() and np.array_equal(t.numpy(), a)
    by_dtype = {}
    for t in out:
        by_dtype.setdefault(t.dtype, set()).add(t.untyped_storage().data_ptr())
    assert all(len(ptrs) == 1 for ptrs in by_dtype.values())  # one buffer per dtype
    assert by_dtype.keys() == {torch.int64, torch.int32, torch.bool}
    arrays[0][:] = 0  # a copy, not the arrays' memory
    out[0].fill_(-1)  # views do not overlap
    assert np.array_equal(out[1].numpy(), _arrays()[1])


def test_to_host_round_trip(device):
    """Values, shapes and dtypes come back as they went, whatever their mix (non-contiguous,
    empty, bool, several dtypes)."""
    arrays = _arrays()
    tensors = to_device(device, *arrays)
    tensors[1] = tensors[0][:, ::2]  # a strided view of a device tensor
    back = to_host(*tensors)
    for a, h in zip(arrays, back):
        assert isinstance(h, np.ndarray) and h.shape == a.shape and h.dtype == np.ascontiguousarray(a).dtype
        assert np.array_equal(h, a)


@needs_cuda
def test_to_host_syncs_once():
    """Several small results, one read-back: under torch's sync debug mode ("warn") the count of
    synchronisations is one (tempting: a .cpu() per tensor, one wait each)."""
    import warnings

    ts = [torch.arange(5, device="cuda") * i for i in range(6)] + [torch.ones(3, device="cuda", dtype=torch.bool)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            back = to_host(*ts)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert 1 <= len(syncs) <= 2  # one copy per dtype (int64, bool), not one per tensor (7)
    assert all(np.array_equal(b, t.cpu().numpy()) for b, t in zip(back, ts))


def test_pending_read_round_trip(device):
    """A read queued now and taken later gives the values to_host gives, as often as asked."""
    arrays = _arrays()
    tensors = to_device(device, *arrays)
    tensors[1] = tensors[0][:, ::2]
    pending = PendingRead(*tensors)
    back = pending.arrays()
    for a, h in zip(arrays, back):
        assert isinstance(h, np.ndarray) and h.shape == a.shape and np.array_equal(h, a)
    assert all(np.array_equal(x, y) for x, y in zip(back, pending.arrays()))  # read again: the same


@needs_cuda
def test_pending_read_queues_without_waiting_and_sees_the_work_before_it():
    """Queuing the read does not synchronise (sync debug mode "error"); work queued before it
    is in what comes back, work queued after it is not."""
    x = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        x.add_(1)
        pending = PendingRead(x[:4], torch.ones(2, dtype=torch.bool, device="cuda"))
        x.add_(1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    first, flags = pending.arrays()
    assert first.tolist() == [1.0] * 4 and flags.tolist() == [True, True]
