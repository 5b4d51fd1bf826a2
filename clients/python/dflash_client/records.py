"""Broker messages as plain Python dicts: status snapshots, run summaries.

Numbers stay Python ints and floats (not the strings protobuf's JSON mapping
makes of 64-bit integers), enums become their names (`BROKER_STATE_RUNNING`,
as `dflash status --json` prints them), sub-messages nested dicts, an unset
optional field None.
"""

from __future__ import annotations

from typing import Any, Dict

from google.protobuf.descriptor import FieldDescriptor


def message_to_dict(message: Any) -> Dict[str, Any]:
    result: Dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        is_repeated = getattr(field, "is_repeated", None)
        repeated = is_repeated if is_repeated is not None else field.label == FieldDescriptor.LABEL_REPEATED
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            result[field.name] = dict(value)
        elif repeated:
            result[field.name] = [_convert(field, element) for element in value]
        elif field.has_presence and not message.HasField(field.name):
            result[field.name] = None
        else:
            result[field.name] = _convert(field, value)
    return result


def _convert(field: FieldDescriptor, value: Any) -> Any:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return message_to_dict(value)
    if field.type == FieldDescriptor.TYPE_ENUM:
        enum_value = field.enum_type.values_by_number.get(value)
        return enum_value.name if enum_value is not None else f"{field.enum_type.name.upper()}_{value}"
    return value
