#!/usr/bin/env python3
"""A minimal OTLP/gRPC trace receiver for measuring what span export costs.

Accepts every ExportTraceServiceRequest on the official
`opentelemetry-proto` service definitions, counts spans per service, and
prints the counts on SIGTERM/SIGINT. Used by `scripts/bench/trace_cost.sh`
(the export's CPU cost side by side with no export); it needs
`pip install opentelemetry-proto grpcio`.

    python otlp_sink.py 127.0.0.1:4317
"""

from __future__ import annotations

import collections
import signal
import sys
import threading
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class Sink(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans: collections.Counter[str] = collections.Counter()

    def Export(self, request, context):  # noqa: N802 (the generated name)
        with self.lock:
            for resource_spans in request.resource_spans:
                service = "?"
                for attribute in resource_spans.resource.attributes:
                    if attribute.key == "service.instance.id":
                        service = attribute.value.string_value
                for scope_spans in resource_spans.scope_spans:
                    self.spans[service] += len(scope_spans.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


def main() -> int:
    address = sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:4317"
    sink = Sink()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    server.add_insecure_port(address)
    server.start()
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    print(f"otlp sink on {address}", flush=True)
    done.wait()
    server.stop(1)
    with sink.lock:
        total = sum(sink.spans.values())
        print(f"spans received: {total} " + " ".join(f"{k}={v}" for k, v in sorted(sink.spans.items())), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
