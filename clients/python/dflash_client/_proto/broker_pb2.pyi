from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Dtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[Dtype]
    DTYPE_BF16: _ClassVar[Dtype]
    DTYPE_F16: _ClassVar[Dtype]
    DTYPE_F32: _ClassVar[Dtype]
    DTYPE_I32: _ClassVar[Dtype]
    DTYPE_I64: _ClassVar[Dtype]
    DTYPE_U8: _ClassVar[Dtype]
    DTYPE_BOOL: _ClassVar[Dtype]

class CapturedTensor(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CAPTURED_TENSOR_UNSPECIFIED: _ClassVar[CapturedTensor]
    CAPTURED_TENSOR_LAST_HIDDEN_STATES: _ClassVar[CapturedTensor]

class NackDisposition(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NACK_DISPOSITION_REQUEUE: _ClassVar[NackDisposition]
    NACK_DISPOSITION_DEAD_LETTER: _ClassVar[NackDisposition]

class RunStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUN_STATUS_UNSPECIFIED: _ClassVar[RunStatus]
    RUN_STATUS_COMPLETE: _ClassVar[RunStatus]
    RUN_STATUS_ABORTED: _ClassVar[RunStatus]

class BrokerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BROKER_STATE_UNSPECIFIED: _ClassVar[BrokerState]
    BROKER_STATE_RUNNING: _ClassVar[BrokerState]
    BROKER_STATE_DRAINING: _ClassVar[BrokerState]
    BROKER_STATE_COMPLETE: _ClassVar[BrokerState]
    BROKER_STATE_ABORTED: _ClassVar[BrokerState]

class TargetState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TARGET_STATE_UNSPECIFIED: _ClassVar[TargetState]
    TARGET_STATE_CONNECTED: _ClassVar[TargetState]
    TARGET_STATE_DISCONNECTED: _ClassVar[TargetState]
    TARGET_STATE_DONE: _ClassVar[TargetState]
    TARGET_STATE_FAILED: _ClassVar[TargetState]
DTYPE_UNSPECIFIED: Dtype
DTYPE_BF16: Dtype
DTYPE_F16: Dtype
DTYPE_F32: Dtype
DTYPE_I32: Dtype
DTYPE_I64: Dtype
DTYPE_U8: Dtype
DTYPE_BOOL: Dtype
CAPTURED_TENSOR_UNSPECIFIED: CapturedTensor
CAPTURED_TENSOR_LAST_HIDDEN_STATES: CapturedTensor
NACK_DISPOSITION_REQUEUE: NackDisposition
NACK_DISPOSITION_DEAD_LETTER: NackDisposition
RUN_STATUS_UNSPECIFIED: RunStatus
RUN_STATUS_COMPLETE: RunStatus
RUN_STATUS_ABORTED: RunStatus
BROKER_STATE_UNSPECIFIED: BrokerState
BROKER_STATE_RUNNING: BrokerState
BROKER_STATE_DRAINING: BrokerState
BROKER_STATE_COMPLETE: BrokerState
BROKER_STATE_ABORTED: BrokerState
TARGET_STATE_UNSPECIFIED: TargetState
TARGET_STATE_CONNECTED: TargetState
TARGET_STATE_DISCONNECTED: TargetState
TARGET_STATE_DONE: TargetState
TARGET_STATE_FAILED: TargetState

class Tensor(_message.Message):
    __slots__ = ("name", "dtype", "shape", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: Dtype
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[Dtype, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("tensors",)
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[Tensor]
    def __init__(self, tensors: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ...) -> None: ...

class ProduceRequest(_message.Message):
    __slots__ = ("hello", "item", "stats")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    ITEM_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    hello: ProducerHello
    item: Item
    stats: ProducerStats
    def __init__(self, hello: _Optional[_Union[ProducerHello, _Mapping]] = ..., item: _Optional[_Union[Item, _Mapping]] = ..., stats: _Optional[_Union[ProducerStats, _Mapping]] = ...) -> None: ...

class ProducerHello(_message.Message):
    __slots__ = ("target_id", "run_id")
    TARGET_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    target_id: str
    run_id: str
    def __init__(self, target_id: _Optional[str] = ..., run_id: _Optional[str] = ...) -> None: ...

class Item(_message.Message):
    __slots__ = ("seq", "sample", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    seq: int
    sample: Sample
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, seq: _Optional[int] = ..., sample: _Optional[_Union[Sample, _Mapping]] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ProducerStats(_message.Message):
    __slots__ = ("tokens_per_second", "busy_fraction", "device", "samples_done", "samples_total", "tokens_done", "trace_export")
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    BUSY_FRACTION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_DONE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_DONE_FIELD_NUMBER: _ClassVar[int]
    TRACE_EXPORT_FIELD_NUMBER: _ClassVar[int]
    tokens_per_second: float
    busy_fraction: float
    device: str
    samples_done: int
    samples_total: int
    tokens_done: int
    trace_export: TraceExportStats
    def __init__(self, tokens_per_second: _Optional[float] = ..., busy_fraction: _Optional[float] = ..., device: _Optional[str] = ..., samples_done: _Optional[int] = ..., samples_total: _Optional[int] = ..., tokens_done: _Optional[int] = ..., trace_export: _Optional[_Union[TraceExportStats, _Mapping]] = ...) -> None: ...

class TraceExportStats(_message.Message):
    __slots__ = ("exported_spans", "dropped_spans", "failed_spans", "failing")
    EXPORTED_SPANS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_SPANS_FIELD_NUMBER: _ClassVar[int]
    FAILED_SPANS_FIELD_NUMBER: _ClassVar[int]
    FAILING_FIELD_NUMBER: _ClassVar[int]
    exported_spans: int
    dropped_spans: int
    failed_spans: int
    failing: bool
    def __init__(self, exported_spans: _Optional[int] = ..., dropped_spans: _Optional[int] = ..., failed_spans: _Optional[int] = ..., failing: _Optional[bool] = ...) -> None: ...

class ProduceResponse(_message.Message):
    __slots__ = ("welcome", "accepted", "rejected", "closed")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    welcome: ProducerWelcome
    accepted: ItemAccepted
    rejected: ItemRejected
    closed: StreamClosed
    def __init__(self, welcome: _Optional[_Union[ProducerWelcome, _Mapping]] = ..., accepted: _Optional[_Union[ItemAccepted, _Mapping]] = ..., rejected: _Optional[_Union[ItemRejected, _Mapping]] = ..., closed: _Optional[_Union[StreamClosed, _Mapping]] = ...) -> None: ...

class ProducerWelcome(_message.Message):
    __slots__ = ("resume_after_seq", "accepted_items", "epoch", "run_id", "capture")
    RESUME_AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_ITEMS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_FIELD_NUMBER: _ClassVar[int]
    resume_after_seq: int
    accepted_items: int
    epoch: int
    run_id: str
    capture: _containers.RepeatedScalarFieldContainer[CapturedTensor]
    def __init__(self, resume_after_seq: _Optional[int] = ..., accepted_items: _Optional[int] = ..., epoch: _Optional[int] = ..., run_id: _Optional[str] = ..., capture: _Optional[_Iterable[_Union[CapturedTensor, str]]] = ...) -> None: ...

class ItemAccepted(_message.Message):
    __slots__ = ("seq", "duplicate")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    seq: int
    duplicate: bool
    def __init__(self, seq: _Optional[int] = ..., duplicate: _Optional[bool] = ...) -> None: ...

class ItemRejected(_message.Message):
    __slots__ = ("seq", "reason")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    seq: int
    reason: str
    def __init__(self, seq: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class StreamClosed(_message.Message):
    __slots__ = ("status", "reason")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    status: RunStatus
    reason: str
    def __init__(self, status: _Optional[_Union[RunStatus, str]] = ..., reason: _Optional[str] = ...) -> None: ...

class ReportDoneRequest(_message.Message):
    __slots__ = ("target_id", "total_items", "epoch", "run_id")
    TARGET_ID_FIELD_NUMBER: _ClassVar[int]
    TOTAL_ITEMS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    target_id: str
    total_items: int
    epoch: int
    run_id: str
    def __init__(self, target_id: _Optional[str] = ..., total_items: _Optional[int] = ..., epoch: _Optional[int] = ..., run_id: _Optional[str] = ...) -> None: ...

class ReportDoneResponse(_message.Message):
    __slots__ = ("done_targets", "expected_targets", "already_done")
    DONE_TARGETS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_TARGETS_FIELD_NUMBER: _ClassVar[int]
    ALREADY_DONE_FIELD_NUMBER: _ClassVar[int]
    done_targets: int
    expected_targets: int
    already_done: bool
    def __init__(self, done_targets: _Optional[int] = ..., expected_targets: _Optional[int] = ..., already_done: _Optional[bool] = ...) -> None: ...

class ConsumeRequest(_message.Message):
    __slots__ = ("hello", "credit", "ack", "nack", "stats", "extend_leases")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    CREDIT_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    NACK_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    EXTEND_LEASES_FIELD_NUMBER: _ClassVar[int]
    hello: ConsumerHello
    credit: Credit
    ack: Ack
    nack: Nack
    stats: ConsumerStats
    extend_leases: ExtendLeases
    def __init__(self, hello: _Optional[_Union[ConsumerHello, _Mapping]] = ..., credit: _Optional[_Union[Credit, _Mapping]] = ..., ack: _Optional[_Union[Ack, _Mapping]] = ..., nack: _Optional[_Union[Nack, _Mapping]] = ..., stats: _Optional[_Union[ConsumerStats, _Mapping]] = ..., extend_leases: _Optional[_Union[ExtendLeases, _Mapping]] = ...) -> None: ...

class ConsumerHello(_message.Message):
    __slots__ = ("drafter_id", "credit", "run_id")
    DRAFTER_ID_FIELD_NUMBER: _ClassVar[int]
    CREDIT_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    drafter_id: str
    credit: Credit
    run_id: str
    def __init__(self, drafter_id: _Optional[str] = ..., credit: _Optional[_Union[Credit, _Mapping]] = ..., run_id: _Optional[str] = ...) -> None: ...

class Credit(_message.Message):
    __slots__ = ("items", "bytes")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    items: int
    bytes: int
    def __init__(self, items: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("delivery_ids",)
    DELIVERY_IDS_FIELD_NUMBER: _ClassVar[int]
    delivery_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, delivery_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Nack(_message.Message):
    __slots__ = ("delivery_ids", "reason", "disposition")
    DELIVERY_IDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DISPOSITION_FIELD_NUMBER: _ClassVar[int]
    delivery_ids: _containers.RepeatedScalarFieldContainer[int]
    reason: str
    disposition: NackDisposition
    def __init__(self, delivery_ids: _Optional[_Iterable[int]] = ..., reason: _Optional[str] = ..., disposition: _Optional[_Union[NackDisposition, str]] = ...) -> None: ...

class ExtendLeases(_message.Message):
    __slots__ = ("delivery_ids",)
    DELIVERY_IDS_FIELD_NUMBER: _ClassVar[int]
    delivery_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, delivery_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ConsumerStats(_message.Message):
    __slots__ = ("tokens_per_second", "loss", "busy_fraction", "device", "steps", "samples_trained", "accuracy", "skipped_steps", "non_finite_samples", "trace_export")
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    BUSY_FRACTION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_TRAINED_FIELD_NUMBER: _ClassVar[int]
    ACCURACY_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_STEPS_FIELD_NUMBER: _ClassVar[int]
    NON_FINITE_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TRACE_EXPORT_FIELD_NUMBER: _ClassVar[int]
    tokens_per_second: float
    loss: float
    busy_fraction: float
    device: str
    steps: int
    samples_trained: int
    accuracy: float
    skipped_steps: int
    non_finite_samples: int
    trace_export: TraceExportStats
    def __init__(self, tokens_per_second: _Optional[float] = ..., loss: _Optional[float] = ..., busy_fraction: _Optional[float] = ..., device: _Optional[str] = ..., steps: _Optional[int] = ..., samples_trained: _Optional[int] = ..., accuracy: _Optional[float] = ..., skipped_steps: _Optional[int] = ..., non_finite_samples: _Optional[int] = ..., trace_export: _Optional[_Union[TraceExportStats, _Mapping]] = ...) -> None: ...

class ConsumeResponse(_message.Message):
    __slots__ = ("welcome", "delivery", "end_of_stream")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    DELIVERY_FIELD_NUMBER: _ClassVar[int]
    END_OF_STREAM_FIELD_NUMBER: _ClassVar[int]
    welcome: ConsumerWelcome
    delivery: Delivery
    end_of_stream: EndOfStream
    def __init__(self, welcome: _Optional[_Union[ConsumerWelcome, _Mapping]] = ..., delivery: _Optional[_Union[Delivery, _Mapping]] = ..., end_of_stream: _Optional[_Union[EndOfStream, _Mapping]] = ...) -> None: ...

class ConsumerWelcome(_message.Message):
    __slots__ = ("summary", "lease_timeout_ms", "run_id")
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    LEASE_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    summary: RunSummary
    lease_timeout_ms: int
    run_id: str
    def __init__(self, summary: _Optional[_Union[RunSummary, _Mapping]] = ..., lease_timeout_ms: _Optional[int] = ..., run_id: _Optional[str] = ...) -> None: ...

class Delivery(_message.Message):
    __slots__ = ("delivery_id", "target_id", "seq", "sample", "delivery_count", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    DELIVERY_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    DELIVERY_COUNT_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    delivery_id: int
    target_id: str
    seq: int
    sample: Sample
    delivery_count: int
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, delivery_id: _Optional[int] = ..., target_id: _Optional[str] = ..., seq: _Optional[int] = ..., sample: _Optional[_Union[Sample, _Mapping]] = ..., delivery_count: _Optional[int] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class EndOfStream(_message.Message):
    __slots__ = ("status", "reason", "summary")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    status: RunStatus
    reason: str
    summary: RunSummary
    def __init__(self, status: _Optional[_Union[RunStatus, str]] = ..., reason: _Optional[str] = ..., summary: _Optional[_Union[RunSummary, _Mapping]] = ...) -> None: ...

class RunSummary(_message.Message):
    __slots__ = ("expected_targets", "done_targets", "failed_targets", "accepted_items", "accepted_bytes", "acked_items", "dead_letters", "expected_items")
    EXPECTED_TARGETS_FIELD_NUMBER: _ClassVar[int]
    DONE_TARGETS_FIELD_NUMBER: _ClassVar[int]
    FAILED_TARGETS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_ITEMS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACKED_ITEMS_FIELD_NUMBER: _ClassVar[int]
    DEAD_LETTERS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_ITEMS_FIELD_NUMBER: _ClassVar[int]
    expected_targets: int
    done_targets: int
    failed_targets: _containers.RepeatedScalarFieldContainer[str]
    accepted_items: int
    accepted_bytes: int
    acked_items: int
    dead_letters: int
    expected_items: int
    def __init__(self, expected_targets: _Optional[int] = ..., done_targets: _Optional[int] = ..., failed_targets: _Optional[_Iterable[str]] = ..., accepted_items: _Optional[int] = ..., accepted_bytes: _Optional[int] = ..., acked_items: _Optional[int] = ..., dead_letters: _Optional[int] = ..., expected_items: _Optional[int] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchStatusRequest(_message.Message):
    __slots__ = ("interval_ms",)
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    interval_ms: int
    def __init__(self, interval_ms: _Optional[int] = ...) -> None: ...

class TargetStatus(_message.Message):
    __slots__ = ("target_id", "state", "accepted_items", "accepted_bytes", "rejected_items", "duplicate_items", "last_seen_ms_ago", "stats", "failure_reason", "highest_seq")
    TARGET_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_ITEMS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    REJECTED_ITEMS_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_ITEMS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_MS_AGO_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    FAILURE_REASON_FIELD_NUMBER: _ClassVar[int]
    HIGHEST_SEQ_FIELD_NUMBER: _ClassVar[int]
    target_id: str
    state: TargetState
    accepted_items: int
    accepted_bytes: int
    rejected_items: int
    duplicate_items: int
    last_seen_ms_ago: int
    stats: ProducerStats
    failure_reason: str
    highest_seq: int
    def __init__(self, target_id: _Optional[str] = ..., state: _Optional[_Union[TargetState, str]] = ..., accepted_items: _Optional[int] = ..., accepted_bytes: _Optional[int] = ..., rejected_items: _Optional[int] = ..., duplicate_items: _Optional[int] = ..., last_seen_ms_ago: _Optional[int] = ..., stats: _Optional[_Union[ProducerStats, _Mapping]] = ..., failure_reason: _Optional[str] = ..., highest_seq: _Optional[int] = ...) -> None: ...

class DrafterStatus(_message.Message):
    __slots__ = ("drafter_id", "connected", "leased_items", "delivered_items", "acked_items", "nacked_items", "expired_leases", "last_seen_ms_ago", "stats", "credit", "leased_bytes")
    DRAFTER_ID_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    LEASED_ITEMS_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_ITEMS_FIELD_NUMBER: _ClassVar[int]
    ACKED_ITEMS_FIELD_NUMBER: _ClassVar[int]
    NACKED_ITEMS_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_LEASES_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_MS_AGO_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    CREDIT_FIELD_NUMBER: _ClassVar[int]
    LEASED_BYTES_FIELD_NUMBER: _ClassVar[int]
    drafter_id: str
    connected: bool
    leased_items: int
    delivered_items: int
    acked_items: int
    nacked_items: int
    expired_leases: int
    last_seen_ms_ago: int
    stats: ConsumerStats
    credit: Credit
    leased_bytes: int
    def __init__(self, drafter_id: _Optional[str] = ..., connected: _Optional[bool] = ..., leased_items: _Optional[int] = ..., delivered_items: _Optional[int] = ..., acked_items: _Optional[int] = ..., nacked_items: _Optional[int] = ..., expired_leases: _Optional[int] = ..., last_seen_ms_ago: _Optional[int] = ..., stats: _Optional[_Union[ConsumerStats, _Mapping]] = ..., credit: _Optional[_Union[Credit, _Mapping]] = ..., leased_bytes: _Optional[int] = ...) -> None: ...

class DeadLetter(_message.Message):
    __slots__ = ("target_id", "seq", "deliveries", "reason", "bytes")
    TARGET_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    DELIVERIES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    target_id: str
    seq: int
    deliveries: int
    reason: str
    bytes: int
    def __init__(self, target_id: _Optional[str] = ..., seq: _Optional[int] = ..., deliveries: _Optional[int] = ..., reason: _Optional[str] = ..., bytes: _Optional[int] = ...) -> None: ...

class StatusSnapshot(_message.Message):
    __slots__ = ("state", "expected_targets", "done_targets", "queued_items", "queued_bytes", "leased_items", "dead_letters", "targets", "drafters", "accepted_items", "accepted_bytes", "delivered_items", "acked_items", "redelivered_items", "rejected_items", "items_per_second", "bytes_per_second", "leased_bytes", "max_queue_bytes", "abort_reason", "dead_letter_items", "uptime_ms", "summary", "accepted_items_per_second", "accepted_bytes_per_second", "run_id", "model_sync", "trace_export", "lighthouse")
    STATE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_TARGETS_FIELD_NUMBER: _ClassVar[int]
    DONE_TARGETS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_ITEMS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASED_ITEMS_FIELD_NUMBER: _ClassVar[int]
    DEAD_LETTERS_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_ITEMS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_ITEMS_FIELD_NUMBER: _ClassVar[int]
    ACKED_ITEMS_FIELD_NUMBER: _ClassVar[int]
    REDELIVERED_ITEMS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_ITEMS_FIELD_NUMBER: _ClassVar[int]
    ITEMS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    LEASED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ABORT_REASON_FIELD_NUMBER: _ClassVar[int]
    DEAD_LETTER_ITEMS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_MS_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_ITEMS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_BYTES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_SYNC_FIELD_NUMBER: _ClassVar[int]
    TRACE_EXPORT_FIELD_NUMBER: _ClassVar[int]
    LIGHTHOUSE_FIELD_NUMBER: _ClassVar[int]
    state: BrokerState
    expected_targets: int
    done_targets: int
    queued_items: int
    queued_bytes: int
    leased_items: int
    dead_letters: int
    targets: _containers.RepeatedCompositeFieldContainer[TargetStatus]
    drafters: _containers.RepeatedCompositeFieldContainer[DrafterStatus]
    accepted_items: int
    accepted_bytes: int
    delivered_items: int
    acked_items: int
    redelivered_items: int
    rejected_items: int
    items_per_second: float
    bytes_per_second: float
    leased_bytes: int
    max_queue_bytes: int
    abort_reason: str
    dead_letter_items: _containers.RepeatedCompositeFieldContainer[DeadLetter]
    uptime_ms: int
    summary: RunSummary
    accepted_items_per_second: float
    accepted_bytes_per_second: float
    run_id: str
    model_sync: ModelSyncStatus
    trace_export: TraceExportStats
    lighthouse: LighthouseStatus
    def __init__(self, state: _Optional[_Union[BrokerState, str]] = ..., expected_targets: _Optional[int] = ..., done_targets: _Optional[int] = ..., queued_items: _Optional[int] = ..., queued_bytes: _Optional[int] = ..., leased_items: _Optional[int] = ..., dead_letters: _Optional[int] = ..., targets: _Optional[_Iterable[_Union[TargetStatus, _Mapping]]] = ..., drafters: _Optional[_Iterable[_Union[DrafterStatus, _Mapping]]] = ..., accepted_items: _Optional[int] = ..., accepted_bytes: _Optional[int] = ..., delivered_items: _Optional[int] = ..., acked_items: _Optional[int] = ..., redelivered_items: _Optional[int] = ..., rejected_items: _Optional[int] = ..., items_per_second: _Optional[float] = ..., bytes_per_second: _Optional[float] = ..., leased_bytes: _Optional[int] = ..., max_queue_bytes: _Optional[int] = ..., abort_reason: _Optional[str] = ..., dead_letter_items: _Optional[_Iterable[_Union[DeadLetter, _Mapping]]] = ..., uptime_ms: _Optional[int] = ..., summary: _Optional[_Union[RunSummary, _Mapping]] = ..., accepted_items_per_second: _Optional[float] = ..., accepted_bytes_per_second: _Optional[float] = ..., run_id: _Optional[str] = ..., model_sync: _Optional[_Union[ModelSyncStatus, _Mapping]] = ..., trace_export: _Optional[_Union[TraceExportStats, _Mapping]] = ..., lighthouse: _Optional[_Union[LighthouseStatus, _Mapping]] = ...) -> None: ...

class DrafterSyncStatus(_message.Message):
    __slots__ = ("drafter_id", "connected", "last_sync_ms_ago", "finished")
    DRAFTER_ID_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    LAST_SYNC_MS_AGO_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    drafter_id: str
    connected: bool
    last_sync_ms_ago: int
    finished: bool
    def __init__(self, drafter_id: _Optional[str] = ..., connected: _Optional[bool] = ..., last_sync_ms_ago: _Optional[int] = ..., finished: _Optional[bool] = ...) -> None: ...

class ModelSyncStatus(_message.Message):
    __slots__ = ("has_model", "model_version", "model_bytes", "parameters", "model_samples", "saved_version", "saved_path", "final_saved", "drafters", "tau_history", "best_tau", "best_path", "best_saved_version", "evaluations_pending", "max_pending_evaluations")
    HAS_MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_BYTES_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    MODEL_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SAVED_VERSION_FIELD_NUMBER: _ClassVar[int]
    SAVED_PATH_FIELD_NUMBER: _ClassVar[int]
    FINAL_SAVED_FIELD_NUMBER: _ClassVar[int]
    DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    TAU_HISTORY_FIELD_NUMBER: _ClassVar[int]
    BEST_TAU_FIELD_NUMBER: _ClassVar[int]
    BEST_PATH_FIELD_NUMBER: _ClassVar[int]
    BEST_SAVED_VERSION_FIELD_NUMBER: _ClassVar[int]
    EVALUATIONS_PENDING_FIELD_NUMBER: _ClassVar[int]
    MAX_PENDING_EVALUATIONS_FIELD_NUMBER: _ClassVar[int]
    has_model: bool
    model_version: int
    model_bytes: int
    parameters: int
    model_samples: int
    saved_version: int
    saved_path: str
    final_saved: bool
    drafters: _containers.RepeatedCompositeFieldContainer[DrafterSyncStatus]
    tau_history: _containers.RepeatedCompositeFieldContainer[TauPoint]
    best_tau: TauPoint
    best_path: str
    best_saved_version: int
    evaluations_pending: _containers.RepeatedScalarFieldContainer[int]
    max_pending_evaluations: int
    def __init__(self, has_model: _Optional[bool] = ..., model_version: _Optional[int] = ..., model_bytes: _Optional[int] = ..., parameters: _Optional[int] = ..., model_samples: _Optional[int] = ..., saved_version: _Optional[int] = ..., saved_path: _Optional[str] = ..., final_saved: _Optional[bool] = ..., drafters: _Optional[_Iterable[_Union[DrafterSyncStatus, _Mapping]]] = ..., tau_history: _Optional[_Iterable[_Union[TauPoint, _Mapping]]] = ..., best_tau: _Optional[_Union[TauPoint, _Mapping]] = ..., best_path: _Optional[str] = ..., best_saved_version: _Optional[int] = ..., evaluations_pending: _Optional[_Iterable[int]] = ..., max_pending_evaluations: _Optional[int] = ...) -> None: ...

class LighthouseStatus(_message.Message):
    __slots__ = ("quorum_id", "step", "members", "quorums_formed", "steps_committed", "steps_failed", "heals", "checksum_mismatches", "members_dropped", "committed_step", "committed_by_quorum", "splits", "unknown_decisions", "rollbacks", "steps_rolled_back", "waiting_for_holder")
    QUORUM_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    QUORUMS_FORMED_FIELD_NUMBER: _ClassVar[int]
    STEPS_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    STEPS_FAILED_FIELD_NUMBER: _ClassVar[int]
    HEALS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_MISMATCHES_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_STEP_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_BY_QUORUM_FIELD_NUMBER: _ClassVar[int]
    SPLITS_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_DECISIONS_FIELD_NUMBER: _ClassVar[int]
    ROLLBACKS_FIELD_NUMBER: _ClassVar[int]
    STEPS_ROLLED_BACK_FIELD_NUMBER: _ClassVar[int]
    WAITING_FOR_HOLDER_FIELD_NUMBER: _ClassVar[int]
    quorum_id: int
    step: int
    members: _containers.RepeatedScalarFieldContainer[str]
    quorums_formed: int
    steps_committed: int
    steps_failed: int
    heals: int
    checksum_mismatches: int
    members_dropped: int
    committed_step: int
    committed_by_quorum: int
    splits: int
    unknown_decisions: int
    rollbacks: int
    steps_rolled_back: int
    waiting_for_holder: bool
    def __init__(self, quorum_id: _Optional[int] = ..., step: _Optional[int] = ..., members: _Optional[_Iterable[str]] = ..., quorums_formed: _Optional[int] = ..., steps_committed: _Optional[int] = ..., steps_failed: _Optional[int] = ..., heals: _Optional[int] = ..., checksum_mismatches: _Optional[int] = ..., members_dropped: _Optional[int] = ..., committed_step: _Optional[int] = ..., committed_by_quorum: _Optional[int] = ..., splits: _Optional[int] = ..., unknown_decisions: _Optional[int] = ..., rollbacks: _Optional[int] = ..., steps_rolled_back: _Optional[int] = ..., waiting_for_holder: _Optional[bool] = ...) -> None: ...

class TauPoint(_message.Message):
    __slots__ = ("model_version", "model_samples", "tau", "prompts", "generated_tokens", "verification_steps", "eval_seconds", "unix_time_ms", "evaluator_id", "read_unix_time_ms")
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TAU_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VERIFICATION_STEPS_FIELD_NUMBER: _ClassVar[int]
    EVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    UNIX_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    EVALUATOR_ID_FIELD_NUMBER: _ClassVar[int]
    READ_UNIX_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    model_version: int
    model_samples: int
    tau: float
    prompts: int
    generated_tokens: int
    verification_steps: int
    eval_seconds: float
    unix_time_ms: int
    evaluator_id: str
    read_unix_time_ms: int
    def __init__(self, model_version: _Optional[int] = ..., model_samples: _Optional[int] = ..., tau: _Optional[float] = ..., prompts: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., verification_steps: _Optional[int] = ..., eval_seconds: _Optional[float] = ..., unix_time_ms: _Optional[int] = ..., evaluator_id: _Optional[str] = ..., read_unix_time_ms: _Optional[int] = ...) -> None: ...
