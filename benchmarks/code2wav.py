"""code2wav streaming benchmark: ``omnistage bench code2wav [--json FILE]``.

30 s of audio (375 codec frames at 12.5 frames/s) decoded three ways on one code2wav model
with the real upsampling (1920 samples per frame):

* ``full``: one ``Qwen3OmniMoeCode2Wav.forward`` over all frames (the baseline);
* ``exact``: the incremental decoder (services/code2wav/streaming.py), 25 new frames per step;
* ``windowed``: 25 new frames per chunk, each decoded from scratch with 25 frames of left
  context whose samples are dropped (what other stacks do).

Reported: median total compute time of each over several runs, the ratios
against each other from the same run, and each stream's max |Δ| against the full decode, next
to the full decode's own fp32 rounding error (fp32 vs float64), which is the floor any fp32
method can reach.  Without a checkpoint the model is built from ``tiny_code2wav_config()``
(hidden 32, 2 pre-transformer layers, the real sliding window 72, decoder_dim 64) with seeded
random weights scaled so the waveform is O(0.3) and not clamped.

``OMNISTAGE_BENCH_THREADS=N`` sets torch's intra-op threads (default: torch's own choice).
"""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path
from typing import Any

import torch
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

from benchmarks.common import machine_info, timed_median, write_json
from omnistage.models.qwen3_omni.code2wav_streaming import (
    IncrementalCode2Wav,
    exact_decode_stream,
    full_decode,
    place_windowed_chunks,
    tiny_code2wav_config,
    windowed_decode_stream,
)

FRAMES = 375  # 30 s at 12.5 frames/s
CHUNK_FRAMES = 25
LEFT_CONTEXT_FRAMES = 25
REPS = 5
SEED = 0
WEIGHT_GAIN = 0.7


def random_code2wav(seed: int = SEED, gain: float = WEIGHT_GAIN) -> Qwen3OmniMoeCode2Wav:
    """The tiny code2wav model with seeded random weights that give a non-trivial waveform.

    The library init (std 0.02, zero gammas) makes ~1e-7 output, useless for measuring
    differences; every matrix gets std ``gain/sqrt(fan_in)`` instead (0.7 stays below the
    gain where the full decode's own fp32 error explodes), layer scales/gammas 0.5, SnakeBeta
    log-parameters N(0, 0.3), and the last conv x10.
    """
    torch.manual_seed(seed)
    model = Qwen3OmniMoeCode2Wav(tiny_code2wav_config()).eval()
    scale_weights(model, gain)
    return model


def scale_weights(model: Qwen3OmniMoeCode2Wav, gain: float) -> None:
    """Re-draw weights so the waveform is O(0.1-1) but not saturated (library init gives ~1e-7):
    every matrix std gain/sqrt(fan_in), layer scales/gammas 0.5, SnakeBeta log-params N(0, 0.3),
    last conv x10. Used by the benchmark and the streaming tests."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, gain / p[0].numel() ** 0.5)
            elif name.endswith("gamma") or name.endswith(".scale"):
                p.fill_(0.5)
            elif name.endswith("alpha") or name.endswith("beta"):
                p.normal_(0.0, 0.3)
        model.decoder[-1].conv.weight.mul_(10.0)


def _load(checkpoint: Path | None) -> tuple[Qwen3OmniMoeCode2Wav, str]:
    if checkpoint is None:
        return random_code2wav(), "tiny_code2wav_config() with seeded random weights"
    from omnistage.models.checkpoint import load_part, open_checkpoint

    model = load_part(open_checkpoint(checkpoint), "code2wav", dtype="float32")
    return model, str(checkpoint)


def run(checkpoint: Path | None = None, reps: int = REPS) -> dict[str, Any]:
    t_start = time.perf_counter()
    model, source = _load(checkpoint)
    cfg = model.config
    gen = torch.Generator().manual_seed(SEED + 1)
    codes = torch.randint(0, cfg.codebook_size, (cfg.num_quantizers, FRAMES), generator=gen)
    dec = IncrementalCode2Wav(model)

    full_s, full_runs, ref = timed_median(lambda: full_decode(model, codes), reps)
    exact_s, exact_runs, exact_pieces = timed_median(lambda: exact_decode_stream(dec, codes, CHUNK_FRAMES), reps)
    win_s, win_runs, win_chunks = timed_median(
        lambda: windowed_decode_stream(model, codes, CHUNK_FRAMES, LEFT_CONTEXT_FRAMES), reps
    )

    exact = torch.cat(exact_pieces)
    windowed = torch.cat(win_chunks)
    common = min(windowed.shape[0], ref.shape[0])
    aligned = max(
        (c - ref[start : start + c.shape[0]]).abs().max().item()
        for start, c in place_windowed_chunks(win_chunks, CHUNK_FRAMES, dec.total_upsample)
    )
    ref64 = full_decode(copy.deepcopy(model).double(), codes)

    return {
        "model": source,
        "config": {
            "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.num_hidden_layers,
            "sliding_window": cfg.sliding_window,
            "decoder_dim": cfg.decoder_dim,
            "upsampling_ratios": list(cfg.upsampling_ratios),
            "upsample_rates": list(cfg.upsample_rates),
            "samples_per_frame": dec.total_upsample,
            "holdback_samples": dec.holdback_samples,
        },
        "frames": FRAMES,
        "audio_s": FRAMES * dec.total_upsample / 24000,
        "chunk_frames": CHUNK_FRAMES,
        "left_context_frames": LEFT_CONTEXT_FRAMES,
        "reps": reps,
        "timings_s": {
            "full": full_s,
            "exact": exact_s,
            "windowed": win_s,
            "full_runs": full_runs,
            "exact_runs": exact_runs,
            "windowed_runs": win_runs,
        },
        "ratios": {
            "exact_compute_over_windowed": exact_s / win_s,
            "exact_compute_over_full": exact_s / full_s,
            "windowed_compute_over_full": win_s / full_s,
        },
        "samples": {"full": int(ref.shape[0]), "exact": int(exact.shape[0]), "windowed": int(windowed.shape[0])},
        "exact_max_abs_diff": (exact - ref).abs().max().item(),
        "windowed_max_abs_diff": (windowed[:common] - ref[:common]).abs().max().item(),
        "windowed_aligned_max_abs_diff": aligned,
        "windowed_missing_samples": int(ref.shape[0] - windowed.shape[0]),
        "full_fp32_vs_fp64_max_abs_diff": (ref.double() - ref64).abs().max().item(),
        "output_std": ref.std().item(),
        "machine": machine_info(),
        "command": "omnistage bench code2wav" + (f" (checkpoint {checkpoint})" if checkpoint else ""),
        "wall_s": time.perf_counter() - t_start,
    }


def _fmt_table(res: dict[str, Any]) -> str:
    t, r = res["timings_s"], res["ratios"]
    c = res["config"]
    lines = [
        f"code2wav: {res['frames']} frames = {res['audio_s']:.1f} s audio, chunks of {res['chunk_frames']}, "
        f"{c['samples_per_frame']} samples/frame; model: {res['model']}",
        f"{'mode':<26}{'compute s (median)':>20}{'x full':>9}{'max |d| vs full':>18}{'samples':>10}",
        f"{'full decode (baseline)':<26}{t['full']:>20.4f}{1.0:>9.2f}{0.0:>18.3g}{res['samples']['full']:>10}",
        f"{'exact streaming':<26}{t['exact']:>20.4f}{r['exact_compute_over_full']:>9.2f}"
        f"{res['exact_max_abs_diff']:>18.3g}{res['samples']['exact']:>10}",
        f"{'windowed 25/25':<26}{t['windowed']:>20.4f}{r['windowed_compute_over_full']:>9.2f}"
        f"{res['windowed_max_abs_diff']:>18.3g}{res['samples']['windowed']:>10}",
        f"exact / windowed compute: {r['exact_compute_over_windowed']:.2f}; windowed chunks placed at their true "
        f"offsets: max |d| {res['windowed_aligned_max_abs_diff']:.3g}, {res['windowed_missing_samples']} samples "
        f"never produced",
        f"full decode fp32 vs float64 (rounding floor): {res['full_fp32_vs_fp64_max_abs_diff']:.3g}; "
        f"output std {res['output_std']:.3f}",
        f"median of {res['reps']} runs; wall {res['wall_s']:.1f} s; {res['machine']['torch_threads']} torch "
        f"threads on {res['machine']['cpu_count']} CPUs, {res['machine']['platform']}",
    ]
    return "\n".join(lines)


def main(json_out: Path | None = None, checkpoint: Path | None = None) -> dict[str, Any]:
    """Run and print the table; ``OMNISTAGE_BENCH_THREADS`` sets torch's intra-op threads.

    On a box whose cores other processes also use, OpenMP with as many threads as cores stalls
    at every barrier and small kernels get up to 100x slower; set the variable to 1 there."""
    threads = os.environ.get("OMNISTAGE_BENCH_THREADS")
    if threads:
        torch.set_num_threads(int(threads))
    res = run(checkpoint)
    print(_fmt_table(res))
    write_json(json_out, res)
    return res


if __name__ == "__main__":
    import sys

    main(Path(sys.argv[1]) if len(sys.argv) > 1 else None)
