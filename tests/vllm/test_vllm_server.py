"""A real client against a real server: ``vllm serve`` with kernforge's plugin, its kernels
pre-warmed from the model's config beforehand (the server compiles nothing), answering the
``openai`` client's streaming and plain completions, several at once."""

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from kernforge.integrations.vllm.server import openai_server

pytestmark = pytest.mark.slow
START_TIMEOUT = 420  # seconds: vLLM's start here is 20-60 s, far more on a loaded machine


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    cache = tmp_path_factory.mktemp("kernforge-cache")
    env = {**os.environ, "KERNFORGE_CACHE_DIR": str(cache), "VLLM_CPU_KVCACHE_SPACE": "1", "KERNFORGE_VLLM": "1"}
    prewarm = [sys.executable, "-m", "kernforge", "prewarm", "--model-config", str(model_dir / "config.json")]
    subprocess.run(prewarm, env=env, check=True, capture_output=True, timeout=600)
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    arguments = ["--dtype", "bfloat16", "--max-model-len", "2048", "--enforce-eager"]
    with openai_server(model_dir, arguments, env, log_path, START_TIMEOUT) as url:
        yield f"{url}/v1", log_path


def _client(url):
    from openai import OpenAI

    return OpenAI(base_url=url, api_key="unused", timeout=300)


def test_streaming_and_plain_completions_agree(server, model_dir):
    url, log_path = server
    client = _client(url)
    prompt = " ".join(f"w{i}" for i in (17, 230, 5, 999, 64, 3, 411))
    plain = client.completions.create(model=str(model_dir), prompt=prompt, max_tokens=20, temperature=0)
    text = plain.choices[0].text
    chunks = client.completions.create(model=str(model_dir), prompt=prompt, max_tokens=20, temperature=0, stream=True)
    streamed = [chunk.choices[0].text for chunk in chunks if chunk.choices]
    assert len(streamed) > 1 and "".join(streamed) == text  # greedy: the same tokens, in pieces
    words = text.split()
    assert 0 < len(words) <= 20 and all(w.startswith("w") and w[1:].isdigit() for w in words), text
    log = log_path.read_text()
    assert "runs vLLM's attention (CPU_ATTN)" in log
    assert "kernforge: compiling" not in log, "the server compiled a kernel the pre-warm did not build"


def test_concurrent_requests_of_uneven_lengths(server, model_dir):
    url, _ = server
    client = _client(url)
    prompts = [
        " ".join(f"w{(7 * i + j) % 1000 + 3}" for j in range(length)) for i, length in enumerate((1, 40, 3, 700, 90, 9))
    ]

    def complete(prompt):
        response = client.completions.create(model=str(model_dir), prompt=prompt, max_tokens=12, temperature=0)
        return response.choices[0].text, response.usage

    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(complete, prompts))
    for prompt, (text, usage) in zip(prompts, results):
        assert usage.prompt_tokens == len(prompt.split()) and usage.completion_tokens == 12
        assert len(text.split()) == 12
