"""gRPC server reflection under both of its names: ``grpc.reflection.v1alpha`` and ``.v1``.

grpcio-reflection (1.85) serves only v1alpha, while newer clients (grpcurl, Postman,
grpc-go's and grpc-java's tools) ask v1 first. v1 is v1alpha renamed: the same messages
with the same field numbers in package ``grpc.reflection.v1`` (grpc/grpc-proto,
``grpc/reflection/v1/reflection.proto``), so the library's servicer answers v1 calls as
they are. v1's file descriptor, derived from v1alpha's by renaming the package, is added
to the default descriptor pool so that v1 can be listed and described like any service.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import _async as reflection_aio
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

V1ALPHA_SERVICE: str = reflection.SERVICE_NAME
V1_PACKAGE = "grpc.reflection.v1"
V1_SERVICE = f"{V1_PACKAGE}.ServerReflection"
V1_FILE = "grpc/reflection/v1/reflection.proto"


def _register_v1_descriptor() -> None:
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(V1_FILE)
        return  # already there (e.g. a grpcio-reflection that ships v1)
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    old_prefix = f".{proto.package}."
    proto.name, proto.package = V1_FILE, V1_PACKAGE
    proto.ClearField("options")  # v1alpha's language options name v1alpha packages

    def renamed(type_name: str) -> str:
        return type_name.replace(old_prefix, f".{V1_PACKAGE}.", 1)

    for message in proto.message_type:
        for field in message.field:
            if field.type_name:
                field.type_name = renamed(field.type_name)
    for service in proto.service:
        for method in service.method:
            method.input_type = renamed(method.input_type)
            method.output_type = renamed(method.output_type)
    pool.Add(proto)


def enable_server_reflection(
    service_names: Iterable[str], server: grpc.Server | grpc.aio.Server
) -> None:
    """Serve reflection for ``service_names`` (plus both reflection services) on ``server``."""
    _register_v1_descriptor()
    names = (*service_names, V1ALPHA_SERVICE, V1_SERVICE)
    # The asyncio server needs the library's asyncio servicer (same answers).
    aio = isinstance(server, grpc.aio.Server)
    servicer: Any = (reflection_aio if aio else reflection).ReflectionServicer(names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        # Same wire format: v1alpha's message classes read and write v1's bytes.
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(V1_SERVICE, {"ServerReflectionInfo": v1}),)
    )
