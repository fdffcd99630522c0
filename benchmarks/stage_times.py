"""Per-stage costs of one request on the model parts, in process (`omnistage bench stage-times`):
thinker prefill per prompt token, thinker decode per token, talker per frame (talker step +
code predictor), code2wav per second of audio. Median over repetitions."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import machine_info, write_json
from omnistage.models.sampling import SamplingParams

PROMPT = (
    "Can you explain how streaming works? Streaming means the first sound starts before the whole answer "
    "is ready, so the listener does not have to wait for the model to finish."
)


def measure(model_dir: Path | None = None, reps: int = 5, decode_tokens: int = 32, frames: int = 40) -> dict[str, Any]:
    from omnistage.cli.serve import default_model_dir
    from services.pipeline import InProcessPipeline

    torch.set_num_threads(1)
    pipe = InProcessPipeline(model_dir or default_model_dir())
    ids = pipe.prompt_ids(PROMPT)
    never = (pipe.spec.tts_pad_id,)  # a stop id the thinker does not produce: fixed lengths
    thinker = pipe.thinker_defaults().with_overrides(max_tokens=decode_tokens + 1, stop_ids=never)
    talker = SamplingParams(max_tokens=frames + 1, stop_ids=(-1,))  # no codec EOS: exactly `frames`
    prefill, decode, talk, c2w = [], [], [], []
    rate = pipe.checkpoint.sample_rate
    for _ in range(reps + 1):  # the first round warms up
        state = pipe.thinker.new_state(thinker)
        pipe.thinker.set_prompt(state, ids)
        t0 = time.perf_counter()
        (first,) = pipe.thinker.step([(state, 0, len(ids))])
        prefill.append((time.perf_counter() - t0) / len(ids))
        prompt, tokens = first.prompt, [first.token]
        t0 = time.perf_counter()
        while not tokens[-1].is_last:
            (step,) = pipe.thinker.step([(state, len(ids) + len(tokens) - 1, 1)])
            tokens.append(step.token)
        decode.append((time.perf_counter() - t0) / (len(tokens) - 1))
        pipe.thinker.release(state)

        talk_state = pipe.talker.new_state(talker, pipe.spec.default_speaker)
        pipe.talker.set_prompt(talk_state, prompt.ids, prompt.embeds, prompt.hidden, prompt.rope.tensors())
        for t in tokens:
            talk_state.add_token(t.embed, t.is_last, t.hidden)
        out = []
        t0 = time.perf_counter()
        while talk_state.can_step(True):
            (frame,) = pipe.talker.step([(talk_state, True)])
            if frame is not None:
                out.append(frame)
        talk.append((time.perf_counter() - t0) / len(out))
        pipe.talker.release(talk_state)

        codes = torch.stack(out, dim=1)
        t0 = time.perf_counter()
        wav = pipe.code2wav.decode(codes)
        c2w.append((time.perf_counter() - t0) / (wav.shape[0] / rate))
    med = {k: statistics.median(v[1:]) for k, v in
           {"thinker_prefill_s_per_token": prefill, "thinker_decode_s_per_token": decode,
            "talker_s_per_frame": talk, "code2wav_s_per_audio_second": c2w}.items()}
    return {"median": med, "prompt_tokens": len(ids), "decode_tokens": decode_tokens, "frames": frames,
            "reps": reps, "machine": machine_info()}


def main(json_out: Path | None = None, model_dir: Path | None = None) -> dict[str, Any]:
    res = measure(model_dir)
    for k, v in res["median"].items():
        print(f"{k:<32} {v * 1000:8.2f} ms")
    print(f"(median of {res['reps']}, prompt {res['prompt_tokens']} tokens, {res['decode_tokens']} decoded, "
          f"{res['frames']} frames, torch threads 1)")
    write_json(json_out, res)
    return res
