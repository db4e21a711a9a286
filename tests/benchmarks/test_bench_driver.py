"""The benchmark driver (benchmarks/run.py, ``python -m kernforge bench``) and what it builds on:
the record format (kernforge.bench.records), the machine's kind (kernforge.bench.machine), the
timer (kernforge.bench.timing) and _harness's ``--jsonl``. Nothing here measures anything real."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

from kernforge.bench import machine, records, timing
from kernforge.jit import tuning

from conftest import REPO_ROOT

BENCH_DIR = REPO_ROOT / "benchmarks"


def _driver() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_run", BENCH_DIR / "run.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------- the driver


def test_list_names_every_routine_with_its_script(capsys):
    run = _driver()
    assert run.main(["list"]) == 0
    out = capsys.readouterr().out
    for name, (script, _) in run.ROUTINES.items():
        assert (BENCH_DIR / script).is_file(), f"routine {name}: no benchmarks/{script}"
        assert any(line.startswith(name + " ") and script in line for line in out.splitlines()), out


def test_routines_are_the_issues_families():
    expected = {"gemm", "decode", "prefill", "mla", "moe", "page", "ops", "sampling", "jit", "comm", "e2e"}
    assert expected | {"vllm", "llamacpp", "gguf", "quality", "gguf_quality"} == set(_driver().ROUTINES)


def test_unknown_routine_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        _driver().main(["gemm", "nope"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "unknown routine 'nope'" in err and "gemm, decode" in err, err


def test_flags_reach_each_routine_and_a_failure_fails_the_run(monkeypatch, tmp_path, capsys):
    run = _driver()
    calls = []

    def fake_run(argv):
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 3 if argv[1].endswith("bench_decode.py") else 0)

    monkeypatch.setattr(run.subprocess, "run", fake_run)
    assert run.main(["gemm", "decode", "gemm", "--quick", "--jsonl", "out.jsonl", "--", "--threads", "1"]) == 1
    assert [Path(c[1]).name for c in calls] == ["bench_gemm.py", "bench_decode.py"]  # each once, in order
    for argv in calls:
        assert argv[0] == sys.executable
        assert argv[2:] == ["--quick", "--jsonl", str(Path("out.jsonl").resolve()), "--threads", "1"]
    out = capsys.readouterr().out
    assert "FAILED (exit 3)" in out and "1 of 2 routines passed" in out and "failed: decode" in out


def test_all_runs_every_routine(monkeypatch):
    run = _driver()
    seen = []
    monkeypatch.setattr(run.subprocess, "run", lambda argv: seen.append(argv) or subprocess.CompletedProcess(argv, 0))
    assert run.main(["all"]) == 0
    assert [Path(argv[1]).name for argv in seen] == [script for script, _ in run.ROUTINES.values()]
    assert all(len(argv) == 2 for argv in seen)  # neither --quick nor --jsonl unless asked


def test_python_m_kernforge_bench_delegates_to_the_driver():
    done = subprocess.run(
        [sys.executable, "-m", "kernforge", "bench", "list"], capture_output=True, text=True, cwd=REPO_ROOT
    )
    assert done.returncode == 0, done.stderr
    assert "gemm" in done.stdout and "bench_gemm.py" in done.stdout


def test_bench_outside_a_checkout_says_where_the_routines_are(monkeypatch, tmp_path, capsys):
    from kernforge import cli

    monkeypatch.setattr(cli, "BENCH_DRIVER", tmp_path / "benchmarks" / "run.py")
    assert cli.main(["bench", "list"]) == 2
    assert "source checkout's benchmarks/" in capsys.readouterr().err


# --------------------------------------------------------------------------- records


def _records(monkeypatch) -> None:
    monkeypatch.setattr(records, "RECORDS", [])
    records.emit("bf16 M=1 K=64 N=64", "kernforge", "time", 12.5, "us", params={"M": 1, "dtype": "bf16"})
    records.emit("bf16 M=1 K=64 N=64", "torch", "time", float("nan"), "us", bound=("DRAM read", math.inf))
    records.emit("tuple", "kernforge", "GB/s", 3, "GB/s", params={"shape": (2, 3), "odd": object}, bound=("L2", 1.0))


def test_records_are_self_contained_json_lines(monkeypatch, tmp_path):
    _records(monkeypatch)
    path = tmp_path / "sub" / "out.jsonl"
    assert records.write_jsonl(path, records.RECORDS, routine="gemm", command="python x.py", quick=True) == 3
    assert records.write_jsonl(path, records.RECORDS[:1], routine="decode", command="c", quick=False) == 1  # appends
    found = records.read_jsonl(path)  # parses and checks every line against FIELDS
    assert [r["routine"] for r in found] == ["gemm", "gemm", "gemm", "decode"]
    first, nan, odd = found[:3]
    assert list(first) == list(records.FIELDS)
    assert first["value"] == 12.5 and first["params"] == {"M": 1, "dtype": "bf16"} and first["bound"] is None
    assert nan["value"] is None and nan["bound"] == {"name": "DRAM read", "value": None}  # strict JSON: no NaN
    assert odd["params"]["shape"] == [2, 3] and isinstance(odd["params"]["odd"], str)
    assert odd["bound"] == {"name": "L2", "value": 1.0}
    assert set(first["machine"]) == set(records.MACHINE_FIELDS) and first["machine"]["kind"] == machine.machine_kind()
    assert first["quick"] is True and first["command"] == "python x.py" and first["date"].startswith("20")
    assert first["commit"] is None or isinstance(first["commit"], str)


def test_a_bad_line_is_named():
    good = {
        "routine": "r", "case": "c", "impl": "i", "metric": "m", "value": 1.0, "unit": "u", "params": {},
        "bound": None, "machine": {"kind": "other", "cpu": "x", "cores": 1, "tier": "scalar"}, "date": "d",
        "commit": None, "command": "c", "quick": False,
    }  # fmt: skip
    assert records.problems(good) == []
    assert records.problems({**good, "value": "fast"}) == ["'value' is str"]
    assert records.problems({k: v for k, v in good.items() if k != "unit"}) == ["missing 'unit'"]
    assert records.problems({**good, "machine": {}})[0] == "machine lacks 'kind'"
    assert records.problems([]) == ["not a JSON object: list"]


def test_harness_jsonl_writes_the_records_at_exit(tmp_path):
    """A routine needs no code for --jsonl: base_parser's parse_args sets up the writer."""
    script = tmp_path / "bench_fake.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {str(BENCH_DIR)!r})
            import _harness as H
            args = H.base_parser("fake").parse_args()
            H.emit("case", "kernforge", "time", 1.5, "us", params={{"quick": args.quick}})
            raise SystemExit(0)
            """
        )
    )
    out = tmp_path / "out.jsonl"
    done = subprocess.run([sys.executable, str(script), "--quick", "--jsonl", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    (line,) = records.read_jsonl(out)
    assert line["routine"] == "fake" and line["quick"] is True and line["params"] == {"quick": True}
    assert line["command"].endswith("bench_fake.py --quick --jsonl " + str(out))


# --------------------------------------------------------------------------- the machine


def _cpuinfo(vendor: str, family: int, flags: str) -> str:
    block = f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel name\t: CPU\nflags\t\t: {flags}\n"
    return block + "\n" + block.replace(": 0", ": 1") + "\n"


@pytest.mark.parametrize(
    ("vendor", "family", "flags", "kind"),
    [
        ("AuthenticAMD", 25, "fpu avx2 avx512f avx512_bf16", "zen4"),
        ("AuthenticAMD", 25, "fpu avx2", "other"),  # Zen 3: family 25 without AVX-512
        ("AuthenticAMD", 26, "fpu avx2 avx512f avx512_bf16", "zen5"),
        ("AuthenticAMD", 23, "fpu avx2", "other"),  # Zen 2
        ("GenuineIntel", 6, "avx512f amx_bf16 amx_tile", "xeon-amx"),
        ("GenuineIntel", 6, "avx512f", "xeon"),
        ("", 0, "", "other"),  # no vendor line (an Arm machine's cpuinfo)
    ],
)
def test_machine_kind_from_cpuinfo(vendor, family, flags, kind):
    assert machine.machine_kind(_cpuinfo(vendor, family, flags)) == kind


def test_machine_kind_reads_only_the_first_processor():
    text = _cpuinfo("GenuineIntel", 6, "avx512f amx_tile") + _cpuinfo("AuthenticAMD", 26, "avx512f")
    assert machine.machine_kind(text) == "xeon-amx"
    assert machine.cpu_flags(text) == {"avx512f", "amx_tile"} and machine.cpu_model(text) == "CPU"


def test_cache_sizes_from_sysfs(tmp_path):
    for i, (level, kind, size) in enumerate([(1, "Data", "48K"), (1, "Instruction", "32K"), (2, "Unified", "1024K"),
                                              (3, "Unified", "32M")]):  # fmt: skip
        index = tmp_path / f"index{i}"
        index.mkdir()
        (index / "level").write_text(f"{level}\n")
        (index / "type").write_text(f"{kind}\n")
        (index / "size").write_text(f"{size}\n")
    assert machine.cache_bytes(1, 0, tmp_path) == 48 * 1024
    assert machine.cache_bytes(2, 0, tmp_path) == 1 << 20
    assert machine.cache_bytes(3, 0, tmp_path) == 32 << 20
    assert machine.cache_bytes(4, 7, tmp_path) == 7  # no such level: the default


def test_roof_from_the_probes_or_torch_where_they_cannot_run(monkeypatch):
    """The roof's table (what the routines state figures against) from the stream and dot-peak
    probes, or from torch's copy, sum and matmul where those cannot be built (no avx512 tier)."""
    levels = ("L2", "L3", "DRAM")
    stream = {lv: {"copy": 2.0, "r": 1.0, "rw": 3.0} for lv in levels}
    monkeypatch.setattr(machine, "stream_bandwidth", lambda threads, budget_s: stream)
    monkeypatch.setattr(machine, "bf16_peak", lambda threads: (900.0, "AMX tiles (TDPBF16PS)"))
    found = machine.roof(2, budget_s=0.01)
    assert {k: found[k] for k in ("L2_rw", "L2_r", "DRAM_rw", "DRAM_r", "bf16_gflops")} == {
        "L2_rw": 3.0, "L2_r": 1.0, "DRAM_rw": 3.0, "DRAM_r": 1.0, "bf16_gflops": 900.0,
    }  # fmt: skip
    assert found["source"] == "measured now: stream probe, AMX tiles (TDPBF16PS)"
    monkeypatch.setattr(machine, "stream_bandwidth", lambda threads, budget_s: None)
    monkeypatch.setattr(machine, "bf16_peak", lambda threads: None)
    monkeypatch.setattr(machine, "copy_bandwidth", lambda budget_s: dict.fromkeys(levels, 8.0))
    monkeypatch.setattr(machine, "read_bandwidth", lambda budget_s: dict.fromkeys(levels, 4.0))
    monkeypatch.setattr(machine, "matmul_rate", lambda threads, budget_s: 50.0)
    found = machine.roof(1, budget_s=0.01)
    assert (found["L3_rw"], found["L3_r"], found["bf16_gflops"]) == (8.0, 4.0, 50.0)
    assert found["source"] == "measured now: torch copy and sum, torch bf16 matmul"


# --------------------------------------------------------------------------- the timer


class _FakeClock:
    """A clock that moves only when the timed function runs: every call takes ``step_ns``."""

    def __init__(self, step_ns: int) -> None:
        self.now, self.step_ns, self.calls = 0, step_ns, 0

    def __call__(self) -> int:
        self.now += 1  # reading the clock costs 1 ns, as a real one costs something
        return self.now

    def work(self) -> None:
        self.calls += 1
        self.now += self.step_ns


def test_measure_on_a_fake_clock(monkeypatch):
    clock = _FakeClock(1000)
    monkeypatch.setattr(timing, "now_ns", clock)
    t = timing.measure(clock.work, budget_s=0.001, min_samples=5, sample_ns=20_000)
    assert t.inner >= 19  # ~20 us samples of 1 us calls
    assert 1000 <= t.median_ns <= 1001 and t.samples >= 5 and t.spread() < 0.01
    assert t.to_json()["samples"] == t.samples


def test_compare_samples_every_function(monkeypatch):
    clock = _FakeClock(100)
    monkeypatch.setattr(timing, "now_ns", clock)

    def slow() -> None:  # ten times clock.work, on the same clock
        clock.now += 1000

    found = timing.compare({"fast": clock.work, "slow": slow}, budget_s=0.0003, rounds=3, min_samples=6)
    assert set(found) == {"fast", "slow"}
    assert 100 <= found["fast"].median_ns < 110 and 1000 <= found["slow"].median_ns < 1010
    assert found["fast"].samples >= 6 and found["slow"].samples >= 6


def test_time_call_is_the_tuners_timer(monkeypatch):
    assert tuning.time_call is timing.time_call  # one timer: the tuners use the benchmarks'
    clock = _FakeClock(2_000_000)  # 2 ms a call
    monkeypatch.setattr(timing, "now_ns", clock)
    seconds = timing.time_call(clock.work, min_seconds=0.01, max_calls=50)
    assert seconds == pytest.approx(0.002, rel=1e-3)
    assert 1 + 3 <= clock.calls <= 1 + 50  # one warm-up call (it compiles), then 3..max_calls samples


def test_measure_on_the_real_clock():
    t = timing.measure(lambda: sum(range(100)), budget_s=0.02, min_samples=3)
    assert t.median_ns > 0 and t.samples >= 3 and t.p25_ns <= t.median_ns <= t.p75_ns
    assert json.dumps(t.to_json())
