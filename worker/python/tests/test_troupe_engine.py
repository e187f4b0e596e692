"""troupe_engine over a unix socket, driven with the generated OIP stubs.

Run: PYTHONPATH=worker/python python3 -m unittest discover -s worker/python/tests
"""

import os
import queue
import shutil
import struct
import sys
import tempfile
import threading
import time
import unittest

import logging

import grpc
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import troupe_engine as te  # noqa: E402
from troupe_engine._oip import grpc_service_pb2 as pb  # noqa: E402
from troupe_engine._oip import grpc_service_pb2_grpc as pb_grpc  # noqa: E402

WAIT = 10  # seconds: the bound of every wait for a condition

# The failures these tests provoke are logged with their tracebacks.
logging.getLogger("troupe_engine").setLevel(logging.CRITICAL)


class Probe(te.Engine):
    """A test engine: request parameter mode picks what generate does."""

    name = "probe"
    version = "7"
    inputs = [
        te.TensorSpec("text", "BYTES", [-1], optional=True),
        te.TensorSpec("hidden", "FP16", [-1, 4], optional=True),
        te.TensorSpec("audio", "INT16", [-1], optional=True),
        te.TensorSpec("bits", "BF16", [-1], optional=True),
        te.TensorSpec("ids", "INT32", [-1], optional=True),
    ]
    outputs = [
        te.TensorSpec("text", "BYTES", [-1]),
        te.TensorSpec("hidden", "FP16", [-1, 4]),
        te.TensorSpec("audio", "INT16", [-1]),
        te.TensorSpec("bits", "BF16", [-1]),
        te.TensorSpec("ids", "INT32", [-1]),
        te.TensorSpec("index", "INT64", [1]),
    ]

    def __init__(self):
        self.events = queue.Queue()  # what blocking generators saw, in order
        self.started = threading.Event()

    def generate(self, request):
        mode = request.parameters.get("mode", "echo")
        if mode == "echo":
            yield te.Response(
                outputs=dict(request.inputs),
                parameters={"seen": ",".join(sorted(request.parameters))},
                tensor_parameters={"audio": {"sample_rate": 16000}} if "audio" in request.inputs else None,
            )
        elif mode == "count":
            for i in range(request.parameters["n"]):
                yield {"index": np.array([i]), "text": [f"{request.id}:{i}"]}
            yield te.Response(parameters={"finish_reason": "length"})
        elif mode == "block":
            try:
                yield {"index": np.array([0])}
                self.started.set()
                self.events.put(("cancelled", request.cancelled.wait(WAIT)))
                yield {"index": np.array([1])}
                self.events.put(("resumed", request.id))
            finally:
                self.events.put(("closed", request.id))
        elif mode == "spin":  # ignores cancelled: closed at a yield
            i = 0
            try:
                while True:
                    yield {"index": np.array([i])}
                    if i == 0:
                        self.started.set()
                    i += 1
                    time.sleep(0.002)  # pacing, not a wait for a condition
            except GeneratorExit:
                self.events.put(("closed", request.id))
                raise
        elif mode == "fail":
            yield {"index": np.array([0])}
            raise ValueError("boom")
        elif mode == "undeclared":
            yield {"nope": np.array([1])}
        elif mode == "float_to_int":
            yield {"ids": np.array([1.5])}
        elif mode == "invalid":
            raise te.InvalidInput("the engine refuses this")
        else:
            raise AssertionError(mode)


def raw_bytes(*elements):
    return b"".join(struct.pack("<I", len(e)) + e for e in elements)


def split_bytes(raw):
    out, at = [], 0
    while at < len(raw):
        (n,) = struct.unpack_from("<I", raw, at)
        out.append(raw[at + 4:at + 4 + n])
        at += 4 + n
    return out


def outputs_of(resp):
    """name -> (datatype, shape, raw, parameters) of a ModelInferResponse."""
    return {
        t.name: (t.datatype, list(t.shape), resp.raw_output_contents[i], dict(t.parameters))
        for i, t in enumerate(resp.outputs)
    }


def params(msg):
    return {k: getattr(v, v.WhichOneof("parameter_choice")) for k, v in msg.parameters.items()}


def infer_request(mode, rid="r", inputs=(), **extra):
    msg = pb.ModelInferRequest(model_name="probe", id=rid)
    msg.parameters["mode"].string_param = mode
    for k, v in extra.items():
        if isinstance(v, bool):
            msg.parameters[k].bool_param = v
        else:
            msg.parameters[k].int64_param = v
    for name, datatype, shape, raw in inputs:
        msg.inputs.add(name=name, datatype=datatype, shape=shape)
        msg.raw_input_contents.append(raw)
    return msg


class Feed:
    """A request stream the test writes to while the call runs."""

    def __init__(self):
        self.q = queue.Queue()

    def __iter__(self):
        while True:
            item = self.q.get()
            if item is None:
                return
            yield item

    def send(self, msg):
        self.q.put(msg)

    def close(self):
        self.q.put(None)


class ServedTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="troupe_engine_")
        cls.engine = Probe()
        cls.addr = "unix://" + os.path.join(cls.dir, "engine.sock")
        cls.server = te.start(cls.engine, cls.addr)
        cls.channel = grpc.insecure_channel(cls.addr)
        grpc.channel_ready_future(cls.channel).result(timeout=WAIT)
        cls.stub = pb_grpc.GRPCInferenceServiceStub(cls.channel)

    @classmethod
    def tearDownClass(cls):
        cls.channel.close()
        cls.server.stop()
        shutil.rmtree(cls.dir, ignore_errors=True)

    def setUp(self):
        while not self.engine.events.empty():
            self.engine.events.get_nowait()
        self.engine.started.clear()

    def event(self):
        return self.engine.events.get(timeout=WAIT)

    # ---- health and metadata ------------------------------------------------

    def test_metadata(self):
        self.assertTrue(self.stub.ServerLive(pb.ServerLiveRequest()).live)
        self.assertTrue(self.stub.ServerReady(pb.ServerReadyRequest()).ready)
        self.assertTrue(self.stub.ModelReady(pb.ModelReadyRequest(name="probe")).ready)
        self.assertTrue(self.stub.ModelReady(pb.ModelReadyRequest(name="probe", version="3")).ready)
        self.assertFalse(self.stub.ModelReady(pb.ModelReadyRequest(name="other")).ready)
        sm = self.stub.ServerMetadata(pb.ServerMetadataRequest())
        self.assertEqual((sm.name, sm.version), ("troupe_engine", te.__version__))
        md = self.stub.ModelMetadata(pb.ModelMetadataRequest(name="probe"))
        self.assertEqual(md.name, "probe")
        self.assertEqual(list(md.versions), ["7"])
        self.assertEqual(md.platform, "troupe_engine")
        self.assertEqual(
            [(t.name, t.datatype, list(t.shape)) for t in md.inputs],
            [(s.name, s.datatype, s.shape) for s in Probe.inputs],
        )
        self.assertEqual(
            [(t.name, t.datatype, list(t.shape)) for t in md.outputs],
            [(s.name, s.datatype, s.shape) for s in Probe.outputs],
        )
        with self.assertRaises(grpc.RpcError) as e:
            self.stub.ModelMetadata(pb.ModelMetadataRequest(name="other"))
        self.assertEqual(e.exception.code(), grpc.StatusCode.NOT_FOUND)

    # ---- ModelInfer ---------------------------------------------------------

    def test_infer_round_trips(self):
        hidden = np.array([[0.5, -1.25, 65504, 1e-3], [3, 2, 1, 0]], dtype=np.float16)
        audio = np.array([-32768, -1, 0, 1, 32767], dtype=np.int16)
        bits = te.float32_to_bf16(np.array([1.0, -2.5, 3.140625], dtype=np.float32))
        texts = ["héllo".encode(), b"", b"\x00\xff"]
        msg = infer_request(
            "echo",
            inputs=[
                ("text", "BYTES", [3], raw_bytes(*texts)),
                ("hidden", "FP16", [2, 4], hidden.astype("<f2").tobytes()),
                ("audio", "INT16", [5], audio.astype("<i2").tobytes()),
                ("bits", "BF16", [3], bits.astype("<u2").tobytes()),
            ],
            max_tokens=8,
        )
        resp = self.stub.ModelInfer(msg, timeout=WAIT)
        self.assertEqual((resp.model_name, resp.model_version, resp.id), ("probe", "7", "r"))
        self.assertNotIn("triton_final_response", resp.parameters)
        self.assertEqual(params(resp)["seen"], "max_tokens,mode")
        out = outputs_of(resp)
        self.assertEqual(split_bytes(out["text"][2]), texts)
        self.assertEqual(out["text"][:2], ("BYTES", [3]))
        self.assertEqual(out["hidden"][:2], ("FP16", [2, 4]))
        np.testing.assert_array_equal(np.frombuffer(out["hidden"][2], "<f2").reshape(2, 4), hidden)
        self.assertEqual(out["audio"][:2], ("INT16", [5]))
        np.testing.assert_array_equal(np.frombuffer(out["audio"][2], "<i2"), audio)
        self.assertEqual(out["audio"][3]["sample_rate"].int64_param, 16000)
        got_bits = np.frombuffer(out["bits"][2], "<u2")
        np.testing.assert_array_equal(te.bf16_to_float32(got_bits.copy()), [1.0, -2.5, 3.140625])

    def test_infer_typed_contents(self):
        msg = pb.ModelInferRequest(model_name="probe", id="typed")
        msg.parameters["mode"].string_param = "echo"
        t = msg.inputs.add(name="audio", datatype="INT16", shape=[3])
        t.contents.int_contents.extend([1, -2, 3])
        t = msg.inputs.add(name="text", datatype="BYTES", shape=[1])
        t.contents.bytes_contents.append(b"hi")
        out = outputs_of(self.stub.ModelInfer(msg, timeout=WAIT))
        np.testing.assert_array_equal(np.frombuffer(out["audio"][2], "<i2"), [1, -2, 3])
        self.assertEqual(split_bytes(out["text"][2]), [b"hi"])

    def test_infer_requested_outputs(self):
        msg = infer_request("count", n=1)
        msg.outputs.add(name="index")
        out = outputs_of(self.stub.ModelInfer(msg, timeout=WAIT))
        self.assertEqual(list(out), ["index"])

    def test_infer_gives_finish_reason(self):
        resp = self.stub.ModelInfer(infer_request("count", n=1), timeout=WAIT)
        self.assertEqual(params(resp), {"finish_reason": "length"})
        self.assertEqual(np.frombuffer(outputs_of(resp)["index"][2], "<i8").tolist(), [0])

    def test_infer_refuses_many_responses(self):
        with self.assertRaises(grpc.RpcError) as e:
            self.stub.ModelInfer(infer_request("count", n=2), timeout=WAIT)
        self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("use ModelStreamInfer", e.exception.details())

    def test_infer_engine_failure(self):
        with self.assertRaises(grpc.RpcError) as e:
            self.stub.ModelInfer(infer_request("fail"), timeout=WAIT)
        self.assertEqual(e.exception.code(), grpc.StatusCode.INTERNAL)
        self.assertEqual(e.exception.details(), "ValueError: boom")

    def test_invalid_requests(self):
        cases = [
            ("size", infer_request("echo", inputs=[("hidden", "FP16", [1, 4], b"\x00" * 6)]),
             "raw contents hold 6 bytes; shape [1, 4] of FP16 needs 8"),
            ("datatype", infer_request("echo", inputs=[("hidden", "FP32", [1, 4], b"\x00" * 16)]),
             "datatype FP32, the model takes FP16"),
            ("shape", infer_request("echo", inputs=[("hidden", "FP16", [2, 3], b"\x00" * 12)]),
             "shape [2, 3] does not fit the declared [-1, 4]"),
            ("unknown input", infer_request("echo", inputs=[("nope", "INT32", [1], b"\x00" * 4)]),
             "has no input 'nope'"),
            ("bytes length", infer_request("echo", inputs=[("text", "BYTES", [1], struct.pack("<I", 9) + b"abc")]),
             "BYTES element 0 says 9 bytes, 3 are left"),
            ("bytes count", infer_request("echo", inputs=[("text", "BYTES", [2], raw_bytes(b"a"))]),
             "BYTES contents end in element 1 of 2"),
            ("bytes left over", infer_request("echo", inputs=[("text", "BYTES", [1], raw_bytes(b"a", b"b"))]),
             "5 bytes left over"),
            ("engine", infer_request("invalid"), "the engine refuses this"),
        ]
        for what, msg, want in cases:
            with self.subTest(what):
                with self.assertRaises(grpc.RpcError) as e:
                    self.stub.ModelInfer(msg, timeout=WAIT)
                self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
                self.assertIn(want, e.exception.details())
        msg = infer_request("echo")
        msg.model_name = "other"
        with self.assertRaises(grpc.RpcError) as e:
            self.stub.ModelInfer(msg, timeout=WAIT)
        self.assertIn("unknown model 'other'", e.exception.details())
        msg = infer_request("echo", inputs=[("audio", "INT16", [1], b"\x00\x00")])
        msg.raw_input_contents.append(b"")
        with self.assertRaises(grpc.RpcError) as e:
            self.stub.ModelInfer(msg, timeout=WAIT)
        self.assertIn("2 raw_input_contents for 1 inputs", e.exception.details())

    def test_bad_outputs_are_errors(self):
        for mode, want in [
            ("undeclared", "output 'nope', which model 'probe' does not declare"),
            ("float_to_int", "a float64 array cannot be INT32"),
        ]:
            with self.subTest(mode):
                with self.assertRaises(grpc.RpcError) as e:
                    self.stub.ModelInfer(infer_request(mode), timeout=WAIT)
                self.assertEqual(e.exception.code(), grpc.StatusCode.INTERNAL)
                self.assertIn(want, e.exception.details())

    # ---- ModelStreamInfer ---------------------------------------------------

    def stream(self, *msgs):
        return list(self.stub.ModelStreamInfer(iter(msgs), timeout=WAIT))

    def test_stream_responses_then_final(self):
        got = self.stream(infer_request("count", rid="a", n=3))
        self.assertEqual([g.error_message for g in got], [""] * 4)
        resps = [g.infer_response for g in got]
        for i, r in enumerate(resps[:3]):
            self.assertEqual(params(r), {"triton_final_response": False})
            self.assertEqual(np.frombuffer(outputs_of(r)["index"][2], "<i8").tolist(), [i])
            self.assertEqual(split_bytes(outputs_of(r)["text"][2]), [f"a:{i}".encode()])
            self.assertEqual((r.model_name, r.model_version, r.id), ("probe", "7", "a"))
        final = resps[3]
        self.assertEqual(params(final), {"triton_final_response": True, "finish_reason": "length"})
        self.assertEqual(len(final.outputs), 0)
        self.assertEqual(final.id, "a")

    def test_stream_two_requests_in_order(self):
        got = self.stream(infer_request("count", rid="a", n=2), infer_request("count", rid="b", n=1))
        seen = [(g.infer_response.id, params(g.infer_response)["triton_final_response"]) for g in got]
        self.assertEqual(seen, [("a", False), ("a", False), ("a", True), ("b", False), ("b", True)])

    def test_stream_error_then_next_request(self):
        got = self.stream(
            infer_request("fail", rid="x"),
            infer_request("echo", rid="bad", inputs=[("audio", "INT16", [2], b"\x00")]),
            infer_request("count", rid="y", n=1),
        )
        self.assertEqual(got[0].error_message, "")
        self.assertEqual(got[1].error_message, "ValueError: boom")
        self.assertEqual(got[1].infer_response.id, "x")
        self.assertIn("raw contents hold 1 bytes", got[2].error_message)
        self.assertEqual(got[2].infer_response.id, "bad")
        self.assertEqual([g.infer_response.id for g in got[3:]], ["y", "y"])
        self.assertTrue(params(got[4].infer_response)["triton_final_response"])

    def test_cancel_reaches_generator(self):
        feed = Feed()
        call = self.stub.ModelStreamInfer(iter(feed), timeout=WAIT)
        feed.send(infer_request("block", rid="c"))
        first = next(call)
        self.assertEqual(first.infer_response.id, "c")
        self.assertTrue(self.engine.started.wait(WAIT))
        call.cancel()
        feed.close()
        self.assertEqual(self.event(), ("cancelled", True))
        # The server closes the generator at the yield after the wait: it
        # never resumes past it.
        self.assertEqual(self.event(), ("closed", "c"))
        self.assertTrue(self.engine.events.empty())

    def test_cancel_closes_a_generator_that_ignores_it(self):
        feed = Feed()
        call = self.stub.ModelStreamInfer(iter(feed), timeout=WAIT)
        feed.send(infer_request("spin", rid="s"))
        next(call)
        self.assertTrue(self.engine.started.wait(WAIT))
        call.cancel()
        feed.close()
        self.assertEqual(self.event(), ("closed", "s"))

    def test_stream_ends_without_requests(self):
        self.assertEqual(self.stream(), [])


class Plain(te.Engine):
    """generate as a plain function: its one response, or None (a mistake)."""

    name = "plain"
    inputs = [te.TensorSpec("x", "INT32", [-1])]
    outputs = [te.TensorSpec("y", "INT64", [-1])]

    def generate(self, request):
        x = request.inputs["x"]
        if x.size == 0:
            return None
        return {"y": x * 2}


class ServerTest(unittest.TestCase):
    def test_plain_generate(self):
        server = te.start(Plain(), "127.0.0.1:0")
        channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
        try:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)

            def msg(values):
                m = pb.ModelInferRequest(model_name="plain", id="p")
                m.inputs.add(name="x", datatype="INT32", shape=[len(values)])
                m.raw_input_contents.append(np.array(values, "<i4").tobytes())
                return m

            got = list(stub.ModelStreamInfer(iter([msg([1, -2]), msg([])]), timeout=WAIT))
            self.assertEqual(np.frombuffer(got[0].infer_response.raw_output_contents[0], "<i8").tolist(), [2, -4])
            self.assertTrue(params(got[1].infer_response)["triton_final_response"])
            self.assertIn("generate returned None", got[2].error_message)
            self.assertEqual(len(got), 3)
        finally:
            channel.close()
            server.stop()

    def test_tcp_and_stop_cancels(self):
        engine = Probe()
        server = te.start(engine, "127.0.0.1:0")
        self.assertGreater(server.port, 0)
        channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
        try:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            feed = Feed()
            call = stub.ModelStreamInfer(iter(feed), timeout=WAIT)
            feed.send(infer_request("block", rid="t"))
            next(call)
            self.assertTrue(engine.started.wait(WAIT))
            server.stop(0)
            feed.close()
            self.assertEqual(engine.events.get(timeout=WAIT), ("cancelled", True))
            self.assertEqual(engine.events.get(timeout=WAIT), ("closed", "t"))
        finally:
            channel.close()
            server.stop()

    def test_bad_address(self):
        with self.assertRaises(OSError):
            te.start(Probe(), "unix:///nonexistent-dir-troupe/engine.sock")

    def test_refuses_a_live_socket(self):
        d = tempfile.mkdtemp(prefix="troupe_engine_")
        try:
            addr = "unix://" + os.path.join(d, "engine.sock")
            first = te.start(Probe(), addr)
            try:
                with self.assertRaises(OSError) as e:
                    te.start(Probe(), addr)
                self.assertIn("a server is listening there", str(e.exception))
            finally:
                first.stop()
            te.start(Probe(), addr).stop()  # the path is free again
        finally:
            shutil.rmtree(d, ignore_errors=True)

    def test_engine_needs_metadata(self):
        with self.assertRaises(ValueError):
            te.start(te.Engine(), "127.0.0.1:0")

    def test_bf16(self):
        values = np.array([0.0, 1.0, -2.5, 1e-3, 3e38, np.inf, -np.inf], dtype=np.float32)
        bits = te.float32_to_bf16(values)
        self.assertEqual(bits.dtype, np.uint16)
        back = te.bf16_to_float32(bits)
        np.testing.assert_allclose(back[:5], values[:5], rtol=2 ** -8)
        self.assertEqual(back[5], np.inf)
        self.assertEqual(back[6], -np.inf)
        self.assertTrue(np.isnan(te.bf16_to_float32(te.float32_to_bf16(np.array([np.nan], np.float32))))[0])
        # 1 + 2**-8 lies halfway between two bfloat16s: ties to even (1.0).
        self.assertEqual(te.bf16_to_float32(te.float32_to_bf16(np.array([1 + 2 ** -8], np.float32)))[0], 1.0)


if __name__ == "__main__":
    unittest.main()
