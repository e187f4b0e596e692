#!/usr/bin/python3
"""The omni_numpy pipeline chained in one process, without gRPC: the
reference troupe's output is compared with.

    omni_chain.py --prompt TEXT [--max-tokens N] [--width W] [--seed N]
                  [--sample-rate HZ] --out-pcm FILE [--out-text FILE]

Runs omni_numpy's Thinker on the prompt (as its text input: the same
prompt as a chat whose last user message is TEXT), gives every hidden
state it yields to the Talker at once and every code to the Vocoder at
once, and writes the audio as raw PCM16 little-endian mono at the sample
rate, and the text. Prints one line: tokens, finish reason, codes, samples.
"""

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import omni_numpy as omni  # noqa: E402

te = omni.te


def _outputs(items):
    """The (outputs, parameters) of each item generate yields."""
    for item in items:
        if isinstance(item, te.Response):
            yield item.outputs, item.parameters
        else:
            yield item, {}


def chain(prompt, max_tokens=omni.DEFAULT_MAX_TOKENS, width=omni.DEFAULT_WIDTH, seed=0,
          sample_rate=omni.DEFAULT_SAMPLE_RATE):
    """(text, finish_reason, hidden FP16 [n, width], codes INT32, audio INT16)."""
    thinker = omni.Thinker(width=width, seed=seed)
    talker = omni.Talker(width=width, seed=seed)
    vocoder = omni.Vocoder(sample_rate=sample_rate)

    text, rows, finish = [], [], None
    request = te.Request(
        inputs={"text": np.array([prompt.encode("utf-8")], dtype=object)},
        parameters={"max_tokens": max_tokens},
    )
    for outputs, params in _outputs(thinker.generate(request)):
        if "text" in outputs:
            text.append(outputs["text"].reshape(-1)[0].decode("utf-8"))
        if "hidden" in outputs:
            rows.append(outputs["hidden"])
        finish = params.get("finish_reason", finish)
    hidden = np.concatenate(rows) if rows else np.zeros((0, width), np.float16)

    codes = [o["codes"] for o, _ in _outputs(talker.generate(te.Request(inputs={"hidden": hidden})))]
    codes = np.concatenate(codes) if codes else np.zeros(0, np.int32)

    audio = [o["audio"] for o, _ in _outputs(vocoder.generate(te.Request(inputs={"codes": codes})))]
    audio = np.concatenate(audio) if audio else np.zeros(0, np.int16)
    return "".join(text), finish, hidden, codes, audio


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=omni.DEFAULT_MAX_TOKENS)
    p.add_argument("--width", type=int, default=omni.DEFAULT_WIDTH)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample-rate", type=int, default=omni.DEFAULT_SAMPLE_RATE)
    p.add_argument("--out-pcm", required=True, help="raw PCM16 LE mono")
    p.add_argument("--out-text", help="the text, UTF-8")
    args = p.parse_args(argv)
    text, finish, hidden, codes, audio = chain(args.prompt, args.max_tokens, args.width, args.seed, args.sample_rate)
    with open(args.out_pcm, "wb") as f:
        f.write(audio.astype("<i2").tobytes())
    if args.out_text:
        with open(args.out_text, "w", encoding="utf-8") as f:
            f.write(text)
    print(f"tokens={hidden.shape[0]} finish_reason={finish} codes={codes.size} samples={audio.size} "
          f"sample_rate={args.sample_rate}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
