"""The omni_numpy example pipeline: segmentation, determinism, and the same
audio over the Open Inference Protocol as chained in one process."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import grpc
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(HERE, "..", "examples")
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, EXAMPLES)

import omni_chain  # noqa: E402
import omni_numpy as omni  # noqa: E402
import troupe_engine as te  # noqa: E402
from troupe_engine._oip import grpc_service_pb2 as pb  # noqa: E402
from troupe_engine._oip import grpc_service_pb2_grpc as pb_grpc  # noqa: E402

WAIT = 30
WIDTH = omni.DEFAULT_WIDTH


def run(engine, **inputs):
    """The outputs of engine.generate, concatenated by name, and the last
    finish_reason."""
    parts, finish = {}, None
    for item in engine.generate(te.Request(inputs=inputs.get("inputs", {}), parameters=inputs.get("parameters", {}))):
        outputs = item.outputs if isinstance(item, te.Response) else item
        if isinstance(item, te.Response):
            finish = item.parameters.get("finish_reason", finish)
        for k, v in outputs.items():
            parts.setdefault(k, []).append(v)
    return {k: np.concatenate(v) for k, v in parts.items()}, finish


def text_input(s):
    return np.array([s.encode()], dtype=object)


class OmniNumpyTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.thinker = omni.Thinker()
        cls.talker = omni.Talker()
        cls.vocoder = omni.Vocoder()
        cls.text, cls.finish, cls.hidden, cls.codes, cls.audio = omni_chain.chain("hello there", max_tokens=12)

    def test_chain_shapes(self):
        self.assertEqual(self.hidden.shape, (12, WIDTH))
        self.assertEqual(self.hidden.dtype, np.float16)
        self.assertEqual(self.finish, "length")
        self.assertEqual(len(self.text.split(" ")), 12)
        self.assertFalse(self.text.startswith(" "))
        self.assertEqual(self.codes.shape, (12 * omni.CODEBOOKS,))
        self.assertEqual(self.codes.dtype, np.int32)
        frame = omni.DEFAULT_SAMPLE_RATE * omni.FRAME_MS // 1000
        self.assertEqual(self.audio.shape, (self.codes.size * frame,))
        self.assertEqual(self.audio.dtype, np.int16)
        self.assertGreater(np.abs(self.audio).max(), 5000)

    def test_chain_is_deterministic(self):
        again = omni_chain.chain("hello there", max_tokens=12)
        self.assertEqual(again[0], self.text)
        for a, b in zip(again[2:], (self.hidden, self.codes, self.audio)):
            np.testing.assert_array_equal(a, b)
        other = omni_chain.chain("hello there!", max_tokens=12)
        self.assertNotEqual(other[0], self.text)
        self.assertFalse(np.array_equal(other[4], self.audio))

    def test_chain_command(self):
        d = tempfile.mkdtemp(prefix="omni_chain_")
        try:
            pcm, txt = os.path.join(d, "out.pcm"), os.path.join(d, "out.txt")
            out = subprocess.run(
                [sys.executable, os.path.join(EXAMPLES, "omni_chain.py"), "--prompt", "hello there",
                 "--max-tokens", "12", "--out-pcm", pcm, "--out-text", txt],
                capture_output=True, text=True, timeout=120,
            )
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn("tokens=12 finish_reason=length codes=24", out.stdout)
            with open(pcm, "rb") as f:
                self.assertEqual(f.read(), self.audio.astype("<i2").tobytes())
            with open(txt, encoding="utf-8") as f:
                self.assertEqual(f.read(), self.text)
        finally:
            shutil.rmtree(d, ignore_errors=True)

    def test_messages_prompt_is_last_user_message(self):
        chat = [
            {"role": "user", "content": "first question"},
            {"role": "assistant", "content": "an answer"},
            {"role": "user", "content": [{"type": "text", "text": "hello there"}]},
        ]
        got, _ = run(self.thinker, inputs={"messages": np.array([json.dumps(chat).encode()], dtype=object)},
                     parameters={"max_tokens": 12})
        np.testing.assert_array_equal(got["hidden"], self.hidden)

    def test_thinker_stops_at_the_end_token(self):
        for i in range(500):
            got, finish = run(self.thinker, inputs={"text": text_input(f"prompt {i}")}, parameters={"max_tokens": 16})
            if finish == "stop":
                self.assertGreater(got["hidden"].shape[0], 0)
                self.assertLess(got["hidden"].shape[0], 16)
                return
            self.assertEqual(finish, "length")
            self.assertEqual(got["hidden"].shape[0], 16)
        self.fail("no prompt of 500 drew the end token")

    def test_thinker_refuses_bad_input(self):
        for inputs, params, want in [
            ({}, {}, "give text or messages"),
            ({"messages": text_input("not json")}, {}, "messages: not JSON"),
            ({"messages": text_input('[{"role":"system","content":"x"}]')}, {}, "no user message"),
            ({"text": text_input("hi")}, {"max_tokens": -1}, "max_tokens"),
        ]:
            with self.subTest(want):
                with self.assertRaises(te.InvalidInput) as e:
                    run(self.thinker, inputs=inputs, parameters=params)
                self.assertIn(want, str(e.exception))

    def test_talker_segments_give_the_whole(self):
        whole, _ = run(self.talker, inputs={"hidden": self.hidden})
        np.testing.assert_array_equal(whole["codes"], self.codes)
        for cuts in ([1], [5], [3, 4, 11], list(range(1, 12))):
            with self.subTest(cuts=cuts):
                parts = [run(self.talker, inputs={"hidden": seg})[0]["codes"] for seg in np.split(self.hidden, cuts)]
                np.testing.assert_array_equal(np.concatenate(parts), self.codes)

    def test_vocoder_segments_give_the_whole(self):
        for cuts in ([1], [10], [3, 10, 17], list(range(1, self.codes.size))):
            with self.subTest(cuts=cuts):
                parts = [run(self.vocoder, inputs={"codes": seg})[0]["audio"] for seg in np.split(self.codes, cuts)]
                np.testing.assert_array_equal(np.concatenate(parts), self.audio)

    def test_a_changed_row_changes_the_codes(self):
        changed = self.hidden.copy()
        changed[3] = self.thinker.hidden(token=7, position=3)[0]
        self.assertFalse(np.array_equal(changed[3], self.hidden[3]))
        codes = self.talker.codes(changed)
        k = omni.CODEBOOKS
        self.assertFalse(np.array_equal(codes[3 * k:4 * k], self.codes[3 * k:4 * k]))
        np.testing.assert_array_equal(codes[:3 * k], self.codes[:3 * k])
        np.testing.assert_array_equal(codes[4 * k:], self.codes[4 * k:])
        self.assertFalse(np.array_equal(self.vocoder.audio(codes), self.audio))

    def test_reordered_rows_change_the_codes(self):
        swapped = self.hidden[[0, 1, 4, 3, 2] + list(range(5, 12))]
        self.assertFalse(np.array_equal(self.talker.codes(swapped), self.codes))

    def test_talker_and_vocoder_refuse_bad_input(self):
        with self.assertRaises(te.InvalidInput):
            self.talker.codes(np.full((1, WIDTH), np.inf, np.float16))
        with self.assertRaises(te.InvalidInput):
            self.vocoder.audio(np.array([omni.CODEBOOK_SIZE], np.int32))
        with self.assertRaises(te.InvalidInput):
            self.vocoder.audio(np.array([-1], np.int32))


def infer(model, rid, inputs, **parameters):
    msg = pb.ModelInferRequest(model_name=model, id=rid)
    for k, v in parameters.items():
        if isinstance(v, bool):
            msg.parameters[k].bool_param = v
        elif isinstance(v, int):
            msg.parameters[k].int64_param = v
        else:
            msg.parameters[k].string_param = v
    for name, (datatype, arr) in inputs.items():
        msg.inputs.add(name=name, datatype=datatype, shape=list(arr.shape))
        if datatype == "BYTES":
            msg.raw_input_contents.append(b"".join(len(b).to_bytes(4, "little") + b for b in arr.reshape(-1)))
        else:
            msg.raw_input_contents.append(arr.tobytes())
    return msg


def stream(stub, msg):
    """(responses with outputs, final response) of one request on a stream
    of its own, as troupe's worker sends it."""
    got = list(stub.ModelStreamInfer(iter([msg]), timeout=WAIT))
    for g in got:
        if g.error_message:
            raise AssertionError(g.error_message)
    resps = [g.infer_response for g in got]
    final = resps[-1]
    assert final.parameters["triton_final_response"].bool_param, final
    assert all(not r.parameters["triton_final_response"].bool_param for r in resps[:-1])
    return resps[:-1], final


def output(resp, name):
    for i, t in enumerate(resp.outputs):
        if t.name == name:
            return t, resp.raw_output_contents[i]
    raise KeyError(name)


class OverTheWireTest(unittest.TestCase):
    """The three stages served over unix sockets, fed the way troupe feeds
    them (the talker and the vocoder in segments with sequence
    parameters), give the chain's text and audio."""

    def test_served_pipeline_gives_the_chain(self):
        text, finish, hidden, codes, audio = omni_chain.chain("hello there", max_tokens=16)
        d = tempfile.mkdtemp(prefix="omni_numpy_")
        servers, channels = [], []
        try:
            stubs = {}
            for stage in ("thinker", "talker", "vocoder"):
                addr = "unix://" + os.path.join(d, stage + ".sock")
                servers.append(te.start(omni.make(stage), addr))
                channels.append(grpc.insecure_channel(addr))
                stubs[stage] = pb_grpc.GRPCInferenceServiceStub(channels[-1])

            md = stubs["talker"].ModelMetadata(pb.ModelMetadataRequest(name="talker"), timeout=WAIT)
            self.assertEqual([(t.name, t.datatype, list(t.shape)) for t in md.inputs], [("hidden", "FP16", [-1, WIDTH])])
            self.assertEqual([(t.name, t.datatype, list(t.shape)) for t in md.outputs], [("codes", "INT32", [-1])])

            chat = json.dumps([{"role": "user", "content": "hello there"}]).encode()
            resps, final = stream(stubs["thinker"], infer(
                "thinker", "req-1", {"messages": ("BYTES", np.array([chat], dtype=object))}, max_tokens=16))
            self.assertEqual(final.parameters["finish_reason"].string_param, finish)
            words, rows = [], []
            for r in resps:
                t, raw = output(r, "text")
                words.append(raw[4:].decode())
                t, raw = output(r, "hidden")
                self.assertEqual((t.datatype, list(t.shape)), ("FP16", [1, WIDTH]))
                rows.append(np.frombuffer(raw, "<f2").reshape(1, WIDTH))
            self.assertEqual("".join(words), text)
            got_hidden = np.concatenate(rows)
            np.testing.assert_array_equal(got_hidden, hidden)

            def segments(arr, size):
                n = len(arr)
                for i, at in enumerate(range(0, n, size)):
                    params = {"sequence_id": "req-1"}
                    if i == 0:
                        params["sequence_start"] = True
                    if at + size >= n:
                        params["sequence_end"] = True
                    yield arr[at:at + size], params

            got_codes = []
            for seg, params in segments(got_hidden, 3):
                resps, _ = stream(stubs["talker"], infer("talker", "req-1", {"hidden": ("FP16", seg)}, **params))
                got_codes += [np.frombuffer(output(r, "codes")[1], "<i4") for r in resps]
            got_codes = np.concatenate(got_codes)
            np.testing.assert_array_equal(got_codes, codes)

            got_audio = []
            for seg, params in segments(got_codes, 10):
                resps, _ = stream(stubs["vocoder"], infer("vocoder", "req-1", {"codes": ("INT32", seg)}, **params))
                for r in resps:
                    t, raw = output(r, "audio")
                    self.assertEqual(t.parameters["sample_rate"].int64_param, omni.DEFAULT_SAMPLE_RATE)
                    got_audio.append(raw)
            self.assertEqual(b"".join(got_audio), audio.astype("<i2").tobytes())
        finally:
            for c in channels:
                c.close()
            for s in servers:
                s.stop()
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    unittest.main()
