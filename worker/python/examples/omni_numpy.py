#!/usr/bin/python3
"""A real three-stage pipeline in numpy: thinker -> talker -> vocoder.

    omni_numpy.py --stage thinker|talker|vocoder --listen ADDR
                  [--width 2048] [--seed N] [--sample-rate 24000] [--model NAME]

Each stage is a troupe_engine.Engine served over the Open Inference
Protocol, for `troupe worker --engine oip --upstream ADDR --model NAME`
(NAME is the stage's name unless --model says otherwise).

thinker  in:  text BYTES [1] and/or messages BYTES [1] (JSON chat: the last
              user message's content is the prompt; messages wins over
              text); parameter max_tokens (int64, default 16).
         out: per token, text BYTES [1] (the word, with a leading space
              after the first) and hidden FP16 [1, width]; the last
              response gives finish_reason: stop at the end token, length
              at max_tokens.
         A toy decoder: its words are drawn by a generator seeded from the
         prompt's SHA-256 and --seed; hidden is the token's row of a seeded
         random embedding table plus a seeded random vector of its position.
talker   in:  hidden FP16 [-1, width] (troupe: input role tensors).
         out: codes INT32 [-1], CODEBOOKS codes per row, one response a row:
              the argmax, per codebook, of the row times a seeded random
              width x (CODEBOOKS * CODEBOOK_SIZE) projection.
vocoder  in:  codes INT32 [-1], each in [0, CODEBOOK_SIZE).
         out: audio INT16 [-1], output parameter sample_rate (int64): one
              FRAME_MS frame per code, a sine at the code's frequency, its
              phase reset each frame.

Every stage is a per-row (per-code) computation, so an input cut into
segments (troupe feeds the talker and the vocoder in segments, marked by
sequence_start/sequence_end, which these stages ignore) gives the same
output as the whole. The talker's arithmetic is exact (below), so the audio
is the same in any process on any machine with this numpy. omni_chain.py
runs the same classes chained in one process.
"""

import argparse
import hashlib
import json
import logging
import os
import sys

import numpy as np

try:
    import troupe_engine as te
except ImportError:  # run from the repository without PYTHONPATH
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import troupe_engine as te

DEFAULT_WIDTH = 2048
DEFAULT_MAX_TOKENS = 16
DEFAULT_SAMPLE_RATE = 24000
CODEBOOKS = 2
CODEBOOK_SIZE = 1024
FRAME_MS = 20

END = "<end>"
VOCAB = [END] + (
    "the a of and to in is it that was for on are with as he she they we you this "
    "by at from or had not but what all were when there can an which their said "
    "if do will each about how up out them then many some so these would other "
    "into has more her two like him see time could no make than first been its "
    "who now people my made over did down only way find use may water long little "
    "very after words called just where most know sound light voice river stone "
    "morning song"
).split()


def _seeded(*words):
    return np.random.default_rng([int(w) for w in words])


def prompt_of(request):
    """The prompt: the last user message of messages, else text."""
    msgs = request.inputs.get("messages")
    if msgs is not None:
        if msgs.size != 1:
            raise te.InvalidInput(f"messages: want one element, got shape {list(msgs.shape)}")
        try:
            chat = json.loads(msgs.reshape(-1)[0])
        except ValueError as e:
            raise te.InvalidInput(f"messages: not JSON: {e}") from e
        if not isinstance(chat, list):
            raise te.InvalidInput("messages: want a JSON array of {role, content}")
        for m in reversed(chat):
            if isinstance(m, dict) and m.get("role") == "user":
                content = m.get("content", "")
                if isinstance(content, list):  # parts: the text ones
                    content = " ".join(
                        p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
                    )
                if not isinstance(content, str):
                    raise te.InvalidInput("messages: a user message's content is not text")
                return content
        raise te.InvalidInput("messages: no user message")
    text = request.inputs.get("text")
    if text is None:
        raise te.InvalidInput("give text or messages")
    if text.size != 1:
        raise te.InvalidInput(f"text: want one element, got shape {list(text.shape)}")
    try:
        return text.reshape(-1)[0].decode("utf-8")
    except UnicodeDecodeError as e:
        raise te.InvalidInput(f"text: not UTF-8: {e}") from e


class Thinker(te.Engine):
    platform = "troupe_engine/omni_numpy"

    def __init__(self, width=DEFAULT_WIDTH, seed=0, delay_ms=0, name="thinker"):
        self.name = name
        self.width = width
        self.seed = seed
        self.delay = delay_ms / 1000.0
        self.inputs = [
            te.TensorSpec("text", "BYTES", [1], optional=True),
            te.TensorSpec("messages", "BYTES", [1], optional=True),
        ]
        self.outputs = [
            te.TensorSpec("text", "BYTES", [1]),
            te.TensorSpec("hidden", "FP16", [-1, width]),
        ]
        self.embed = _seeded(seed, 1).standard_normal((len(VOCAB), width), dtype=np.float32)

    def hidden(self, token, position):
        """The hidden state of token at position: FP16 [1, width]."""
        pos = _seeded(self.seed, 2, position).standard_normal(self.width, dtype=np.float32)
        return (self.embed[token] + np.float32(0.25) * pos).astype(np.float16)[None, :]

    def tokens(self, prompt):
        """The token ids the toy decoder draws for prompt, endlessly."""
        digest = hashlib.sha256(prompt.encode("utf-8")).digest()
        rng = _seeded(self.seed, 3, int.from_bytes(digest[:8], "little"))
        first = True
        while True:
            # The first token is never the end: an answer has a word.
            yield int(rng.integers(1 if first else 0, len(VOCAB)))
            first = False

    def generate(self, request):
        prompt = prompt_of(request)
        max_tokens = request.parameters.get("max_tokens", DEFAULT_MAX_TOKENS)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
            raise te.InvalidInput(f"max_tokens: want an integer >= 0, got {max_tokens!r}")
        finish = "length"
        for position, token in enumerate(self.tokens(prompt)):
            if position >= max_tokens:
                break
            if token == 0:
                finish = "stop"
                break
            if self.delay and request.cancelled.wait(self.delay):
                return
            word = VOCAB[token] if position == 0 else " " + VOCAB[token]
            yield {
                "text": np.array([word.encode("utf-8")], dtype=object),
                "hidden": self.hidden(token, position),
            }
        yield te.Response(parameters={"finish_reason": finish})


class Talker(te.Engine):
    platform = "troupe_engine/omni_numpy"

    def __init__(self, width=DEFAULT_WIDTH, seed=0, name="talker"):
        if not 0 < width <= 1 << 14:
            raise ValueError(f"width {width}: want 1..16384 (above, the codes' arithmetic is no longer exact)")
        self.name = name
        self.width = width
        self.inputs = [te.TensorSpec("hidden", "FP16", [-1, width])]
        self.outputs = [te.TensorSpec("codes", "INT32", [-1])]
        # Integer weights held as float64: with the rows quantised to
        # integers (codes), every product and every partial sum is an
        # integer below 2**53, so the product is exact whatever the BLAS's
        # order of summation: the same codes in any process, for any
        # segmentation.
        self.weights = (
            _seeded(seed, 4).integers(-127, 128, size=(width, CODEBOOKS * CODEBOOK_SIZE)).astype(np.float64)
        )

    def codes(self, hidden):
        """The codes of hidden FP16 [n, width]: INT32 [n * CODEBOOKS]."""
        hidden = np.asarray(hidden)
        if hidden.ndim != 2 or hidden.shape[1] != self.width:
            raise te.InvalidInput(f"hidden: want [n, {self.width}], got {list(hidden.shape)}")
        if hidden.dtype != np.float16:
            raise te.InvalidInput(f"hidden: want float16, got {hidden.dtype}")
        x = hidden.astype(np.float64)
        if not np.isfinite(x).all():
            raise te.InvalidInput("hidden: a value is not finite")
        # |x| <= 65504: x * 2**16 rounds to an integer below 2**32; times a
        # weight below 2**7, summed over width <= 2**14 terms: below 2**53.
        q = np.rint(x * 65536.0)
        logits = q @ self.weights
        n = hidden.shape[0]
        return logits.reshape(n, CODEBOOKS, CODEBOOK_SIZE).argmax(axis=2).astype(np.int32).reshape(-1)

    def generate(self, request):
        codes = self.codes(request.inputs["hidden"])
        for row in range(request.inputs["hidden"].shape[0]):
            yield {"codes": codes[row * CODEBOOKS:(row + 1) * CODEBOOKS]}


class Vocoder(te.Engine):
    platform = "troupe_engine/omni_numpy"

    def __init__(self, sample_rate=DEFAULT_SAMPLE_RATE, name="vocoder"):
        if sample_rate <= 0 or sample_rate * FRAME_MS % 1000:
            raise ValueError(f"sample rate {sample_rate}: want a positive multiple of {1000 // FRAME_MS}")
        self.name = name
        self.sample_rate = sample_rate
        self.inputs = [te.TensorSpec("codes", "INT32", [-1])]
        self.outputs = [te.TensorSpec("audio", "INT16", [-1])]
        frame = sample_rate * FRAME_MS // 1000
        top = min(4000.0, 0.45 * sample_rate)
        freqs = 100.0 + np.arange(CODEBOOK_SIZE) * ((top - 100.0) / CODEBOOK_SIZE)
        n = np.arange(frame)
        # A 2 ms fade in and out: the phase resets at every frame.
        ramp = max(1, sample_rate // 500)
        env = np.minimum(1.0, np.minimum(n + 1, frame - n) / ramp)
        wave = 0.3 * 32767 * env * np.sin(2 * np.pi * freqs[:, None] * n[None, :] / sample_rate)
        self.frames = np.rint(wave).astype(np.int16)  # [CODEBOOK_SIZE, frame]

    def audio(self, codes):
        """The PCM16 of codes INT32 [n]: INT16 [n * frame]."""
        codes = np.asarray(codes).reshape(-1)
        if codes.size and (codes.min() < 0 or codes.max() >= CODEBOOK_SIZE):
            raise te.InvalidInput(f"codes: want each in [0, {CODEBOOK_SIZE}), got {codes.min()}..{codes.max()}")
        return self.frames[codes.astype(np.intp)].reshape(-1)

    def generate(self, request):
        codes = request.inputs["codes"]
        if codes.size:
            yield te.Response(
                outputs={"audio": self.audio(codes)},
                tensor_parameters={"audio": {"sample_rate": self.sample_rate}},
            )


def make(stage, width=DEFAULT_WIDTH, seed=0, sample_rate=DEFAULT_SAMPLE_RATE, delay_ms=0, name=None):
    """The engine of stage (thinker, talker or vocoder)."""
    name = name or stage
    if stage == "thinker":
        return Thinker(width=width, seed=seed, delay_ms=delay_ms, name=name)
    if stage == "talker":
        return Talker(width=width, seed=seed, name=name)
    if stage == "vocoder":
        return Vocoder(sample_rate=sample_rate, name=name)
    raise ValueError(f"unknown stage {stage!r}: want thinker, talker or vocoder")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", required=True, choices=["thinker", "talker", "vocoder"])
    p.add_argument("--listen", required=True, help="unix:///path/engine.sock or host:port")
    p.add_argument("--width", type=int, default=DEFAULT_WIDTH, help="hidden state width (thinker, talker)")
    p.add_argument("--seed", type=int, default=0, help="the model's seed (thinker, talker)")
    p.add_argument("--sample-rate", type=int, default=DEFAULT_SAMPLE_RATE, help="vocoder output rate, Hz")
    p.add_argument("--model", default=None, help="the OIP model name (default: the stage)")
    p.add_argument("--delay-ms", type=float, default=0, help="thinker: wait this long before each token")
    p.add_argument("--max-workers", type=int, default=64, help="calls at once")
    args = p.parse_args(argv)
    if args.width <= 0 or args.seed < 0:
        p.error("--width must be positive and --seed not negative")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = make(args.stage, args.width, args.seed, args.sample_rate, args.delay_ms, args.model)
    return te.serve(engine, args.listen, max_workers=args.max_workers)


if __name__ == "__main__":
    sys.exit(main())
