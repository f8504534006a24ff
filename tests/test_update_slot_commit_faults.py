"""A commit whose checks fail in a way no refusal foresaw still ends: the update is refused, naming why, and the slot
is free for the next one (a commit never expires, so an unanswered one held the slot for the worker's life; a bucket's, until the
client's phase deadline). The
finiteness check (--check-finite) covers every floating dtype a tensor may come in, float8 too."""

from __future__ import annotations

import pytest
import torch
from slot_helpers import open_slot, replies

from conftest import tiny_model
from rollout import protocol as p
from rollout.protocol.staging import bucket_checksum
from rollout.protocol.transports.frames import FramesReceiver
from rollout.service.weights import staged_update as weights_module

pytestmark = pytest.mark.timeout(60)
NORM = [p.TensorSpec("model.norm.weight", "float32", [64])]


def push(slot, update_id: str, spec: p.TensorSpec, data: torch.Tensor, count: int) -> p.Message:
    """A one-tensor partial update, begun, sent and committed; returns the commit's answer."""
    slot.handle(b"trainer", p.WeightsBegin(update_id, [spec], partial=True), [], None)
    assert isinstance(replies(slot, count + 1)[-1], p.WeightsReady), slot.sent
    bucket = p.WeightsBucket(update_id, [p.TensorPiece(0, 0, data.numel())], bucket_checksum([data]))
    slot.handle(b"trainer", bucket, [data.numpy().tobytes()], None)
    slot.handle(b"trainer", p.WeightsCommit(update_id), [], None)
    return replies(slot, count + 3, timeout_s=5.0)[-1]


def test_a_commit_whose_checks_raise_is_refused_and_frees_the_slot(monkeypatch):
    def broken(self, check_finite=False):
        raise MemoryError("no room for the check")

    with open_slot() as slot:
        before = slot.manager.engine.model.model.norm.weight.detach().clone()
        monkeypatch.setattr(weights_module.StagedUpdate, "tensors", broken)
        error = push(slot, "a", NORM[0], torch.full((64,), 2.0).view(torch.uint8), 0)
        assert isinstance(error, p.Error) and error.code == "internal" and "MemoryError" in error.message, error
        assert slot.update is None and slot.policy_version == 0
        assert torch.equal(slot.manager.engine.model.model.norm.weight.detach(), before)
        monkeypatch.undo()
        committed = push(slot, "b", NORM[0], torch.full((64,), 2.0).view(torch.uint8), 3)
        assert isinstance(committed, p.WeightsCommitted) and committed.version == 1, committed


def test_a_bucket_whose_staging_raises_is_refused_at_once_and_frees_the_slot(monkeypatch):
    def broken(self, area, begin, pieces, frames, checksum):
        raise MemoryError("no room for the bytes")

    with open_slot() as slot:
        data = torch.full((64,), 2.0).view(torch.uint8)
        monkeypatch.setattr(FramesReceiver, "take_bytes", broken)
        slot.handle(b"trainer", p.WeightsBegin("a", NORM, partial=True), [], None)
        bucket = p.WeightsBucket("a", [p.TensorPiece(0, 0, 256)], bucket_checksum([data]))
        slot.handle(b"trainer", bucket, [data.numpy().tobytes()], None)
        error = replies(slot, 2, timeout_s=5.0)[-1]
        assert isinstance(error, p.Error) and error.code == "internal" and "MemoryError" in error.message, error
        assert slot.update is None and slot.policy_version == 0
        monkeypatch.undo()
        committed = push(slot, "b", NORM[0], data, 2)
        assert isinstance(committed, p.WeightsCommitted) and committed.version == 1, committed


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="no float8 in this torch")
def test_the_finiteness_check_covers_float8_tensors():
    model = tiny_model()
    model.register_buffer("scale8", torch.zeros(8, dtype=torch.float8_e4m3fn))
    spec = p.TensorSpec("scale8", "float8_e4m3fn", [8])
    with open_slot(model) as slot:
        slot.check_finite = True
        nan = torch.zeros(8, dtype=torch.uint8)
        nan[3] = 0x7F  # NaN in float8_e4m3fn (it has no Inf)
        error = push(slot, "nan", spec, nan, 0)
        assert isinstance(error, p.Error) and (error.code, error.field) == ("bad_update", "scale8"), error
        assert "NaN" in error.message and slot.update is None and slot.policy_version == 0
        fine = torch.full((8,), 0x38, dtype=torch.uint8)  # 1.0 in float8_e4m3fn
        committed = push(slot, "fine", spec, fine, 3)
        assert isinstance(committed, p.WeightsCommitted) and committed.version == 1, committed
        assert torch.equal(model.scale8.view(torch.uint8), fine)


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="no float8 in this torch")
def test_a_checkpoint_with_float8_tensors_is_checked_for_nan_too(tmp_path):
    from safetensors.torch import save_file

    from rollout.service.http.control.checkpoint_dir import read_checkpoint
    from rollout.service.http.errors import APIError

    fine = torch.full((8,), 0x38, dtype=torch.uint8).view(torch.float8_e4m3fn)
    served = {"scale8": ("float8_e4m3fn", (8,))}
    save_file({"scale8": fine}, str(tmp_path / "model.safetensors"))
    assert torch.equal(
        read_checkpoint(tmp_path, served, check_finite=True)["scale8"].view(torch.uint8), fine.view(torch.uint8)
    )
    nan = fine.view(torch.uint8).clone()
    nan[5] = 0x7F
    save_file({"scale8": nan.view(torch.float8_e4m3fn)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(APIError, match="holds NaN or Inf"):
        read_checkpoint(tmp_path, served, check_finite=True)


def test_a_checkpoint_value_past_the_served_dtype_is_refused_by_name_not_served_as_inf(tmp_path):
    """/update_weights casts a float32 checkpoint to a float16 worker's dtype: a finite 1e6 would become Inf and every
    sample end in non-finite logits. It is refused naming the file and tensor, as `push_weights` refuses that cast
    (`cast_for_wire`), with or without --check-finite; values within range are cast as before."""
    from safetensors.torch import save_file

    from rollout.service.http.control.checkpoint_dir import read_checkpoint
    from rollout.service.http.errors import APIError

    served = {"w": ("float16", (3,))}
    save_file({"w": torch.tensor([1.0, -2.5, 6e4])}, str(tmp_path / "model.safetensors"))
    read = read_checkpoint(tmp_path, served)["w"]
    assert read.dtype == torch.float16 and torch.equal(read, torch.tensor([1.0, -2.5, 6e4]).half())
    save_file({"w": torch.tensor([1.0, 1e6, float("inf")])}, str(tmp_path / "model.safetensors"))
    for check_finite in (False, True):
        with pytest.raises(APIError, match=r"model\.safetensors: tensor 'w'.*1e\+06.*float16") as refused:
            read_checkpoint(tmp_path, served, check_finite=check_finite)
        assert refused.value.status == 400 and refused.value.param == "weight_dir"
