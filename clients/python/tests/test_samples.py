"""Sample validation and encoding, without a broker: every bad input is an
InvalidSample naming the tensor and the bad value."""

import numpy as np
import pytest
import torch

from dflash_client import InvalidSample, bf16_bits_to_float32, float32_to_bf16_bytes, make_sample
from dflash_client._proto import broker_pb2 as pb
from dflash_client.tensors import received_tensors, validate_sample

from samples import synthetic_sample


def good(length=6, width=8):
    ids = np.arange(length, dtype=np.int64)
    mask = np.ones(length, dtype=np.uint8)
    hidden = torch.randn(length, width).to(torch.bfloat16)
    return ids, mask, hidden


def test_a_valid_sample_round_trips_through_the_wire_types():
    ids, mask, hidden = good()
    sample = make_sample(ids, mask, hidden)
    decoded = pb.Sample.FromString(sample.SerializeToString())
    tensors = received_tensors(decoded)
    assert tensors["input_ids"].dtype == "int32" and tensors["input_ids"].shape == (6,)
    assert tensors["loss_mask"].dtype == "uint8"
    assert tensors["hidden_states"].dtype == "bf16" and tensors["hidden_states"].shape == (6, 8)
    np.testing.assert_array_equal(tensors["input_ids"].numpy(), ids)
    np.testing.assert_array_equal(tensors["loss_mask"].numpy(), mask)
    assert torch.equal(tensors["hidden_states"].torch(), hidden)
    np.testing.assert_array_equal(bf16_bits_to_float32(tensors["hidden_states"].numpy()), hidden.float().numpy())


def test_numpy_views_of_received_bytes_are_zero_copy():
    sample = make_sample(*synthetic_sample(3, width=16))
    tensor = received_tensors(sample)["hidden_states"]
    view = tensor.numpy()
    assert not view.flags.owndata and not view.flags.writeable
    assert view.__array_interface__["data"][0] == np.frombuffer(tensor.data, np.uint8).__array_interface__["data"][0]


def test_float32_to_bf16_rounds_like_torch():
    values = np.concatenate(
        [
            np.random.default_rng(0).standard_normal(10000).astype(np.float32) * 100,
            np.array([0.0, -0.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 65504.0, 3.4e38, np.inf, -np.inf], np.float32),
        ]
    )
    ours = np.frombuffer(float32_to_bf16_bytes(values), dtype="<u2")
    theirs = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(ours, theirs)
    nan = np.frombuffer(float32_to_bf16_bytes(np.array([np.nan], np.float32)), dtype="<u2")
    assert np.isnan(bf16_bits_to_float32(nan))[0]


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda s: {**s, "hidden_states": torch.randn(6, 8)}, "'hidden_states': torch tensor float32 [6, 8], expected bfloat16"),
        (lambda s: {**s, "hidden_states": np.zeros((6, 8), np.float32)}, "'hidden_states': numpy array float32 [6, 8], expected bfloat16"),
        (lambda s: {**s, "hidden_states": torch.zeros(5, 8, dtype=torch.bfloat16)}, "'hidden_states': 5 rows, expected 6"),
        (lambda s: {**s, "hidden_states": torch.zeros(6, 8, 1, dtype=torch.bfloat16)}, "'hidden_states': shape [6, 8, 1], expected [T, width]"),
        (lambda s: {**s, "hidden_states": b"\x00" * 13}, "'hidden_states': 13 bytes is not a whole number of bf16 rows for T=6"),
        (lambda s: {**s, "input_ids": np.array([1, -2, 3, 4, 5, 6])}, "'input_ids': token id -2 is outside"),
        (lambda s: {**s, "input_ids": np.array([1, 2**31, 3, 4, 5, 6])}, f"'input_ids': token id {2**31} is outside"),
        (lambda s: {**s, "input_ids": np.zeros(6, np.float32)}, "'input_ids': numpy array float32 [6], expected integer token ids"),
        (lambda s: {**s, "input_ids": np.zeros((2, 3), np.int32)}, "'input_ids': shape [2, 3], expected [T]"),
        (lambda s: {**s, "input_ids": np.zeros(0, np.int32)}, "'input_ids': shape [0], expected [T] with T >= 1"),
        (lambda s: {**s, "loss_mask": np.array([0, 1, 2, 1, 1, 1])}, "'loss_mask': value 2 is not 0 or 1"),
        (lambda s: {**s, "loss_mask": np.ones(5, np.uint8)}, "'loss_mask': shape [5], expected [6] like input_ids"),
        (lambda s: {**s, "loss_mask": torch.ones(6)}, "'loss_mask': torch tensor float32 [6], expected 0/1 integers or bool"),
        (lambda s: {**s, "loss_mask": "111111"}, "'loss_mask': str, expected a numpy array or torch tensor"),
    ],
)
def test_bad_samples_are_rejected_with_the_value(change, message):
    ids, mask, hidden = good()
    arguments = change({"input_ids": ids, "loss_mask": mask, "hidden_states": hidden})
    with pytest.raises(InvalidSample) as raised:
        make_sample(**arguments)
    assert message in str(raised.value)


def test_hidden_width_is_checked_when_given():
    ids, mask, hidden = good(width=8)
    make_sample(ids, mask, hidden, hidden_width=8)
    with pytest.raises(InvalidSample, match="'hidden_states': width 8, expected 320"):
        make_sample(ids, mask, hidden, hidden_width=320)


def test_received_tensors_enforce_the_byte_length_rule():
    sample = pb.Sample(tensors=[pb.Tensor(name="hidden_states", dtype=pb.DTYPE_BF16, shape=[256, 4096], data=b"\x00" * 1048576)])
    with pytest.raises(Exception) as raised:
        validate_sample(sample)
    # The same message as proto/src/tensor.rs.
    assert str(raised.value) == "tensor 'hidden_states': 1048576 bytes, expected 2097152 for bf16 [256, 4096]"
    duplicate = pb.Sample(tensors=[pb.Tensor(name="a", dtype=pb.DTYPE_U8, shape=[1], data=b"\x01")] * 2)
    with pytest.raises(Exception, match="two tensors named 'a'"):
        validate_sample(duplicate)
    unknown = pb.Sample(tensors=[pb.Tensor(name="a", dtype=99, shape=[1], data=b"\x01")])
    with pytest.raises(Exception, match="dtype 99 is not a known element type"):
        validate_sample(unknown)


def test_a_dspark_sample_carries_the_last_hidden_states():
    hidden = torch.randn(5, 8).to(torch.bfloat16)
    last = torch.randn(5, 4).to(torch.bfloat16)
    sample = make_sample([1, 2, 3, 4, 5], [0, 1, 1, 1, 1], hidden, 8, last_hidden_states=last)
    names = [tensor.name for tensor in sample.tensors]
    assert names == ["input_ids", "loss_mask", "hidden_states", "last_hidden_states"]
    assert list(sample.tensors[3].shape) == [5, 4]
    assert sample.tensors[3].dtype == pb.DTYPE_BF16
    assert make_sample([1, 2], [1, 1], hidden[:2], 8).tensors[-1].name == "hidden_states"
    with pytest.raises(InvalidSample, match="'last_hidden_states': 4 rows, expected 5"):
        make_sample([1, 2, 3, 4, 5], [0, 1, 1, 1, 1], hidden, 8, last_hidden_states=last[:4])
