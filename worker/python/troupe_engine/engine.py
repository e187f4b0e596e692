"""What an engine author writes against: TensorSpec, Engine, Request, Response."""

import threading


class InvalidInput(ValueError):
    """A request the engine cannot take: the server answers it with
    INVALID_ARGUMENT (ModelInfer) or an error_message (ModelStreamInfer).
    Engines raise it for input they refuse."""


class TensorSpec:
    """One input or output of a model, as ModelMetadata lists it.

    datatype is an OIP datatype (FP16, FP32, BF16, INT16, INT32, INT64,
    UINT8, BYTES ...); shape has -1 for a dimension of any size. An input
    with optional=True may be left out of a request; every other declared
    input is required."""

    __slots__ = ("name", "datatype", "shape", "optional")

    def __init__(self, name, datatype, shape, optional=False):
        from .tensors import DTYPES  # here: tensors imports InvalidInput from this module

        if datatype not in DTYPES:
            raise ValueError(f"tensor {name!r}: unknown datatype {datatype!r} (want one of {sorted(DTYPES)})")
        self.name = name
        self.datatype = datatype
        self.shape = [int(d) for d in shape]
        self.optional = optional

    def __repr__(self):
        return f"TensorSpec({self.name!r}, {self.datatype!r}, {self.shape!r}, optional={self.optional})"


class Request:
    """One inference request as the engine sees it.

    id: the client's request id ("" when it gave none).
    inputs: dict name -> numpy array (BYTES: an object array of bytes; FP16:
        float16; BF16: uint16 bits, see bf16_to_float32).
    parameters: dict name -> bool, int, float or str (the request's
        ModelInferRequest.parameters: max_tokens, temperature, sequence_start ...).
    cancelled: a threading.Event, set when the client cancels or the call
        ends; the server also closes the generator at its next yield.
    requested_outputs: the output names the client asked for, or None for all.
    """

    __slots__ = ("id", "inputs", "parameters", "cancelled", "requested_outputs")

    def __init__(self, inputs=None, parameters=None, id="", cancelled=None, requested_outputs=None):
        self.id = id
        self.inputs = dict(inputs or {})
        self.parameters = dict(parameters or {})
        self.cancelled = cancelled if cancelled is not None else threading.Event()
        self.requested_outputs = requested_outputs

    def __repr__(self):
        return f"Request(id={self.id!r}, inputs={sorted(self.inputs)}, parameters={self.parameters!r})"


class Response:
    """One response of generate, when a plain dict of outputs is not enough.

    outputs: dict name -> numpy array (or anything numpy.asarray takes; a
        torch tensor converts with .cpu().numpy()).
    parameters: response parameters (bool, int, float or str). finish_reason
        ("stop" or "length") is held back for the request's final response.
    tensor_parameters: dict output name -> dict of that output tensor's
        parameters, e.g. {"audio": {"sample_rate": 24000}}.

    A Response without outputs sends nothing of its own: its parameters go
    on the request's final response."""

    __slots__ = ("outputs", "parameters", "tensor_parameters")

    def __init__(self, outputs=None, parameters=None, tensor_parameters=None):
        self.outputs = dict(outputs or {})
        self.parameters = dict(parameters or {})
        self.tensor_parameters = {k: dict(v) for k, v in (tensor_parameters or {}).items()}

    def __repr__(self):
        return f"Response(outputs={sorted(self.outputs)}, parameters={self.parameters!r})"


class Engine:
    """A model served over the Open Inference Protocol by troupe_engine.serve.

    Subclasses set name, inputs and outputs (class or instance attributes)
    and write generate(request), a generator that yields each response: a
    dict output name -> numpy array, or a Response. Returning ends the
    request. generate runs on a server thread, one call per request, several
    at once when requests overlap: an engine that is not thread-safe takes a
    lock."""

    name = "model"
    version = "1"
    platform = "troupe_engine"
    inputs = []
    outputs = []

    def ready(self):
        """Whether the model takes requests (ModelReady, ServerReady)."""
        return True

    def generate(self, request):
        raise NotImplementedError(f"{type(self).__name__}.generate")
