"""KServe v2 over gRPC (``inference.GRPCInferenceService``) with ``grpc.aio``, on the same event
loop and server state as HTTP. Tensors come in ``raw_input_contents`` (tritonclient's default)
or typed ``contents``; outputs go back in ``raw_output_contents``."""

from __future__ import annotations

import grpc
import numpy as np

from kiln.serve import datatypes
from kiln.serve.errors import Kind, ServeError, invalid
from kiln.serve.http import EXTENSIONS
from kiln.serve.infer import InferRequest, RequestedOutput
from kiln.serve.proto import grpc_service_pb2 as pb
from kiln.serve.stats import model_stats

SERVICE = "inference.GRPCInferenceService"
CONTENTS = {  # datatype -> the InferTensorContents field that carries it
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
    "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
    "UINT16": "uint_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
    "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents",
}


class Service:
    def __init__(self, server):
        self.server = server

    async def ServerLive(self, req, ctx):
        return pb.ServerLiveResponse(live=self.server.live())

    async def ServerReady(self, req, ctx):
        return pb.ServerReadyResponse(ready=self.server.ready())

    async def ModelReady(self, req, ctx):
        try:
            self.server.models.get(req.name, req.version)
        except ServeError as e:
            if e.kind is Kind.NOT_FOUND and req.name not in self.server.models.models:
                raise
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=not self.server.draining)

    async def ServerMetadata(self, req, ctx):
        import kiln

        return pb.ServerMetadataResponse(name="kiln", version=kiln.__version__,
                                         extensions=EXTENSIONS)

    async def ModelMetadata(self, req, ctx):
        mv = self.server.models.get(req.name, req.version)
        m = self.server.models.models[req.name]
        nb = [-1] if mv.batched else []
        T = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=req.name, versions=[str(v) for v in sorted(m.versions)],
            platform=mv.config.platform or mv.config.backend,
            inputs=[T(name=s.name, datatype=s.datatype, shape=nb + list(s.dims))
                    for s in mv.inputs],
            outputs=[T(name=s.name, datatype=s.datatype, shape=nb + list(s.dims))
                     for s in mv.outputs])

    async def ModelConfig(self, req, ctx):
        mv = self.server.models.get(req.name, req.version)
        return pb.ModelConfigResponse(config=mv.config)

    async def ModelStatistics(self, req, ctx):
        if req.name:
            self.server.models.get(req.name, req.version)
        from google.protobuf import json_format

        out = pb.ModelStatisticsResponse()
        json_format.ParseDict({"model_stats": model_stats(self.server.models, req.name,
                                                          req.version)}, out)
        return out

    async def RepositoryIndex(self, req, ctx):
        entries = self.server.models.index()
        if req.ready:
            entries = [e for e in entries if e["state"] == "READY"]
        M = pb.RepositoryIndexResponse.ModelIndex
        return pb.RepositoryIndexResponse(models=[M(**e) for e in entries])

    async def RepositoryModelLoad(self, req, ctx):
        await self.server.load_model(req.model_name)
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, req, ctx):
        await self.server.unload_model(req.model_name)
        return pb.RepositoryModelUnloadResponse()

    async def ModelInfer(self, req, ctx):
        r = _to_request(req)
        mv, outs = await self.server.infer(r)
        return _to_response(r, mv, outs)


def _param(p):
    which = p.WhichOneof("parameter_choice")
    return getattr(p, which) if which else None


def _to_request(req) -> InferRequest:
    raw = list(req.raw_input_contents)
    if raw and len(raw) != len(req.inputs):
        raise invalid(f"{len(raw)} raw_input_contents for {len(req.inputs)} inputs (give "
                      f"each input raw contents, or none)")
    r = InferRequest(req.model_name, req.model_version, req.id,
                     parameters={k: _param(v) for k, v in req.parameters.items()})
    for i, t in enumerate(req.inputs):
        where = f"input '{t.name}'"
        shape = tuple(t.shape)
        if raw:
            x = datatypes.from_raw(raw[i], t.datatype, shape, where)
        else:
            field = CONTENTS.get(t.datatype)
            if field is None:
                raise invalid(f"{where}: {t.datatype} must be sent in raw_input_contents")
            values = list(getattr(t.contents, field))
            count = datatypes.element_count(shape, where)
            if len(values) != count:
                raise invalid(f"{where}: {len(values)} values for shape {list(shape)} "
                              f"({count} elements)")
            x = np.array(values, dtype=datatypes.numpy_dtype(t.datatype, where)).reshape(shape)
        if t.name in r.inputs:
            raise invalid(f"input '{t.name}' is given twice")
        r.inputs[t.name] = (t.datatype, x)
    if req.outputs:
        r.outputs = [RequestedOutput(o.name) for o in req.outputs]
    return r


def _to_response(r: InferRequest, mv, outs: dict):
    specs = {s.name: s for s in mv.outputs}
    names = [o.name for o in r.outputs] if r.outputs is not None else list(specs)
    resp = pb.ModelInferResponse(model_name=mv.name, model_version=str(mv.version), id=r.id)
    for name in names:
        x = np.asarray(outs[name])
        resp.outputs.add(name=name, datatype=specs[name].datatype, shape=list(x.shape))
        resp.raw_output_contents.append(datatypes.to_raw(x))
    return resp


def _handler(method, req_type, resp_type):
    async def call(request, context):
        try:
            return await method(request, context)
        except ServeError as e:
            await context.abort(e.kind.grpc_code, e.message)
    return grpc.unary_unary_rpc_method_handler(
        call, request_deserializer=req_type.FromString,
        response_serializer=resp_type.SerializeToString)


async def start_grpc(server, host: str, port: int):
    """Start the gRPC endpoint; returns ``(grpc.aio.Server, bound port)``."""
    limit = server.config.max_body_bytes
    g = grpc.aio.server(options=[("grpc.max_receive_message_length", limit),
                                 ("grpc.max_send_message_length", -1)])
    svc = Service(server)
    desc = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    handlers = {m.name: _handler(getattr(svc, m.name), _cls(m.input_type), _cls(m.output_type))
                for m in desc.methods}
    g.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    bound = g.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise ServeError(Kind.INTERNAL, f"cannot listen for gRPC on {host}:{port}")
    await g.start()
    return g, bound


def _cls(descriptor):
    return getattr(pb, descriptor.name)
