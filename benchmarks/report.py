"""The performance page, ``docs/performance.md``, regenerated from the committed result files.

    python benchmarks/report.py                 # the page and its plots (docs/performance/*.png)
    python benchmarks/report.py --no-plots      # the page only
    python benchmarks/report.py --check         # exit 1 if the committed page is not current

Reads every ``benchmarks/results/*.jsonl`` (JSON lines, one self-contained record per figure: the
format ``emit`` writes, checked by ``problems``), drops ``quick`` records, keeps for each (machine
kind, routine, case, impl, metric) the newest record (by date; on the same date the later file and
line), and writes one section per machine kind: the date range and CPUs, a table per routine with
each kernforge figure beside its peer's (the other implementation of the same case and metric) and
its bound, the runs that measured them, and the plots. The Markdown depends on the records alone
(``tests/test_performance_page.py`` regenerates it and compares); the plots need matplotlib (the
``bench`` extra) and are skipped without it.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kernforge.bench import records as record_format

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "performance.md"
PLOTS = PAGE.parent / "performance"
REGENERATE = "python benchmarks/report.py"

KINDS = {
    "zen4": "AMD Zen 4",
    "zen5": "AMD Zen 5",
    "xeon-amx": "Intel Xeon with AMX",
    "xeon": "Intel Xeon without AMX",
    "other": "Other CPUs",
}
ROUTINES = (
    "gemm", "decode", "prefill", "mla", "moe", "page", "ops", "sampling",
    "jit", "comm", "e2e", "vllm", "llamacpp", "gguf", "quality", "gguf_quality", "soak", "fuzz",
)  # fmt: skip
# The implementation a kernforge figure is set against, by routine: the first of these measured.
PEERS = {
    "gemm": ("torch", "torch.compile"),
    "decode": ("vllm", "torch.compile", "torch"),
    "e2e": ("transformers",),
    "vllm": ("vllm",),
    "llamacpp": ("llama.cpp", "llama.cpp Q4_K_M"),
    "gguf": ("llama.cpp", "transformers"),
    "gguf_quality": ("llama.cpp", "transformers"),
}
DEFAULT_PEERS = ("torch.compile", "torch", "transformers", "vllm", "llama.cpp")
LOWER_IS_BETTER = {"ns", "us", "µs", "ms", "s", "seconds"}  # units of time; every other unit is a rate
LOWER_IS_BETTER_METRICS = {"perplexity"}
# A day (transcribed records) or an ISO 8601 time (what kernforge.bench.records writes); either sorts as text.
_DATE = re.compile(r"\d{4}-\d\d-\d\d(T\d\d:\d\d(:\d\d)?([+-]\d\d:\d\d|Z)?)?$")

Record = dict[str, Any]
Key = tuple[str, str, str, str, str]


# ------------------------------------------------------------------------------------------ records


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def problems(record: Any) -> list[str]:
    """What makes ``record`` not a valid result record for the page (empty when it is one): the
    format's own checks (kernforge.bench.records), then what the page relies on."""
    found = record_format.problems(record)
    if not isinstance(record, dict):
        return found
    if record.get("routine") not in ROUTINES:
        found.append(f"routine {record.get('routine')!r} is not one of {', '.join(ROUTINES)}")
    if not (record.get("value") is None or _is_number(record.get("value"))):
        found.append("value: neither a finite number nor null")
    bound = record.get("bound")
    if isinstance(bound, dict) and not _is_number(bound.get("value")):
        found.append("bound.value: not a finite number")
    machine = record.get("machine") if isinstance(record.get("machine"), dict) else {}
    if machine.get("kind") not in KINDS:
        found.append(f"machine.kind {machine.get('kind')!r} is not one of {', '.join(KINDS)}")
    if not _DATE.match(str(record.get("date"))):
        found.append("date: neither YYYY-MM-DD nor an ISO 8601 time")
    if "source" in record and not str(record["source"]).startswith("docs/notes/"):
        found.append("source: not a docs/notes/ page")
    return found


def read_records(paths: Iterable[Path]) -> list[Record]:
    """Every record of ``paths``, in file-name order then line order; raises on an invalid one."""
    kept: list[Record] = []
    for path in sorted(paths, key=lambda p: p.name):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            record = json.loads(line)
            found = problems(record)
            if found:
                raise ValueError(f"{path.name}:{number}: " + "; ".join(found))
            kept.append(record)
    return kept


def key(record: Record) -> Key:
    return (record["machine"]["kind"], record["routine"], record["case"], record["impl"], record["metric"])


def newest(records: Iterable[Record]) -> dict[Key, Record]:
    """For each key, the newest record that is not ``quick`` (a later one wins a tie of dates)."""
    kept: dict[Key, Record] = {}
    for record in records:
        if record["quick"]:
            continue
        old = kept.get(key(record))
        if old is None or record["date"] >= old["date"]:
            kept[key(record)] = record
    return kept


def is_kernforge(impl: str) -> bool:
    return impl.startswith(("kernforge", "vllm+kernforge"))


def lower_is_better(record: Record) -> bool:
    return record["unit"] in LOWER_IS_BETTER or record["metric"] in LOWER_IS_BETTER_METRICS


def ratio(record: Record, peer: Record | None) -> float | None:
    """How many times better ``record`` is than ``peer`` (above 1: faster), or None."""
    if peer is None or record["value"] is None or peer["value"] is None or 0 in (record["value"], peer["value"]):
        return None
    if lower_is_better(record):
        return float(peer["value"] / record["value"])
    return float(record["value"] / peer["value"])


def share_of_bound(record: Record) -> float | None:
    """The figure as a share of its bound's rate (1.0: at the bound), or None."""
    bound, value = record.get("bound"), record["value"]
    if bound is None or value is None or value == 0 or bound["value"] == 0:
        return None
    return float(bound["value"] / value if lower_is_better(record) else value / bound["value"])


def peer_of(record: Record, kept: dict[Key, Record]) -> Record | None:
    kind, routine, case, _, metric = key(record)
    for impl in PEERS.get(routine, DEFAULT_PEERS):
        found = kept.get((kind, routine, case, impl, metric))
        if found is not None:
            return found
    return None


# ----------------------------------------------------------------------------------------- Markdown


@dataclass(frozen=True)
class Run:
    """One measurement run: what a record's command, date, commit and source say."""

    command: str
    date: str
    commit: str | None
    source: str | None

    @staticmethod
    def of(record: Record) -> Run:
        return Run(record["command"], record["date"], record.get("commit"), record.get("source"))

    def sort_key(self) -> tuple[str, str, str, str]:
        return (self.date, self.command, self.commit or "", self.source or "")


def number(value: float | None) -> str:
    """A figure as the page prints it: thousands separated, four significant digits below 1,000."""
    if value is None:
        return "n/a"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    text = f"{value:.4g}"
    return text + ".0" if isinstance(value, float) and text.lstrip("-").isdigit() else text


def natural(text: str) -> list[tuple[int, str]]:
    """A sort key that puts M=16 before M=128: numbers by value, the rest as text."""
    return [(int(part), "") if part.isdigit() else (-1, part) for part in re.split(r"(\d+)", text)]


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def quantity(record: Record) -> str:
    return f"{number(record['value'])} {record['unit']}"


def table_row(record: Record, kept: dict[Key, Record], runs: list[Run]) -> str:
    peer = peer_of(record, kept)
    times, share, bound = ratio(record, peer), share_of_bound(record), record.get("bound")
    cells = [
        cell(record["case"]),
        cell(record["impl"]),
        cell(record["metric"]),
        quantity(record),
        "" if peer is None else f"{cell(peer['impl'])}: {quantity(peer)}",
        "" if times is None else f"{times:.2f}x",
        "" if bound is None else f"{cell(bound['name'])}: {number(bound['value'])} {record['unit']}",
        "" if share is None else f"{share * 100:.0f} %",
        record["date"][:10],
        str(runs.index(Run.of(record)) + 1),
    ]
    return "| " + " | ".join(cells) + " |"


def routine_table(routine: str, records: list[Record], kept: dict[Key, Record], runs: list[Run]) -> list[str]:
    head = [
        f"### {routine}",
        "",
        "| case | impl | metric | value | peer | vs peer | bound | of bound | date | run |",
        "|---|---|---|---:|---|---:|---|---:|---|---:|",
    ]
    ordered = sorted(records, key=lambda r: (natural(r["case"]), r["impl"], r["metric"]))
    return head + [table_row(r, kept, runs) for r in ordered] + [""]


def run_lines(runs: list[Run]) -> list[str]:
    """The runs the tables' "run" column numbers: command, date, commit, where a transcription came from."""
    lines = ["### Runs", ""]
    for number_, run in enumerate(runs, 1):
        parts = [f"{number_}. `{run.command}`, {run.date}"]
        if run.commit:
            parts.append(f"at `{run.commit}`")
        if run.source:
            page = run.source.removeprefix("docs/")
            parts.append(f"transcribed from [{page.partition('#')[0]}]({page})")
        lines.append(", ".join(parts))
    return lines + [""]


def machine_lines(records: list[Record]) -> list[str]:
    dates = sorted(r["date"][:10] for r in records)
    machines = sorted({(r["machine"]["cpu"], r["machine"]["cores"], r["machine"]["tier"]) for r in records})
    lines = [f"Measured {dates[0]} to {dates[-1]} on:", ""]
    lines += [f"- {cpu}; {cores} cores, tier `{tier}`" for cpu, cores, tier in machines]
    return lines + [""]


def plot_names(kind: str, records: list[Record]) -> list[tuple[str, str]]:
    """(file name, caption) of each plot the records of ``kind`` have data for."""
    ours = [r for r in records if is_kernforge(r["impl"]) and r["value"] is not None]
    routines = {r["routine"] for r in ours}
    found = []
    if any(r["impl"] == "kernforge" and "M" in r["params"] for r in gemm_points(ours)):
        found.append((f"{kind}-gemm.png", "GEMM: GFLOP/s against M, kernforge and oneDNN, with the peak"))
    if any(r["routine"] == "decode" and r["metric"] == "gbs" and "context" in r["params"] for r in ours):
        found.append((f"{kind}-decode.png", "Decode: GB/s against context, with the streaming rate"))
    if routines & {"e2e", "llamacpp", "vllm"}:
        found.append((f"{kind}-e2e.png", "End to end: kernforge against transformers, vLLM and llama.cpp"))
    return found


def plot_lines(kind: str, records: list[Record]) -> list[str]:
    lines: list[str] = []
    for name, caption in plot_names(kind, records):
        lines += [f"![{caption}](performance/{name})", ""]
    return (["### Plots", "", *lines]) if lines else []


def kind_section(kind: str, kept: dict[Key, Record]) -> list[str]:
    records = [r for k, r in kept.items() if k[0] == kind]
    runs = sorted({Run.of(r) for r in records}, key=Run.sort_key)
    lines = [f"## {KINDS[kind]}", "", *machine_lines(records)]
    lines += plot_lines(kind, records)
    for routine in ROUTINES:
        mine = [r for r in records if r["routine"] == routine and is_kernforge(r["impl"])]
        if mine:
            lines += routine_table(routine, mine, kept, runs)
    return lines + run_lines(runs)


INTRO = f"""# Performance

The newest figure of each headline case on each kind of machine kernforge has been measured on,
beside its peer (the other implementation of the same case: oneDNN through torch for GEMM, vLLM's
kernel for decode, stock transformers, stock vLLM, llama.cpp) and its bound (the machine's limit
measured in the same run: the dot-product peak, the streaming rate, the bytes of a decode step).
"vs peer" is how many times faster kernforge is (above 1.00x: faster); "of bound" is the figure's
rate as a share of the bound's (100 %: at the limit). How each figure was measured, and the
history behind it, is in the [notes](notes/README.md).

Generated by `{REGENERATE}` from `benchmarks/results/*.jsonl` (one JSON record per figure, written by
the benchmarks' `--jsonl`; quick runs are left out, and a newer record of the same case replaces an
older one); do not edit by hand.
"""


def summary_lines(kept: dict[Key, Record]) -> list[str]:
    lines = ["| machine | measured | records |", "|---|---|---:|"]
    for kind, title in KINDS.items():
        dates = sorted(r["date"][:10] for k, r in kept.items() if k[0] == kind)
        if dates:
            lines.append(f"| [{title}](#{slug(title)}) | {dates[0]} to {dates[-1]} | {len(dates)} |")
        elif kind != "other":
            lines.append(f"| {title} | not yet | 0 |")
    return lines + [""]


def slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def markdown(records: Iterable[Record]) -> str:
    """The page, from the records alone."""
    kept = newest(records)
    lines = [INTRO, *summary_lines(kept)]
    for kind in KINDS:
        if any(k[0] == kind for k in kept):
            lines += kind_section(kind, kept)
    return "\n".join(lines).rstrip("\n") + "\n"


# -------------------------------------------------------------------------------------------- plots


def _series(records: list[Record], group: tuple[str, ...], x: str) -> dict[tuple[Any, ...], list[Record]]:
    found: dict[tuple[Any, ...], list[Record]] = {}
    for record in records:
        if record["value"] is not None and x in record["params"]:
            found.setdefault(tuple(record["params"].get(g) for g in group), []).append(record)
    return {k: sorted(v, key=lambda r: r["params"][x]) for k, v in sorted(found.items(), key=lambda kv: str(kv[0]))}


def gemm_points(records: list[Record]) -> list[Record]:
    """The GEMM records in GFLOP/s: as measured, or from a time in us where a case has no GFLOP/s
    record for that impl (2 M K N flops over the time)."""
    gemm = [r for r in records if r["routine"] == "gemm" and r["value"] is not None]
    rated = {(r["case"], r["impl"]) for r in gemm if r["metric"] == "gflops"}
    points = [r for r in gemm if r["metric"] == "gflops"]
    for r in gemm:
        if r["metric"] == "us" and (r["case"], r["impl"]) not in rated and {"M", "K", "N"} <= r["params"].keys():
            flops = 2 * r["params"]["M"] * r["params"]["K"] * r["params"]["N"]
            points.append({**r, "metric": "gflops", "value": flops / r["value"] / 1e3, "bound": None})
    return points


def plot_gemm(axes: Any, records: list[Record]) -> None:
    gemm = gemm_points(records)
    shapes = sorted({(r["params"].get("dtype"), r["params"]["K"], r["params"]["N"]) for r in gemm}, key=str)
    for impl, style, name in (("kernforge", "-o", "kernforge"), ("torch", "--s", "oneDNN")):
        for shape, rows in _series([r for r in gemm if r["impl"] == impl], ("dtype", "K", "N"), "M").items():
            label = f"{name} {shape[0]} {shape[1]}x{shape[2]}"
            color = f"C{shapes.index(shape) % 10}"
            axes.plot([r["params"]["M"] for r in rows], [r["value"] for r in rows], style, color=color, label=label)
    for name, value in sorted({(r["bound"]["name"], r["bound"]["value"]) for r in gemm if r["bound"]}):
        axes.axhline(value, color="grey", linestyle=":", linewidth=1)
        axes.annotate(f"{name} {value:,.0f}", (0.01, value), xycoords=("axes fraction", "data"), fontsize=7)
    axes.set(xscale="log", xlabel="M (rows)", ylabel="GFLOP/s", title="GEMM")
    axes.set_ylim(bottom=0)


def plot_decode(axes: Any, records: list[Record]) -> None:
    decode = [
        r
        for r in records
        if r["routine"] == "decode"
        and r["metric"] == "gbs"
        and is_kernforge(r["impl"])
        and isinstance(r["params"].get("context"), int)  # not the uneven batches (a context per request)
    ]
    group = ("batch", "layout", "kv_dtype", "threads")
    for i, (what, rows) in enumerate(_series(decode, group, "context").items()):
        contexts = [r["params"]["context"] for r in rows]
        label = f"B={what[0]} {what[1]} {what[2]}" + ("" if what[3] is None else f", {what[3]} threads")
        marker = "s" if what[1] == "NHD" else "o"
        axes.plot(contexts, [r["value"] for r in rows], f"-{marker}", color=f"C{i % 10}", label=label)
        bounds = [r["bound"]["value"] if r["bound"] else math.nan for r in rows]
        axes.plot(contexts, bounds, "x:", color=f"C{i % 10}")
    axes.plot([], [], "x:", color="grey", label="x: the streaming rate (each record's bound)")
    axes.set(xscale="log", xlabel="context (tokens)", ylabel="GB/s", title="Decode")
    axes.set_ylim(bottom=0)


def _bars(axes: Any, rows: list[tuple[str, str, float]], title: str, unit: str) -> None:
    """Grouped bars: (case, impl, value) rows, one group per case, one colour per impl."""
    impls = sorted({i for _, i, _ in rows}, key=lambda i: (is_kernforge(i), i))
    ticks: list[tuple[float, str]] = []
    x = 0.0
    for case in sorted({c for c, _, _ in rows}, key=natural):
        here = sorted(((i, v) for c, i, v in rows if c == case), key=lambda iv: impls.index(iv[0]))
        for n, (impl, value) in enumerate(here):
            axes.bar(x + n, value, 0.9, color=f"C{impls.index(impl) % 10}")
        ticks.append((x + (len(here) - 1) / 2, case))
        x += len(here) + 1
    from matplotlib.patches import Patch

    axes.set_xticks([t for t, _ in ticks], [c for _, c in ticks], fontsize=7, rotation=20, ha="right")
    axes.set(ylabel=unit, title=title)
    axes.legend(handles=[Patch(color=f"C{n % 10}", label=impl) for n, impl in enumerate(impls)], fontsize=6)


def _bar(record: Record) -> tuple[str, str, float]:
    """(case, impl, value); llama-bench's two rates of one case are two cases of the plot."""
    case = record["case"] + (f" {record['metric']}" if record["routine"] == "llamacpp" else "")
    return case, record["impl"], record["value"]


def plot_e2e(figure: Any, records: list[Record]) -> None:
    panels = [
        ([r for r in records if r["routine"] == "e2e" and r["metric"] == "ttft_ms"], "TTFT (transformers)"),
        ([r for r in records if r["routine"] == "e2e" and r["metric"] == "tpot_ms"], "TPOT (transformers)"),
        ([r for r in records if r["routine"] == "vllm" and r["metric"] == "seconds"], "vLLM throughput run"),
        ([r for r in records if r["routine"] == "llamacpp"], "llama.cpp llama-bench"),
    ]
    panels = [(rows, title) for rows, title in panels if any(r["value"] is not None for r in rows)]
    for n, (rows, title) in enumerate(panels):
        axes = figure.add_subplot(1, len(panels), n + 1)
        _bars(axes, [_bar(r) for r in rows if r["value"] is not None], title, rows[0]["unit"])


def write_plots(kept: dict[Key, Record], folder: Path) -> list[Path]:
    """The PNGs the page links, drawn with matplotlib (Agg); [] when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib.figure import Figure
    except ImportError:
        return []
    written = []
    for kind in KINDS:
        records = [r for k, r in kept.items() if k[0] == kind]
        for name, _ in plot_names(kind, records):
            wide = name.endswith("e2e.png")
            figure = Figure(figsize=(14 if wide else 7, 4.5), layout="constrained")
            if wide:
                plot_e2e(figure, records)
            else:
                axes = figure.add_subplot()
                (plot_gemm if name.endswith("gemm.png") else plot_decode)(axes, records)
                axes.legend(fontsize=6)
            figure.suptitle(f"{KINDS[kind]}: {name.removeprefix(kind + '-').removesuffix('.png')}")
            folder.mkdir(parents=True, exist_ok=True)
            figure.savefig(folder / name, dpi=100, metadata={"Software": None})
            written.append(folder / name)
    return written


# ---------------------------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder of *.jsonl result files")
    parser.add_argument("--out", type=Path, default=PAGE, help="the page to write (plots go beside it)")
    parser.add_argument("--no-plots", action="store_true", help="write the Markdown only")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if the page is not current")
    args = parser.parse_args(argv)
    records = read_records(args.results.glob("*.jsonl"))
    page = markdown(records)
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        print(f"{args.out}: {'current' if current == page else 'NOT current: run ' + REGENERATE}")
        return 0 if current == page else 1
    args.out.write_text(page)
    print(f"wrote {args.out} ({len(records)} records)")
    if not args.no_plots:
        written = write_plots(newest(records), args.out.parent / "performance")
        print(f"wrote {len(written)} plots" if written else "no plots (matplotlib missing, or nothing to plot)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
