"""troupe_engine: serve a Python engine over the Open Inference Protocol.

An engine is a class with its metadata and a generate(request) generator:

    import numpy as np
    import troupe_engine as te

    class Echo(te.Engine):
        name = "echo"
        inputs = [te.TensorSpec("text", "BYTES", [1])]
        outputs = [te.TensorSpec("text", "BYTES", [1])]

        def generate(self, request):
            for word in request.inputs["text"][0].decode().split():
                if request.cancelled.is_set():
                    return
                yield {"text": np.array([word.encode()], dtype=object)}
            yield te.Response(parameters={"finish_reason": "stop"})

    te.serve(Echo(), "unix:///tmp/echo.sock")

Tensors in and out are numpy arrays (a torch tensor converts with
.cpu().numpy(); bfloat16 ones with .view(torch.int16).numpy().view("uint16")
or .float().numpy()). troupe's worker reaches it with `troupe worker
--engine oip --upstream unix:///tmp/echo.sock --model echo`; docs/engines.md
("Your own engine") has the mapping. Depends only on grpcio, protobuf and
numpy (Debian: python3-grpcio, python3-protobuf, python3-numpy).
"""

__version__ = "0.1.0"

from .engine import Engine, InvalidInput, Request, Response, TensorSpec  # noqa: E402
from .server import Server, serve, start  # noqa: E402
from .tensors import bf16_to_float32, float32_to_bf16  # noqa: E402

__all__ = [
    "Engine",
    "InvalidInput",
    "Request",
    "Response",
    "Server",
    "TensorSpec",
    "bf16_to_float32",
    "float32_to_bf16",
    "serve",
    "start",
]
