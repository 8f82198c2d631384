"""Host <-> device staging (m3sdk/staging.py) on the test device: copies are snapshots, buffers are reused in turn."""

import torch

from m3sdk.staging import HostCopy, UploadRing, to_device


def test_to_device_copies_lists_and_keeps_a_tensor_already_there(device):
    t = to_device([3, -1, 7], torch.int64, device)
    assert t.device.type == torch.device(device).type and t.tolist() == [3, -1, 7]
    assert to_device(t, torch.int64, t.device) is t
    assert to_device(t, torch.int32, t.device).dtype == torch.int32


def test_host_copy_is_a_snapshot_and_reuses_its_buffers(device):
    a = torch.arange(5, device=device)
    copy = HostCopy(a, None)
    a += 100  # queued after the copy: the copy holds the values sent
    got, none = copy.get()
    assert got.device.type == "cpu" and got.tolist() == [0, 1, 2, 3, 4] and none is None
    buffer = got.untyped_storage().data_ptr()
    copy.send(torch.tensor([9, 8], device=device))
    (again,) = copy.get()
    assert again.tolist() == [9, 8] and again.untyped_storage().data_ptr() == buffer
    copy.send(torch.ones(2, 3, device=device))  # another dtype and shape: a buffer of its own
    assert copy.get()[0].shape == (2, 3) and copy.get()[0].sum().item() == 6


def test_upload_ring_takes_its_buffers_in_turn(device):
    dst = torch.full((4,), -1, dtype=torch.int64, device=device)
    ring = UploadRing((4,), torch.int64, torch.device(device), copies=2)
    first = ring.take()
    first[:] = torch.tensor([1, 2, 3, 4])
    ring.upload(dst, 2)
    second = ring.take()
    assert second.data_ptr() != first.data_ptr()
    second[:] = 5
    ring.upload(dst)
    assert ring.take().data_ptr() == first.data_ptr()
    assert dst.tolist() == [5, 5, 5, 5]
