"""Per-stage costs of one request on the runners, in process (`omnistage bench stage-times`):
thinker prefill per prompt token, thinker decode per token, talker per frame (talker step +
code predictor), code2wav per second of audio. Median over repetitions."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import machine_info, write_json
from omnistage.families.qwen3_omni import SAMPLE_RATE
from services.runtime.sampling import SamplingParams
from services.talker.session import TalkerSession

PROMPT = (
    "Can you explain how streaming works? Streaming means the first sound starts before the whole answer "
    "is ready, so the listener does not have to wait for the model to finish."
)


def measure(model_dir: Path | None = None, reps: int = 5, decode_tokens: int = 32, frames: int = 40) -> dict[str, Any]:
    from omnistage.pipeline import InProcessPipeline
    from omnistage.serve import default_model_dir

    torch.set_num_threads(1)
    pipe = InProcessPipeline(model_dir or default_model_dir())
    ids = pipe.prompt_ids(PROMPT)
    never = (pipe.spec.tts_pad_id,)  # a stop id the thinker does not produce: fixed lengths
    thinker = pipe.thinker_defaults().with_overrides(max_tokens=decode_tokens + 1, stop_ids=never)
    talker = SamplingParams(max_tokens=frames + 1, stop_ids=(-1,))  # no codec EOS: exactly `frames`
    prefill, decode, talk, c2w = [], [], [], []
    for _ in range(reps + 1):  # the first round warms up
        req = pipe.thinker.new_request(ids, thinker)
        t0 = time.perf_counter()
        prompt, tok = pipe.thinker.prefill(req)
        prefill.append((time.perf_counter() - t0) / len(ids))
        tokens = [tok]
        t0 = time.perf_counter()
        while not tok.is_last:
            tok = pipe.thinker.decode(req)
            tokens.append(tok)
        decode.append((time.perf_counter() - t0) / (len(tokens) - 1))
        pipe.thinker.release(req)

        session = TalkerSession(pipe.talker, talker, "ethan")
        session.set_prompt(prompt.ids, prompt.embeds, prompt.hidden)
        for t in tokens:
            session.add_token(t.embed, t.is_last)
        out = []
        t0 = time.perf_counter()
        while session.can_progress():
            frame = session.step()
            if frame is not None:
                out.append(frame)
        talk.append((time.perf_counter() - t0) / len(out))
        session.close()

        codes = torch.stack(out, dim=1)
        t0 = time.perf_counter()
        wav = pipe.code2wav.decode(codes)
        c2w.append((time.perf_counter() - t0) / (wav.shape[0] / SAMPLE_RATE))
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
