"""The Open Inference Protocol's gRPC service in front of one Engine."""

import errno
import logging
import os
import signal
import socket
import sys
import threading
from concurrent import futures

import grpc

from . import __version__
from . import tensors as T
from ._oip import grpc_service_pb2 as pb
from ._oip import grpc_service_pb2_grpc as pb_grpc
from .engine import InvalidInput, Request, Response

log = logging.getLogger("troupe_engine")

FINAL = "triton_final_response"

# Bigger than gRPC's 4 MiB default: a segment of hidden states is 4 KiB a
# token at width 2048 in FP16.
DEFAULT_MAX_MESSAGE_BYTES = 256 << 20


class _EngineError(Exception):
    """A failure of the engine's own making (not of the request)."""


def _specs(specs):
    return {s.name: s for s in specs}


def _tensor_metadata(spec):
    return pb.ModelMetadataResponse.TensorMetadata(name=spec.name, datatype=spec.datatype, shape=spec.shape)


def decode_request(engine, msg, cancelled=None):
    """The Request of a ModelInferRequest, checked against the engine's
    inputs; raises InvalidInput."""
    if msg.model_name != engine.name:
        raise InvalidInput(f"unknown model {msg.model_name!r}: this server serves {engine.name!r}")
    specs = _specs(engine.inputs)
    raw = msg.raw_input_contents
    if raw and len(raw) != len(msg.inputs):
        raise InvalidInput(
            f"{len(raw)} raw_input_contents for {len(msg.inputs)} inputs: give one per input, or none"
        )
    inputs = {}
    for i, t in enumerate(msg.inputs):
        what = f"input {t.name!r}"
        spec = specs.get(t.name)
        if spec is None:
            raise InvalidInput(f"model {engine.name!r} has no input {t.name!r} (it takes {sorted(specs)})")
        if t.name in inputs:
            raise InvalidInput(f"{what} is given twice")
        if t.datatype != spec.datatype:
            raise InvalidInput(f"{what}: datatype {t.datatype}, the model takes {spec.datatype}")
        shape = list(t.shape)
        T.check_shape(what, shape, spec.shape)
        if raw:
            if t.HasField("contents"):
                raise InvalidInput(f"{what}: both contents and raw_input_contents")
            inputs[t.name] = T.from_raw(what, t.datatype, shape, raw[i])
        else:
            inputs[t.name] = T.from_contents(what, t.datatype, shape, t.contents)
    missing = [s.name for s in engine.inputs if not s.optional and s.name not in inputs]
    if missing:
        raise InvalidInput(f"model {engine.name!r} needs input(s) {missing}")
    requested = None
    if msg.outputs:
        out_specs = _specs(engine.outputs)
        requested = set()
        for o in msg.outputs:
            if o.name not in out_specs:
                raise InvalidInput(f"model {engine.name!r} has no output {o.name!r} (it gives {sorted(out_specs)})")
            requested.add(o.name)
    return Request(
        inputs=inputs,
        parameters=T.params_dict(msg.parameters),
        id=msg.id,
        cancelled=cancelled,
        requested_outputs=requested,
    )


def _as_response(item):
    if isinstance(item, Response):
        return item
    if isinstance(item, dict):
        return Response(outputs=item)
    raise _EngineError(f"generate yielded a {type(item).__name__}: yield a dict of outputs or a Response")


def encode_outputs(engine, request, resp, out):
    """Fills ModelInferResponse out with resp's outputs (raw contents) and
    its parameters but finish_reason."""
    specs = _specs(engine.outputs)
    for name, value in resp.outputs.items():
        spec = specs.get(name)
        what = f"output {name!r}"
        if spec is None:
            raise _EngineError(f"generate yielded {what}, which model {engine.name!r} does not declare")
        if request.requested_outputs is not None and name not in request.requested_outputs:
            continue
        try:
            arr = T.to_array(what, spec.datatype, value)
            T.check_shape(what, list(arr.shape), spec.shape)
        except (TypeError, ValueError) as e:
            raise _EngineError(str(e)) from e
        t = out.outputs.add(name=name, datatype=spec.datatype, shape=list(arr.shape))
        for k, v in resp.tensor_parameters.get(name, {}).items():
            T.set_param(t.parameters[k], k, v)
        out.raw_output_contents.append(T.to_raw(spec.datatype, arr))
    unknown = set(resp.tensor_parameters) - set(resp.outputs)
    if unknown:
        raise _EngineError(f"tensor_parameters for {sorted(unknown)}, which this response does not give")
    for k, v in resp.parameters.items():
        if k != "finish_reason":
            T.set_param(out.parameters[k], k, v)


class _Run:
    """One request's run of generate: yields ModelInferResponses (not the
    final one) and remembers the finish_reason."""

    def __init__(self, engine, request):
        self.engine = engine
        self.request = request
        self.finish_reason = None
        self.final_parameters = {}

    def _new(self):
        return pb.ModelInferResponse(
            model_name=self.engine.name, model_version=self.engine.version, id=self.request.id
        )

    def responses(self):
        """Yields (ModelInferResponse) for each response with outputs; the
        generator is closed on return, on an exception and when the consumer
        stops early."""
        result = self.engine.generate(self.request)
        if isinstance(result, (dict, Response)):
            result = [result]
        elif result is None:
            raise _EngineError("generate returned None: make it a generator (yield) or return its responses")
        gen = iter(result)
        try:
            while not self.request.cancelled.is_set():
                try:
                    item = next(gen)
                except StopIteration:
                    return
                if self.request.cancelled.is_set():
                    return
                resp = _as_response(item)
                if "finish_reason" in resp.parameters:
                    self.finish_reason = resp.parameters["finish_reason"]
                if not resp.outputs:
                    self.final_parameters.update(
                        {k: v for k, v in resp.parameters.items() if k != "finish_reason"}
                    )
                    continue
                out = self._new()
                encode_outputs(self.engine, self.request, resp, out)
                yield out
        finally:
            close = getattr(gen, "close", None)
            if close is not None:
                close()

    def finish(self, out):
        """Adds the parameters held for the final response to out."""
        for k, v in self.final_parameters.items():
            T.set_param(out.parameters[k], k, v)
        if self.finish_reason is not None:
            T.set_param(out.parameters["finish_reason"], "finish_reason", self.finish_reason)
        return out

    def final(self):
        """The final response of a stream: empty, triton_final_response true."""
        out = self._new()
        T.set_param(out.parameters[FINAL], FINAL, True)
        return self.finish(out)


class _Servicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, engine):
        self.engine = engine
        self.stopping = threading.Event()

    def _ready(self):
        return not self.stopping.is_set() and bool(self.engine.ready())

    def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self._ready())

    def ModelReady(self, request, context):
        return pb.ModelReadyResponse(ready=request.name == self.engine.name and self._ready())

    def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name="troupe_engine", version=__version__, extensions=[])

    def ModelMetadata(self, request, context):
        e = self.engine
        if request.name != e.name:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model {request.name!r}: this server serves {e.name!r}")
        return pb.ModelMetadataResponse(
            name=e.name,
            versions=[e.version],
            platform=e.platform,
            inputs=[_tensor_metadata(s) for s in e.inputs],
            outputs=[_tensor_metadata(s) for s in e.outputs],
        )

    def ModelInfer(self, msg, context):
        """One request, one response: generate must give at most one
        response with outputs (a decoupled model's many responses need
        ModelStreamInfer, as on Triton); a second is INVALID_ARGUMENT and
        closes the generator. The response carries the parameters of every
        Response, finish_reason included, and no triton_final_response."""
        cancelled = threading.Event()
        context.add_callback(cancelled.set)
        code, message, got = self._infer_one(msg, cancelled)
        if code is not None:
            context.abort(code, message)
        return got

    def _infer_one(self, msg, cancelled):
        """ModelInfer's work: (None, None, response) or (code, message, None)."""
        try:
            request = decode_request(self.engine, msg, cancelled)
        except InvalidInput as e:
            return grpc.StatusCode.INVALID_ARGUMENT, str(e), None
        run = _Run(self.engine, request)
        got = None
        responses = run.responses()
        try:
            for out in responses:
                if got is not None:
                    return (
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"model {self.engine.name!r} gives more than one response: use ModelStreamInfer",
                        None,
                    )
                got = out
            if cancelled.is_set():
                return grpc.StatusCode.CANCELLED, "cancelled", None
            got = run.finish(got if got is not None else run._new())
        except InvalidInput as e:
            return grpc.StatusCode.INVALID_ARGUMENT, str(e), None
        except Exception as e:  # the engine's failure: its message goes to the client
            if not cancelled.is_set():
                log.exception("model %s: request %r failed", self.engine.name, msg.id)
            return grpc.StatusCode.INTERNAL, _message(e), None
        finally:
            responses.close()
        return None, None, got

    def ModelStreamInfer(self, request_iterator, context):
        """Each request in turn: its responses (triton_final_response
        false), then an empty final one (true, with finish_reason when
        generate gave one). A failed request is one error_message and no
        final response; the stream goes on. When the call ends or is
        cancelled, the running request's cancelled is set and its generator
        closed."""
        lock = threading.Lock()
        current = [None]
        ended = threading.Event()

        def on_end():
            with lock:
                ended.set()
                if current[0] is not None:
                    current[0].set()

        if not context.add_callback(on_end):
            return
        try:
            for msg in request_iterator:
                cancelled = threading.Event()
                with lock:
                    if ended.is_set():
                        return
                    current[0] = cancelled
                try:
                    request = decode_request(self.engine, msg, cancelled)
                except InvalidInput as e:
                    yield self._stream_error(msg, str(e))
                    continue
                run = _Run(self.engine, request)
                responses = run.responses()
                try:
                    for out in responses:
                        T.set_param(out.parameters[FINAL], FINAL, False)
                        yield pb.ModelStreamInferResponse(infer_response=out)
                    final = run.final()
                except Exception as e:
                    if cancelled.is_set():
                        return
                    if not isinstance(e, InvalidInput):
                        log.exception("model %s: request %r failed", self.engine.name, msg.id)
                    yield self._stream_error(msg, _message(e))
                    continue
                finally:
                    responses.close()  # closes generate's generator, also when this call is dropped
                if cancelled.is_set():
                    return
                yield pb.ModelStreamInferResponse(infer_response=final)
        except grpc.RpcError:
            return  # the call ended while waiting for the next request

    def _stream_error(self, msg, message):
        return pb.ModelStreamInferResponse(
            error_message=message,
            infer_response=pb.ModelInferResponse(
                model_name=self.engine.name, model_version=self.engine.version, id=msg.id
            ),
        )


def _message(e):
    text = str(e)
    if isinstance(e, (InvalidInput, _EngineError)):
        return text
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


class Server:
    """A running server (start's handle)."""

    def __init__(self, grpc_server, servicer, address, port):
        self._server = grpc_server
        self._servicer = servicer
        self.address = address
        self.port = port  # the bound TCP port; 1 for a unix socket

    def stop(self, grace=None):
        """Stops taking calls; after grace seconds (None: at once) cancels
        those still running, which cancels their requests. Returns once
        stopped."""
        self._servicer.stopping.set()
        self._server.stop(grace).wait()

    def wait(self, timeout=None):
        """Blocks until the server stops; False on timeout."""
        return self._server.wait_for_termination(timeout)


def _refuse_live_socket(addr):
    """gRPC replaces a unix socket that exists: refuse one a server still
    answers on, rather than take its path from it."""
    if not addr.startswith("unix:"):
        return
    path = addr[len("unix://"):] if addr.startswith("unix://") else addr[len("unix:"):]
    if not os.path.exists(path):
        return
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(1)
        s.connect(path)
    except OSError as e:
        if e.errno in (errno.ECONNREFUSED, errno.ENOTSOCK, errno.ENOENT):
            return  # stale, or not a socket (then bind fails, with its own error)
        raise OSError(f"troupe_engine: cannot listen on {addr}: {e}") from e
    else:
        raise OSError(errno.EADDRINUSE, f"troupe_engine: cannot listen on {addr}: a server is listening there")
    finally:
        s.close()


def start(engine, addr, max_workers=64, max_message_bytes=DEFAULT_MAX_MESSAGE_BYTES):
    """Serves engine at addr ("unix:///path/engine.sock" or "host:port";
    port 0 picks a free one, see .port) and returns the Server at once.

    max_workers bounds the calls at once, health checks included: each
    ModelStreamInfer call holds a thread for its life."""
    for attr in ("name", "inputs", "outputs"):
        if not getattr(engine, attr, None):
            raise ValueError(f"engine {type(engine).__name__} has no {attr}")
    for spec in list(engine.inputs) + list(engine.outputs):
        if not hasattr(spec, "datatype"):
            raise ValueError(f"engine {engine.name!r}: {spec!r} is not a TensorSpec")
    _refuse_live_socket(addr)
    servicer = _Servicer(engine)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="troupe_engine"),
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0),
        ],
    )
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    try:
        port = server.add_insecure_port(addr)
    except RuntimeError as e:
        raise OSError(f"troupe_engine: cannot listen on {addr}: {e}") from e
    if not port:
        raise OSError(f"troupe_engine: cannot listen on {addr}")
    server.start()
    return Server(server, servicer, addr, port)


def serve(engine, addr, max_workers=64, grace=5.0, max_message_bytes=DEFAULT_MAX_MESSAGE_BYTES):
    """Serves engine at addr until SIGINT or SIGTERM, then stops: calls
    still running after grace seconds are cancelled. Prints one line to
    stderr once listening. Call it from the main thread; returns 0."""
    server = start(engine, addr, max_workers=max_workers, max_message_bytes=max_message_bytes)
    stop = threading.Event()

    def on_signal(signum, frame):
        stop.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    print(f"troupe_engine: serving model {engine.name} on {addr}", file=sys.stderr, flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        server.stop(grace)
    return 0
