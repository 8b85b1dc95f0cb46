#!/usr/bin/env python3
"""An independent reader of TensorBoard event files, for paratrain's tests.

usage: read_tensorboard.py FILE...

Prints one JSON line per record: {"file", "wall_time", "step", and "file_version", "values"
({tag: simple_value}) or "session_log" (its status)}. The TFRecord framing is checked with
python3-crc32c (or crcmod's CRC-32C); the records are decoded by python3-protobuf with
TensorBoard's Event, Summary and SessionLog (tensorboard/compat/proto/event.proto and
summary.proto), declared here from their field numbers, apart from paratrain's own .proto.
Exits 1 naming the file and offset of the first bad record.
"""
import json
import struct
import sys

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

try:
    import crc32c as _crc32c

    def crc32c(data):
        return _crc32c.crc32c(data)
except ImportError:  # crcmod's predefined CRC-32C
    import crcmod.predefined

    _fn = crcmod.predefined.mkPredefinedCrcFun("crc-32c")

    def crc32c(data):
        return _fn(data)


def masked(data):
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


F = descriptor_pb2.FieldDescriptorProto


def field(msg, name, number, ftype, label=F.LABEL_OPTIONAL, type_name=None, oneof=None):
    f = msg.field.add(name=name, number=number, type=ftype, label=label)
    if type_name:
        f.type_name = type_name
    if oneof is not None:
        f.oneof_index = oneof


def event_class():
    fd = descriptor_pb2.FileDescriptorProto(name="tb_event.proto", package="tb", syntax="proto3")
    value = descriptor_pb2.DescriptorProto(name="Value")
    field(value, "node_name", 7, F.TYPE_STRING)
    field(value, "tag", 1, F.TYPE_STRING)
    value.oneof_decl.add(name="value")
    field(value, "simple_value", 2, F.TYPE_FLOAT, oneof=0)
    field(value, "obsolete_old_style_histogram", 3, F.TYPE_BYTES, oneof=0)
    summary = fd.message_type.add(name="Summary")
    summary.nested_type.add().CopyFrom(value)
    field(summary, "value", 1, F.TYPE_MESSAGE, F.LABEL_REPEATED, ".tb.Summary.Value")
    session = fd.message_type.add(name="SessionLog")
    status = session.enum_type.add(name="SessionStatus")
    for i, n in enumerate(["STATUS_UNSPECIFIED", "START", "STOP", "CHECKPOINT"]):
        status.value.add(name=n, number=i)
    field(session, "status", 1, F.TYPE_ENUM, type_name=".tb.SessionLog.SessionStatus")
    field(session, "checkpoint_path", 2, F.TYPE_STRING)
    field(session, "msg", 3, F.TYPE_STRING)
    event = fd.message_type.add(name="Event")
    field(event, "wall_time", 1, F.TYPE_DOUBLE)
    field(event, "step", 2, F.TYPE_INT64)
    event.oneof_decl.add(name="what")
    field(event, "file_version", 3, F.TYPE_STRING, oneof=0)
    field(event, "graph_def", 4, F.TYPE_BYTES, oneof=0)
    field(event, "summary", 5, F.TYPE_MESSAGE, type_name=".tb.Summary", oneof=0)
    field(event, "session_log", 7, F.TYPE_MESSAGE, type_name=".tb.SessionLog", oneof=0)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    descriptor = pool.FindMessageTypeByName("tb.Event")
    if hasattr(message_factory, "GetMessageClass"):  # protobuf >= 4.22
        return message_factory.GetMessageClass(descriptor)
    return message_factory.MessageFactory(pool).GetPrototype(descriptor)


def read(path, Event):
    data = open(path, "rb").read()
    at = 0
    while at < len(data):
        if len(data) - at < 12:
            raise ValueError(f"{path}: a truncated record header at byte {at}")
        header = data[at : at + 8]
        (length,) = struct.unpack("<Q", header)
        (length_crc,) = struct.unpack("<I", data[at + 8 : at + 12])
        if masked(header) != length_crc:
            raise ValueError(f"{path}: the length's CRC-32C is wrong at byte {at}")
        body = data[at + 12 : at + 12 + length]
        if len(body) != length or len(data) < at + 16 + length:
            raise ValueError(f"{path}: a truncated record at byte {at}")
        (body_crc,) = struct.unpack("<I", data[at + 12 + length : at + 16 + length])
        if masked(body) != body_crc:
            raise ValueError(f"{path}: the record's CRC-32C is wrong at byte {at}")
        event = Event()
        event.ParseFromString(body)
        row = {"file": path, "wall_time": event.wall_time, "step": event.step}
        what = event.WhichOneof("what")
        if what == "file_version":
            row["file_version"] = event.file_version
        elif what == "summary":
            row["values"] = {v.tag: v.simple_value for v in event.summary.value}
        elif what == "session_log":
            row["session_log"] = event.session_log.status
        print(json.dumps(row))
        at += 16 + length


def main():
    Event = event_class()
    try:
        for path in sys.argv[1:]:
            read(path, Event)
    except ValueError as e:
        print(e, file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
