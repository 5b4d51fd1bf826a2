"""Samples on the wire: validating and encoding what a producer sends, and
zero-copy views of what a consumer receives.

The rules are those of `proto/src/tensor.rs` (the broker applies the same):
a tensor has a name, a known dtype and exactly product(shape) × element-size
little-endian bytes. A DFlash sample holds `input_ids` int32 [T], `loss_mask`
uint8 [T] and `hidden_states` bf16 [T, n_layers × hidden]; for a DSpark run
also `last_hidden_states` bf16 [T, hidden] (the target's last hidden state
after its final norm, the LM head's input).

numpy has no bfloat16: bf16 goes in as a torch tensor, an ml_dtypes
bfloat16 array, raw little-endian bytes, or float32 through
`float32_to_bf16_bytes`; it comes out as a torch tensor or as the raw uint16
bit patterns in numpy. Nothing here imports torch unless a torch tensor is
given or asked for.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import numpy as np

from ._proto import broker_pb2 as pb
from .errors import InvalidSample, ProtocolError

INPUT_IDS = "input_ids"
LOSS_MASK = "loss_mask"
HIDDEN_STATES = "hidden_states"
LAST_HIDDEN_STATES = "last_hidden_states"

#: Wire dtype → (short name as the Rust side prints it, element bytes, numpy dtype of a view).
DTYPES: Dict[int, Tuple[str, int, Any]] = {
    pb.DTYPE_BF16: ("bf16", 2, np.dtype("<u2")),
    pb.DTYPE_F16: ("f16", 2, np.dtype("<f2")),
    pb.DTYPE_F32: ("f32", 4, np.dtype("<f4")),
    pb.DTYPE_I32: ("int32", 4, np.dtype("<i4")),
    pb.DTYPE_I64: ("int64", 8, np.dtype("<i8")),
    pb.DTYPE_U8: ("uint8", 1, np.dtype("u1")),
    pb.DTYPE_BOOL: ("bool", 1, np.dtype("?")),
}

_INT32_MAX = 2**31 - 1
_LITTLE_ENDIAN = sys.byteorder == "little"


def _is_torch_tensor(value: Any) -> bool:
    module = type(value).__module__
    return module.startswith("torch") and hasattr(value, "detach")


def _describe(value: Any) -> str:
    if _is_torch_tensor(value):
        return f"torch tensor {str(value.dtype).replace('torch.', '')} {list(value.shape)}"
    if isinstance(value, np.ndarray):
        return f"numpy array {value.dtype} {list(value.shape)}"
    return type(value).__name__


def float32_to_bf16_bytes(array: Any) -> bytes:
    """float32 values → little-endian bf16 bytes, rounding to nearest even
    (what torch's `.to(torch.bfloat16)` does), for numpy users without torch.
    NaN stays NaN."""
    values = np.ascontiguousarray(np.asarray(array, dtype=np.float32))
    bits = values.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = np.isnan(values)
    result = rounded.astype(np.uint16)
    result[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)
    return result.astype("<u2").tobytes()


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) → float32 values (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def _integer_tokens(name: str, value: Any) -> np.ndarray:
    """Any integer array or tensor → int32 numpy [T], values in [0, 2^31)."""
    if _is_torch_tensor(value):
        if value.is_floating_point() or value.is_complex():
            raise InvalidSample(f"tensor {name!r}: {_describe(value)}, expected integer token ids")
        value = value.detach().to("cpu").numpy()
    if isinstance(value, (list, tuple)):
        value = np.asarray(value)
    if not isinstance(value, np.ndarray):
        raise InvalidSample(f"tensor {name!r}: {_describe(value)}, expected a numpy array or torch tensor")
    if value.dtype == np.bool_ or not np.issubdtype(value.dtype, np.integer):
        raise InvalidSample(f"tensor {name!r}: {_describe(value)}, expected integer token ids")
    if value.ndim != 1 or value.shape[0] == 0:
        raise InvalidSample(f"tensor {name!r}: shape {list(value.shape)}, expected [T] with T >= 1")
    low, high = int(value.min()), int(value.max())
    if low < 0 or high > _INT32_MAX:
        bad = low if low < 0 else high
        raise InvalidSample(f"tensor {name!r}: token id {bad} is outside [0, {_INT32_MAX}]")
    return np.ascontiguousarray(value, dtype="<i4")


def _mask(name: str, value: Any, length: int) -> np.ndarray:
    """A 0/1 (or bool) array or tensor of length T → uint8 numpy [T]."""
    if _is_torch_tensor(value):
        if value.is_floating_point() or value.is_complex():
            raise InvalidSample(f"tensor {name!r}: {_describe(value)}, expected 0/1 integers or bool")
        value = value.detach().to("cpu").numpy()
    if isinstance(value, (list, tuple)):
        value = np.asarray(value)
    if not isinstance(value, np.ndarray):
        raise InvalidSample(f"tensor {name!r}: {_describe(value)}, expected a numpy array or torch tensor")
    if not (value.dtype == np.bool_ or np.issubdtype(value.dtype, np.integer)):
        raise InvalidSample(f"tensor {name!r}: {_describe(value)}, expected 0/1 integers or bool")
    if value.shape != (length,):
        raise InvalidSample(f"tensor {name!r}: shape {list(value.shape)}, expected [{length}] like input_ids")
    if value.dtype != np.bool_:
        outside = value[(value != 0) & (value != 1)]
        if outside.size:
            raise InvalidSample(f"tensor {name!r}: value {int(outside[0])} is not 0 or 1")
    return np.ascontiguousarray(value, dtype=np.uint8)


def _bf16_bytes(name: str, value: Any, length: int, width: Optional[int]) -> Tuple[bytes, int]:
    """bf16 hidden states [T, W] → (little-endian bytes, W)."""
    if _is_torch_tensor(value):
        import torch

        if value.dtype != torch.bfloat16:
            raise InvalidSample(
                f"tensor {name!r}: {_describe(value)}, expected bfloat16 (use .to(torch.bfloat16))"
            )
        if value.dim() != 2:
            raise InvalidSample(f"tensor {name!r}: shape {list(value.shape)}, expected [T, width]")
        rows, columns = int(value.shape[0]), int(value.shape[1])
        data = value.detach().to("cpu").contiguous().view(torch.int16).numpy()
        raw = data.astype("<i2", copy=False).tobytes()
    elif isinstance(value, np.ndarray):
        if value.dtype.name != "bfloat16":
            raise InvalidSample(
                f"tensor {name!r}: {_describe(value)}, expected bfloat16 "
                "(a torch bf16 tensor, an ml_dtypes bfloat16 array, raw bytes, "
                "or float32 through float32_to_bf16_bytes)"
            )
        if value.ndim != 2:
            raise InvalidSample(f"tensor {name!r}: shape {list(value.shape)}, expected [T, width]")
        rows, columns = value.shape
        raw = np.ascontiguousarray(value).view(np.uint16).astype("<u2", copy=False).tobytes()
    elif isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        if length == 0 or len(raw) % (2 * length) != 0 or len(raw) == 0:
            raise InvalidSample(
                f"tensor {name!r}: {len(raw)} bytes is not a whole number of bf16 rows for T={length}"
            )
        rows, columns = length, len(raw) // (2 * length)
    else:
        raise InvalidSample(f"tensor {name!r}: {_describe(value)}, expected bf16 [T, width]")
    if rows != length:
        raise InvalidSample(f"tensor {name!r}: {rows} rows, expected {length} (one per token of input_ids)")
    if columns == 0:
        raise InvalidSample(f"tensor {name!r}: width 0, expected at least 1")
    if width is not None and columns != width:
        raise InvalidSample(f"tensor {name!r}: width {columns}, expected {width}")
    return raw, columns


def make_sample(
    input_ids: Any,
    loss_mask: Any,
    hidden_states: Any,
    hidden_width: Optional[int] = None,
    last_hidden_states: Any = None,
) -> pb.Sample:
    """Validates one DFlash sample and encodes it; raises InvalidSample.
    `last_hidden_states` (bf16 [T, hidden], optional) is what a DSpark
    drafter distils the target's distribution from."""
    ids = _integer_tokens(INPUT_IDS, input_ids)
    length = int(ids.shape[0])
    mask = _mask(LOSS_MASK, loss_mask, length)
    hidden, width = _bf16_bytes(HIDDEN_STATES, hidden_states, length, hidden_width)
    tensors = [
        pb.Tensor(name=INPUT_IDS, dtype=pb.DTYPE_I32, shape=[length], data=ids.tobytes()),
        pb.Tensor(name=LOSS_MASK, dtype=pb.DTYPE_U8, shape=[length], data=mask.tobytes()),
        pb.Tensor(name=HIDDEN_STATES, dtype=pb.DTYPE_BF16, shape=[length, width], data=hidden),
    ]
    if last_hidden_states is not None:
        last, last_width = _bf16_bytes(LAST_HIDDEN_STATES, last_hidden_states, length, None)
        tensors.append(
            pb.Tensor(name=LAST_HIDDEN_STATES, dtype=pb.DTYPE_BF16, shape=[length, last_width], data=last)
        )
    sample = pb.Sample(tensors=tensors)
    validate_sample(sample, error=InvalidSample)
    return sample


def validate_tensor(tensor: pb.Tensor, error: type = ProtocolError) -> None:
    """The byte-length rule of proto/src/tensor.rs."""
    if not tensor.name:
        raise error("tensor name is empty")
    if tensor.dtype not in DTYPES:
        raise error(f"tensor {tensor.name!r}: dtype {tensor.dtype} is not a known element type")
    short_name, element_size, _ = DTYPES[tensor.dtype]
    count = 1
    for dimension in tensor.shape:
        count *= int(dimension)
    expected = count * element_size
    if expected >= 2**64:
        raise error(f"tensor {tensor.name!r}: shape {list(tensor.shape)} overflows the element count")
    if len(tensor.data) != expected:
        raise error(
            f"tensor {tensor.name!r}: {len(tensor.data)} bytes, expected {expected} "
            f"for {short_name} {list(tensor.shape)}"
        )


def validate_sample(sample: pb.Sample, error: type = ProtocolError) -> None:
    if not sample.tensors:
        raise error("sample has no tensors")
    seen = set()
    for tensor in sample.tensors:
        validate_tensor(tensor, error)
        if tensor.name in seen:
            raise error(f"sample has two tensors named {tensor.name!r}")
        seen.add(tensor.name)


@dataclasses.dataclass(frozen=True)
class WireTensor:
    """One received tensor: its bytes as the broker delivered them."""

    name: str
    dtype: str
    shape: Tuple[int, ...]
    data: bytes

    def numpy(self) -> np.ndarray:
        """A read-only zero-copy view; bf16 comes out as uint16 bit patterns
        (see `bf16_bits_to_float32`)."""
        view_dtype = _VIEW_DTYPES[self.dtype]
        array = np.frombuffer(self.data, dtype=view_dtype)
        if not _LITTLE_ENDIAN:
            array = array.byteswap()
        return array.reshape(self.shape)

    def torch(self) -> Any:
        """A zero-copy torch view of the received bytes (bf16 as
        torch.bfloat16). Treat it as read-only: `.clone()` before writing."""
        import torch

        torch_dtype = {
            "bf16": torch.bfloat16,
            "f16": torch.float16,
            "f32": torch.float32,
            "int32": torch.int32,
            "int64": torch.int64,
            "uint8": torch.uint8,
            "bool": torch.bool,
        }[self.dtype]
        if len(self.data) == 0:
            return torch.empty(self.shape, dtype=torch_dtype)
        with warnings.catch_warnings():
            # The bytes object is immutable; torch warns that the tensor is not.
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(self.data, dtype=torch_dtype)
        return flat.reshape(self.shape)


_VIEW_DTYPES = {short: view for short, _, view in DTYPES.values()}


def received_tensors(sample: pb.Sample) -> Dict[str, WireTensor]:
    """Validates a received sample and names its tensors; ProtocolError when
    the broker sent bytes that do not match a shape."""
    validate_sample(sample, error=ProtocolError)
    return {
        tensor.name: WireTensor(
            name=tensor.name,
            dtype=DTYPES[tensor.dtype][0],
            shape=tuple(int(dimension) for dimension in tensor.shape),
            data=tensor.data,
        )
        for tensor in sample.tensors
    }


def check_trace_context(trace_context: Optional[Mapping[str, str]]) -> Dict[str, str]:
    if trace_context is None:
        return {}
    if not isinstance(trace_context, Mapping):
        raise InvalidSample(f"trace_context: {type(trace_context).__name__}, expected a dict of str to str")
    for key, value in trace_context.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise InvalidSample(f"trace_context entry {key!r}: {value!r} is not str to str")
    return dict(trace_context)


__all__: Sequence[str] = [
    "INPUT_IDS",
    "LOSS_MASK",
    "HIDDEN_STATES",
    "WireTensor",
    "make_sample",
    "float32_to_bf16_bytes",
    "bf16_bits_to_float32",
]
