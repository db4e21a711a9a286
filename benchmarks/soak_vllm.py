"""A served engine under load and faults (issue 41): vLLM's OpenAI server with kernforge's plugin on
the loopback, ``--clients`` concurrent clients for ``--minutes``, each sending, at random:

    greedy     a streamed greedy completion (prompt 1 .. 3/4 of the context, 1 .. 48 new tokens;
               it must stream them all, or fewer ending at the end-of-sequence token)
    sampled    a streamed completion at temperature 0.8, top-p 0.9, top-k 20 (unseeded: vLLM 0.32's
               CPU engine dies on a seeded request whose prompt is prefilled in chunks, with or
               without the plugin: docs/vllm.md#known-issues)
    disconnect a streamed completion the client closes after 1-3 chunks
    too long   a prompt past the context length (the server must refuse it: HTTP 400)
    bad params a negative temperature, top_p > 1, or max_tokens < 1 (HTTP 400)

Checked: every request is answered, or refused with HTTP 400 where it should be; after the load, a
sample of the greedy requests is sent again one at a time and must give the same text, or leave it
first at a near tie (alone, the batched run's token within NEAR_TIE of the chosen one's log-probability:
batching changes the rounding); the server's
resident memory (every process of it) is sampled every few seconds and must be flat after
--warm-up minutes (the later half's median within --rss-slack of the earlier half's); its log must
hold no traceback and no kernforge error. Prints a JSON report (``--json`` writes it to a file too) and exits 1 if any
check failed.

    .venv-vllm/bin/python benchmarks/soak_vllm.py --minutes 10 --clients 8 --json soak.json
    .venv-vllm/bin/python benchmarks/soak_vllm.py --minutes 1 --clients 4     # tests/vllm's smoke

Model: the tiny random Llama (``random_llama``, word-level tokenizer ``w<N>``) unless ``--shape``
says otherwise; its kernels are pre-warmed first, so the server compiles nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

from kernforge.bench import records
from kernforge.integrations.random_llama import make_model_dir
from kernforge.integrations.vllm.server import openai_server
from kernforge.jit.isa import cpu_model

# Greedy texts that differ alone and batched pass where, alone, the batched run's token was within this
# much log-probability of the chosen one: bf16 logits of a few units carry rounding errors of ~0.01-0.05.
NEAR_TIE = 0.1
KINDS = {"greedy": 6, "sampled": 2, "disconnect": 2, "too long": 1, "bad params": 1}
BAD_PARAMS = [{"temperature": -1.0}, {"top_p": 1.5}, {"max_tokens": 0}, {"max_tokens": -3}]
VOCAB_WORDS = range(3, 1000)  # the tiny tokenizer's words w3 .. w999 (0-2 are <unk>, <s>, </s>)


def prompt_of(rng: random.Random, length: int) -> str:
    return " ".join(f"w{rng.choice(VOCAB_WORDS)}" for _ in range(length))


class Soak:
    def __init__(self, url: str, model: str, context: int, seed: int):
        from openai import OpenAI

        self.client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=600, max_retries=0)
        self.model, self.context, self.seed = model, context, seed
        self.outcomes: Counter[str] = Counter()
        self.failures: list[str] = []
        self.answered_greedy: list[tuple[str, int, str]] = []  # (prompt, max_tokens, text)
        self.tokens = 0
        self.lock = threading.Lock()

    def client_loop(self, index: int, deadline: float) -> None:
        rng = random.Random(self.seed * 1000 + index)
        while time.monotonic() < deadline:
            kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
            try:
                outcome = getattr(self, kind.replace(" ", "_"))(rng)
            except Exception as error:  # a request neither answered nor refused as it should be
                outcome = "failed"
                with self.lock:
                    self.failures.append(f"{kind}: {type(error).__name__}: {error}"[:500])
            with self.lock:
                self.outcomes[f"{kind}: {outcome}"] += 1

    def _stream(self, prompt: str, max_tokens: int, **sampling) -> tuple[str, int]:
        """The streamed text and its token count, checked: ``max_tokens`` tokens, or up to that many
        ending at the end-of-sequence token; a word per token (special tokens, skipped in the text, aside)."""
        stream = self.client.completions.create(
            model=self.model,
            prompt=prompt,
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            **sampling,
        )
        chunks = list(stream)
        choices = [chunk.choices[0] for chunk in chunks if chunk.choices]
        text, finish = "".join(c.text for c in choices), choices[-1].finish_reason if choices else None
        tokens, words = chunks[-1].usage.completion_tokens if chunks[-1].usage else -1, len(text.split())
        if not ((finish == "length" and tokens == max_tokens) or (finish == "stop" and tokens <= max_tokens)):
            raise AssertionError(f"{max_tokens} tokens asked, {tokens} generated, finish reason {finish!r}")
        if words > tokens:
            raise AssertionError(f"{tokens} tokens generated, {words} words streamed")
        return text, tokens

    def greedy(self, rng: random.Random) -> str:
        prompt, max_tokens = prompt_of(rng, rng.randint(1, self.context * 3 // 4)), rng.randint(1, 48)
        text, tokens = self._stream(prompt, max_tokens, temperature=0)
        with self.lock:
            self.answered_greedy.append((prompt, max_tokens, text))
            self.tokens += tokens
        return "answered"

    def sampled(self, rng: random.Random) -> str:
        prompt, max_tokens = prompt_of(rng, rng.randint(1, 256)), rng.randint(1, 32)
        sampling = {"temperature": 0.8, "top_p": 0.9, "extra_body": {"top_k": 20}}
        _, tokens = self._stream(prompt, max_tokens, **sampling)
        with self.lock:
            self.tokens += tokens
        return "answered"

    def disconnect(self, rng: random.Random) -> str:
        stream = self.client.completions.create(
            model=self.model, prompt=prompt_of(rng, rng.randint(1, 512)), max_tokens=64, temperature=0, stream=True
        )
        keep = rng.randint(1, 3)
        for count, _ in enumerate(stream, 1):
            if count >= keep:
                break
        stream.close()
        return "closed mid-stream"

    def too_long(self, rng: random.Random) -> str:
        return self._refused(prompt_of(rng, self.context + rng.randint(1, 64)), max_tokens=8)

    def bad_params(self, rng: random.Random) -> str:
        return self._refused(prompt_of(rng, 8), **{"max_tokens": 8, **rng.choice(BAD_PARAMS)})

    def _refused(self, prompt: str, **request) -> str:
        from openai import BadRequestError

        try:
            self.client.completions.create(model=self.model, prompt=prompt, **request)
        except BadRequestError:
            return "refused (400)"
        raise AssertionError(f"accepted a request it must refuse: {request}")

    def replay_alone(self, count: int, rng: random.Random) -> list[dict]:
        """Sends a sample of the greedy requests again, one at a time; returns those whose text
        differs, each with the first differing token and how far apart, alone, the two candidates'
        log-probabilities were there (batching changes the rounding, which can flip a near tie)."""
        differing = []
        for prompt, max_tokens, text in rng.sample(self.answered_greedy, min(count, len(self.answered_greedy))):
            alone = self.client.completions.create(
                model=self.model, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=5
            ).choices[0]
            if alone.text != text:
                differing.append({"prompt_words": len(prompt.split()), **first_difference(alone, text.split())})
        return differing


def first_difference(alone, batched_words: list[str]) -> dict:
    """Where the text sent alone leaves the batched one, and the log-probability gap, alone, between
    its token and the batched run's there (None where the two do not align word for word)."""
    tokens, top = alone.logprobs.tokens, alone.logprobs.top_logprobs
    position = next((i for i, (a, b) in enumerate(zip(tokens, batched_words)) if a.strip() != b), None)
    if position is None:
        return {"token": min(len(tokens), len(batched_words)), "gap": None}
    candidates = {word.strip(): logprob for word, logprob in top[position].items()}
    batched = candidates.get(batched_words[position])
    gap = None if batched is None else candidates[tokens[position].strip()] - batched
    seen = {"alone": tokens[position], "batched": batched_words[position], "top": candidates}
    return {"token": position, "gap": gap, **seen}


class RssSampler(threading.Thread):
    """The server's resident memory, every process of it (vLLM's engine runs in a child), in MiB."""

    def __init__(self, pid: int, every_s: float):
        super().__init__(daemon=True)
        self.root, self.every_s = psutil.Process(pid), every_s
        self.samples: list[tuple[float, float, list[float]]] = []  # (s, total MiB, per process)
        self.stopped = threading.Event()
        self.start_time = time.monotonic()

    def run(self) -> None:
        while not self.stopped.wait(self.every_s):
            rss = [_rss_mib(p) for p in (self.root, *self.root.children(recursive=True))]
            self.samples.append((round(time.monotonic() - self.start_time, 1), round(sum(rss), 1), rss))


def _rss_mib(process: psutil.Process) -> float:
    try:
        return round(process.memory_info().rss / 2**20, 1)
    except psutil.NoSuchProcess:
        return 0.0


def rss_verdict(samples: list[tuple[float, float, list[float]]], warm_up_s: float, slack: float) -> dict:
    """Flat after warm-up: past ``warm_up_s``, the second half's median within ``slack`` of the
    first half's. Warm-up includes the KV cache becoming resident: it is mapped untouched and its
    pages fault in as blocks are first written (about two minutes at 4 clients here)."""
    values = [rss for seconds, rss, _ in samples if seconds >= warm_up_s]
    if len(values) < 8:
        return {"flat": None, "why": f"{len(values)} samples after {warm_up_s:g} s of warm-up: too few to tell"}
    half = len(values) // 2
    early, late = statistics.median(values[:half]), statistics.median(values[half:])
    return {
        "flat": late <= early * (1 + slack),
        "after_warm_up_MiB": early,
        "end_MiB": late,
        "growth": round(late / early - 1, 4),
        "start_MiB": samples[0][1],
    }


def log_problems(log: str) -> list[str]:
    markers = ("Traceback", "kernforge: error", "KernforgeError", "CompileError", "Segmentation fault")
    return [line.strip()[:300] for line in log.splitlines() if any(m in line for m in markers)]


def server_pid(url: str) -> int:
    port = int(url.rsplit(":", 1)[1])
    for connection in psutil.net_connections("tcp"):
        if connection.status == psutil.CONN_LISTEN and connection.laddr.port == port and connection.pid:
            return connection.pid
    raise RuntimeError(f"no process listens on port {port}")


def emit_records(report: dict, shape: str) -> None:
    """The soak's figures as the benchmarks' JSON lines (the performance page's soak table)."""
    case = f"{shape} llama, {report['clients']} clients, {report['minutes']:g} min"
    params = {"clients": report["clients"], "minutes": report["minutes"], "context": report["context"]}
    near_ties = sum(1 for d in report["differing_alone"] if d["gap"] is not None and d["gap"] <= NEAR_TIE)
    failed = len(report["failures"]) + sum(n for outcome, n in report["outcomes"].items() if "failed" in outcome)
    figures = [
        ("requests", report["requests"], "requests"),
        ("requests failed", failed, "requests"),
        ("generated tokens", report["generated_tokens"], "tokens"),
        ("greedy replayed alone", report["replayed_alone"], "requests"),
        ("replayed alone, differing at a near tie", near_ties, "requests"),
        ("replayed alone, differing otherwise", len(report["differing_alone"]) - near_ties, "requests"),
        ("kernforge or traceback lines in the log", len(report["log_problems"]), "lines"),
    ]
    rss = report["rss"]
    if rss.get("flat") is not None:
        figures += [
            ("RSS after warm-up", rss["after_warm_up_MiB"], "MiB"),
            ("RSS at the end", rss["end_MiB"], "MiB"),
            ("RSS growth after warm-up", 100 * rss["growth"], "%"),
        ]
    for metric, value, unit in figures:
        records.emit(case, "kernforge+vllm", metric, value, unit, params=params)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--shape", default="tiny")
    parser.add_argument("--context", type=int, default=1024, help="the server's --max-model-len")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--replay", type=int, default=40, help="greedy requests sent again alone")
    parser.add_argument("--rss-every", type=float, default=5.0, help="seconds between RSS samples")
    parser.add_argument("--rss-slack", type=float, default=0.02, help="RSS growth allowed after warm-up")
    parser.add_argument("--warm-up", type=float, default=3.0, help="minutes before RSS must be flat")
    parser.add_argument("--plugin", default="1", help="KERNFORGE_VLLM for the server (default: every part)")
    parser.add_argument("--json", help="also write the report here")
    parser.add_argument("--jsonl", help="append the figures to this file as the benchmarks' JSON lines")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="kernforge-soak-"))
    model = make_model_dir(work / "model", args.shape, max_position=4 * args.context)
    env = {**os.environ, "KERNFORGE_CACHE_DIR": str(work / "cache"), "KERNFORGE_VLLM": args.plugin}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    prewarm = [sys.executable, "-m", "kernforge", "prewarm", "--model-config", str(model / "config.json")]
    subprocess.run(prewarm, env=env, check=True, capture_output=True, timeout=1200)
    log_path = work / "server.log"
    arguments = ["--dtype", "bfloat16", "--max-model-len", str(args.context), "--enforce-eager"]
    with openai_server(model, arguments, env, log_path, timeout_s=600) as url:
        soak = Soak(url, str(model), args.context, args.seed)
        sampler = RssSampler(server_pid(url), args.rss_every)
        sampler.start()
        start = time.monotonic()
        deadline = start + 60 * args.minutes
        with ThreadPoolExecutor(args.clients) as pool:
            list(pool.map(lambda i: soak.client_loop(i, deadline), range(args.clients)))
        elapsed = time.monotonic() - start
        sampler.stopped.set()
        sampler.join()
        differing = soak.replay_alone(args.replay, random.Random(args.seed))
        log = log_path.read_text()  # before the server stops (its shutdown logs a dead engine)
    rss = rss_verdict(sampler.samples, 60 * args.warm_up, args.rss_slack)
    report = {
        "cpu": cpu_model(),
        "date": time.strftime("%Y-%m-%d"),
        "minutes": round(elapsed / 60, 2),
        "clients": args.clients,
        "context": args.context,
        "plugin": args.plugin,
        "requests": sum(soak.outcomes.values()),
        "outcomes": dict(sorted(soak.outcomes.items())),
        "generated_tokens": soak.tokens,
        "failures": soak.failures[:20],
        "replayed_alone": min(args.replay, len(soak.answered_greedy)),
        "differing_alone": differing,
        "rss": rss,
        "rss_samples_MiB": sampler.samples,
        "log_problems": log_problems(log)[:20],
        "plugin_parts": [line.strip() for line in log.splitlines() if "kernforge" in line and "runs" in line][:10],
    }
    clear = [d for d in differing if d["gap"] is None or d["gap"] > NEAR_TIE]
    report["passed"] = not (report["failures"] or clear or report["log_problems"] or rss["flat"] is False)
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    if args.jsonl:
        emit_records(report, args.shape)
        records.write_jsonl(args.jsonl, records.RECORDS, routine="soak", command=" ".join(sys.argv), quick=False)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
