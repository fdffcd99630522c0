"""The end-of-run table, the markdown summary and the plot of ``omnistage bench``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

COLUMNS: tuple[tuple[str, str, str, str], ...] = (
    # header, summary key, sub key, format
    ("ok/n", "ok", "", "{:d}"),  # (the cell adds "/n": the requests the level sent)
    ("TTFT p50", "ttft_s", "median", "{:.3f}"),
    ("TTFT p99", "ttft_s", "p99", "{:.3f}"),
    ("TTFA p50", "ttfa_s", "median", "{:.3f}"),
    ("TTFA p99", "ttfa_s", "p99", "{:.3f}"),
    ("E2E p50", "e2e_s", "median", "{:.3f}"),
    ("E2E p99", "e2e_s", "p99", "{:.3f}"),
    ("RTF p50", "rtf", "median", "{:.2f}"),
    ("stall p50", "stall_s", "median", "{:.3f}"),
    ("stall p99", "stall_s", "p99", "{:.3f}"),
    ("req/s", "requests_per_s", "", "{:.2f}"),
    ("audio s/s", "audio_s_per_s", "", "{:.2f}"),
    ("tok/s", "text_tokens_per_s", "", "{:.1f}"),
)


def _cell(summary: dict[str, Any], key: str, sub: str, fmt: str) -> str:
    if key == "ok":  # those that succeeded of those sent: the figures cover only the first
        return f"{summary['ok']}/{summary['requests']}"
    value = summary.get(key)
    if sub and isinstance(value, dict):
        value = value.get(sub)
    return "-" if value is None else fmt.format(value)


def table_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    header = ["configuration", *(c[0] for c in COLUMNS)]
    rows = [
        [cfg["name"], *(_cell(cfg["summary"], k, s, f) for _, k, s, f in COLUMNS)] for cfg in result["configurations"]
    ]
    return header, rows


def level_line(name: str, summary: dict[str, Any]) -> str:
    """One level's figures on one line, logged as the level ends: a run stopped before its report
    (a time-boxed GPU session) still leaves them in its log."""
    shown = [c for c in COLUMNS if c[0] not in ("ok/n", "stall p50")]
    cells = ", ".join(f"{label} {_cell(summary, k, s, f)}" for label, k, s, f in shown)
    return f"{name}: ok {summary['ok']}/{summary['requests']}, {cells}"


def aligned(rows: Sequence[Sequence[str]], rule: bool = False) -> list[str]:
    """Rows as text columns: the first left-aligned, the rest right-aligned; `rule`: a line of
    dashes under the first row (the header)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
             for r in rows]  # fmt: skip
    if rule:
        lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


# Under the table: what its figures are, and over how many requests a p99 is.
TABLE_KEY = ("seconds unless stated; p50/p99 over each level's requests that succeeded (ok of n sent), "
             "linearly interpolated: with n under 100 a p99 is among the few slowest, near the maximum")


def format_table(result: dict[str, Any]) -> str:
    header, rows = table_rows(result)
    return "\n".join([*aligned([header, *rows], rule=True), TABLE_KEY])


def format_stages(result: dict[str, Any]) -> str:
    st = result.get("stage_baseline")
    if not st:
        return "stage baseline: skipped"
    lines = ["stage alone (in-process runner, same request mix):"]
    for name, s in st["stages"].items():
        rate = s["requests_per_s"]
        lines.append(
            f"  {name:9s} best batch {s['best_batch_size']} of {s['batch_sizes_tried']}: "
            f"{'-' if rate is None else f'{rate:.2f}'} req/s"
        )
        for b, a in s.get("agreement_by_batch", {}).items():
            first = f", the others first differ at {a['first_divergence']}" if a["first_divergence"] else ""
            lines.append(f"    fast batching at batch {b}: {100 * a['identical']:.0f} % of {a['requests']} requests "
                         f"equal to their lone run{first}")  # fmt: skip
    lines.append(f"  bottleneck: {st['bottleneck']}  ({st['note']})")
    return "\n".join(lines)


# The pipeline saturates at the first level that reaches this share of the best level's
# requests/s (a share, not "no later gain": on a shared machine levels past the knee scatter by
# several per cent either way).
SATURATION_SHARE = 0.9


def _sweep(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The streamed closed-loop levels of the system under test, by concurrency."""
    sweep = [c for c in result["configurations"] if c["role"] == "sut" and c["load"].get("type") == "concurrency"
             and c["mode"] != "full_payload"]  # fmt: skip
    return sorted(sweep, key=lambda c: c["load"]["value"])


def saturation(result: dict[str, Any]) -> dict[str, Any] | None:
    """Where throughput stops growing: the first concurrency level at SATURATION_SHARE of the best
    level's requests/s (None: under two levels; not `saturated` when that is the last level), what
    it reaches against the slowest stage alone, and the per-level throughput and p99 TTFA."""
    sweep = [c for c in _sweep(result) if c["summary"]["requests_per_s"]]
    if len(sweep) < 2:
        return None
    rates = [c["summary"]["requests_per_s"] for c in sweep]
    at = next(i for i, r in enumerate(rates) if r >= SATURATION_SHARE * max(rates))
    st = result.get("stage_baseline") or {}
    limit = st.get("bottleneck_requests_per_s")
    return {
        "levels": [
            {"concurrency": c["load"]["value"], "requests_per_s": c["summary"]["requests_per_s"],
             "ttfa_p99_s": c["summary"]["ttfa_s"]["p99"]}
            for c in sweep
        ],
        "saturated": at < len(sweep) - 1,  # else it still grew at the last level
        "concurrency": sweep[at]["load"]["value"],
        "requests_per_s": rates[at],
        "bottleneck": st.get("bottleneck"),
        "of_bottleneck_alone": rates[at] / limit if limit else None,
        "cpu_ceiling": cpu_ceiling(result, sweep[at]),
    }


def cpu_ceiling(result: dict[str, Any], level: dict[str, Any]) -> dict[str, Any] | None:
    """What the machine's cores allow at most, from CPU alone: its cores over the core-seconds one
    request costs, which is each stage's at its best batch alone (one torch thread, so one core
    while it runs) plus, at `level`, the CPU per request of the processes that run no steps (the
    gateway, the bench client). A stack whose stages share the cores cannot beat it, however
    well it batches. None without the figures (or with more than one torch thread), among them
    a stack driven at `--target`, whose processes' CPU the bench does not read."""
    machine = result.get("machine") or {}
    stages = (result.get("stage_baseline") or {}).get("stages") or {}
    rates = [s.get("requests_per_s") for s in stages.values()]
    served = level["summary"]["requests_per_s"]
    load = level.get("stage_load") or {}
    others = [f["cpu_cores"] for f in load.values() if f.get("steps") is None and f.get("cpu_cores") is not None]
    if not machine.get("affinity_cpus") or machine.get("torch_threads") != 1 or not rates or not all(rates) \
            or not served or not others:  # fmt: skip
        return None
    stages_s = sum(1 / r for r in rates)
    others_s = sum(others) / served
    ceiling = machine["affinity_cpus"] / (stages_s + others_s)
    limit = (result.get("stage_baseline") or {}).get("bottleneck_requests_per_s")
    return {"cores": machine["affinity_cpus"], "stages_core_s_per_request": stages_s,
            "others_core_s_per_request": others_s, "requests_per_s": ceiling,
            "of_bottleneck_alone": ceiling / limit if limit else None}  # fmt: skip


def format_saturation(result: dict[str, Any]) -> str:
    sat = saturation(result)
    if sat is None:
        return "saturation: needs two or more concurrency levels"

    def level(lv: dict[str, Any]) -> str:
        p99 = "-" if lv["ttfa_p99_s"] is None else f"{lv['ttfa_p99_s']:.2f} s"
        return f"c={lv['concurrency']} {lv['requests_per_s']:.2f} req/s (TTFA p99 {p99})"

    levels = ", ".join(level(lv) for lv in sat["levels"])
    where = (f"saturates at c={sat['concurrency']}" if sat["saturated"]
             else f"still growing at c={sat['concurrency']} (the last level)")  # fmt: skip
    limit = ""
    if sat["of_bottleneck_alone"] is not None:
        limit = f", {sat['of_bottleneck_alone']:.2f} of the slowest stage alone ({sat['bottleneck']})"
    text = f"throughput by level: {levels}\n  {where}: {sat['requests_per_s']:.2f} req/s{limit}"
    cap = sat.get("cpu_ceiling")
    if cap is not None:
        share = "" if cap["of_bottleneck_alone"] is None else f", {cap['of_bottleneck_alone']:.2f} of the slowest alone"
        text += (f"\n  CPU ceiling on {cap['cores']} cores: {cap['requests_per_s']:.2f} req/s{share} "
                 f"(each stage alone at its best batch {1000 * cap['stages_core_s_per_request']:.1f} ms of a core "
                 f"per request, gateway and client {1000 * cap['others_core_s_per_request']:.1f} ms at this level)")
    return text


def format_stage_load(result: dict[str, Any]) -> str:
    """Per level of a served stack: each process's busy share (time in engine steps over the
    level's wall time), mean batch, mean step time and CPU cores, and the cores of all of them."""
    lines = []
    cores = (result.get("machine") or {}).get("affinity_cpus")
    for c in result["configurations"]:
        load = c.get("stage_load")
        if not load:
            continue
        parts = []
        served = (c.get("summary") or {}).get("ok") or 0
        for role, f in load.items():
            cpu = "" if f["cpu_cores"] is None else f" cpu {f['cpu_cores']:.2f}"
            if f.get("cpu_outside_steps") is not None:
                cpu += f" ({f['cpu_outside_steps']:.0%} outside steps)"
            if f.get("messages") and served:
                per = f.get("us_outside_per_message")
                cpu += f", {f['messages'] / served:.0f} messages a request" + ("" if per is None else
                                                                                f" ({per:.0f} us each outside steps)")
            threads = f.get("thread_cpu_s") or {}
            if served and threads:
                split = ", ".join(f"{kind} {1000 * v / served:.1f}" for kind, v in threads.items() if v is not None)
                cpu += f", by thread {split} ms a request"
            if f.get("context_switches") is not None and served:
                cpu += f", {f['context_switches'] / served:.0f} context switches a request"
            if f["steps"]:
                on_cpu = "" if f.get("step_on_cpu") is None else f" ({f['step_on_cpu']:.0%} on a core)"
                parts.append(f"{role} busy {f['busy']:.2f} batch {f['mean_batch']:.1f} "
                             f"step {f['mean_step_ms']:.1f} ms{on_cpu}{cpu}")  # fmt: skip
            else:
                parts.append(f"{role}{cpu}")
        used = [f["cpu_cores"] for f in load.values() if f["cpu_cores"] is not None]
        total = f"; all {sum(used):.2f} cores" + (f" of {cores}" if cores else "") if used else ""
        lines.append(f"  {c['name']}: " + "; ".join(parts) + total)
    if not lines:
        return ""
    return "\n".join(["stage load (each stack process's own metrics over the level, and the bench client's CPU; "
                      "busy = share of the level in engine steps (a replica's: the mean over a role's "
                      "replicas), cpu = cores used (all replicas), outside steps = the share "
                      "of them not in engine steps: gRPC, encoding, relaying; messages = gRPC messages sent and "
                      "received, every hop; by thread: CPU of the engine thread, the main thread's event loop, "
                      "gRPC's threads and the others):", *lines])


def format_ratios(result: dict[str, Any]) -> str:
    lines = ["ratios (same run):"]
    for key, value in result["ratios"].items():
        basis = result["ratio_basis"].get(key, "")
        shown = "null (baseline skipped)" if value is None else f"{value:.3f}"
        lines.append(f"  {key:44s} {shown:>24s}   {basis}")
    return "\n".join(lines)


def format_report(result: dict[str, Any]) -> str:
    parts = [format_table(result), "", format_stages(result), "", format_saturation(result), ""]
    load = format_stage_load(result)
    parts += [load, "", format_ratios(result)] if load else [format_ratios(result)]
    cons = result.get("consistency") or {}
    if cons.get("mismatches"):
        parts += ["", f"WARNING: outputs differ between configurations: {cons['mismatches'][:5]}"]
    parts += ["", *(f"note: {n}" for n in result.get("notes", []))]
    return "\n".join(parts)


def markdown_summary(result: dict[str, Any], json_name: str | None, plot_name: str | None) -> str:
    m = result["machine"]
    header, rows = table_rows(result)
    md = [
        "# omnistage bench results",
        "",
        "Regenerate with `benchmarks/make_results.sh`. Every figure is from one run; ratios divide",
        "figures of the same run.",
        "",
        "Command:",
        "",
        "```",
        result["command"],
        "```",
        "",
        f"Machine: {m['cpu_count']} CPUs ({m['platform']}), Python {m['python']}, torch {m['torch']} with "
        f"{m['torch_threads']} thread(s) in the benchmark process, load average at start "
        f"{', '.join(f'{x:.2f}' for x in m['load_average'])}, at end "
        f"{', '.join(f'{x:.2f}' for x in m.get('load_average_end') or [])}. Model: {result['model']}. "
        f"Started {result['started_at']}.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
        *("| " + " | ".join(r) + " |" for r in rows),
        "",
        TABLE_KEY[0].upper() + TABLE_KEY[1:] + ".",
        "",
        "p50 = median; RTF = generation time / audio duration; stall = how long a",
        "client that starts playing at the first audio then waits for more (0: it never runs dry); the",
        "JSON also has the gaps between consecutive audio chunks.",
        "",
        "```",
        format_stages(result),
        "```",
        "",
        "| ratio | value | what it divides |",
        "|---|---|---|",
        *(
            f"| `{k}` | {'null' if v is None else f'{v:.3f}'} | {result['ratio_basis'].get(k, '')} |"
            for k, v in result["ratios"].items()
        ),
        "",
    ]
    notes = list(result.get("notes", []))
    cons = result.get("consistency") or {}
    if cons:
        same = not cons.get("mismatches")
        unit, how = ("prompts", "greedy")
        if cons.get("compared_by") == "request":  # sampled speech, a seed per request
            unit, how = "requests", "greedy text, speech sampled with the request's seed"
        notes.insert(0, (
            f"Same work everywhere: for each of the {cons.get('prompts_compared')} {unit}, every configuration "
            f"produced the same text token ids and the same number of audio samples ({how})."
        ) if same else f"Outputs differ between configurations: {cons['mismatches'][:3]}")
    start = m.get("load_average") or [0.0]
    if m.get("cpu_count") and start[0] > 0.5 * m["cpu_count"]:
        notes.append(
            f"The machine was shared while this ran (1-minute load average {start[0]:.1f} on {m['cpu_count']} CPUs "
            "at the start): phases run one after another, so a ratio divides figures taken minutes apart; "
            "expect run-to-run noise of tens of percent."
        )
    if notes:
        md += ["Notes:", "", *(f"- {n}" for n in notes), ""]
    files = [f for f in (json_name, plot_name) if f]
    if files:
        md += ["Files: " + ", ".join(f"`{f}`" for f in files) + " (raw per-request figures in the JSON).", ""]
    return "\n".join(md)


def plot(result: dict[str, Any], path: Path) -> None:
    """Latency CDFs (TTFT, TTFA, E2E) per configuration and throughput vs concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    for ax, (key, title) in zip(
        axes.flat[:3], (("ttft", "time to first token"), ("ttfa", "time to first audio"), ("e2e", "end-to-end")),
        strict=True,
    ):
        for cfg in result["configurations"]:
            xs = sorted(r[key] for r in cfg["requests"] if r["ok"] and r[key] is not None)
            if not xs:
                continue
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            label = cfg["name"] + (" (not streamed)" if cfg["driver"] == "monolithic" else "")
            ax.step([xs[0], *xs], [0.0, *ys], where="post", label=label)
        ax.set_title(f"{title} (CDF)")
        ax.set_xlabel("seconds")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ax = axes.flat[3]
    sweep = _sweep(result)
    ax2 = ax.twinx()
    if sweep:
        xs = [c["load"]["value"] for c in sweep]
        ax.plot(xs, [c["summary"]["requests_per_s"] or 0 for c in sweep], "o-", color="C0", label="requests/s")
        ax2.plot(xs, [c["summary"]["audio_s_per_s"] or 0 for c in sweep], "s--", color="C1",
                 label="audio s/s (right axis)")
    mono = next((c for c in result["configurations"] if c["driver"] == "monolithic"), None)
    if mono and mono["summary"]["requests_per_s"]:
        ax.axhline(mono["summary"]["requests_per_s"], color="gray", ls=":", label="monolithic sequential req/s")
    st = result.get("stage_baseline")
    if st and st.get("bottleneck_requests_per_s"):
        ax.axhline(st["bottleneck_requests_per_s"], color="red", ls=":",
                   label=f"bottleneck stage alone ({st['bottleneck']}) req/s")
    sat = saturation(result)
    cap = sat.get("cpu_ceiling") if sat is not None else None
    if cap is not None:
        ax.axhline(cap["requests_per_s"], color="black", ls="-.", lw=0.8,
                   label=f"CPU ceiling on {cap['cores']} cores req/s")  # fmt: skip
    if sat is not None and sat["saturated"]:
        ax.axvline(sat["concurrency"], color="C2", ls="--",
                   label=f"saturates: c={sat['concurrency']}, {sat['requests_per_s']:.2f} req/s")  # fmt: skip
    for axis in (ax, ax2):
        tops = [y for line in axis.get_lines() for y in line.get_ydata()]
        axis.set_ylim(0, 1.15 * max(tops) if tops and max(tops) > 0 else 1.0)
    ax2.set_ylabel("audio seconds per second")
    lines, labels = ax.get_legend_handles_labels()
    lines2, labels2 = ax2.get_legend_handles_labels()
    ax.legend(lines + lines2, labels + labels2, fontsize=7, loc="lower right")
    ax.set_title("throughput vs concurrency")
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("requests per second")
    ax.grid(alpha=0.3)
    fig.suptitle(f"omnistage bench — {result['model']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
