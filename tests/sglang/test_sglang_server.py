"""A real client against a real server: ``python -m sglang.launch_server --model-path DIR --device cpu`` with
kernforge's sgl_kernel (SGLang's default attention backend on x86, ``intel_amx``, served by kernforge on
this CPU whatever its tier), answering the ``openai`` client's streaming and plain completions, several at
once (examples/sglang_serve.md is the same by hand)."""

import json
import os
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from kernforge.integrations._server import free_port, served

pytestmark = pytest.mark.slow
START_TIMEOUT = 420  # seconds: about 30 s here, far more on a loaded machine


@pytest.fixture(scope="module")
def server(sglang_model_dir, tmp_path_factory):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KERNFORGE_SGLANG")}
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    port = free_port()
    command = [
        sys.executable, "-m", "sglang.launch_server", "--model-path", str(sglang_model_dir), "--device", "cpu",
        "--host", "127.0.0.1", "--port", str(port), "--max-total-tokens", "4096",
    ]  # fmt: skip
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    with served(command, port, env, log_path, START_TIMEOUT, "SGLang's server") as url:
        yield url, log_path


def _client(url):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=300)


def test_the_server_runs_its_intel_amx_backend_on_kernforge(server):
    url, log_path = server
    with urllib.request.urlopen(f"{url}/get_server_info", timeout=30) as response:
        info = json.loads(response.read())
    assert info["attention_backend"] == "intel_amx", info["attention_backend"]
    assert "fallback to torch_native" not in log_path.read_text()


def test_streaming_and_plain_completions_agree(server, sglang_model_dir):
    url, _ = server
    client = _client(url)
    model, prompt = str(sglang_model_dir), " ".join(f"w{i}" for i in (17, 230, 5, 999, 64, 3, 411))
    greedy = {"max_tokens": 16, "temperature": 0, "extra_body": {"ignore_eos": True}}
    plain = client.completions.create(model=model, prompt=prompt, **greedy)
    assert plain.usage.completion_tokens == 16
    chunks = client.completions.create(model=model, prompt=prompt, stream=True, **greedy)
    streamed = [chunk.choices[0].text for chunk in chunks if chunk.choices]
    assert len(streamed) > 1 and "".join(streamed) == plain.choices[0].text  # greedy: the same tokens, in pieces


def test_concurrent_requests_of_uneven_lengths(server, sglang_model_dir):
    url, _ = server
    client = _client(url)
    prompts = [" ".join(f"w{(7 * i + j) % 1000 + 3}" for j in range(n)) for i, n in enumerate((1, 40, 3, 700, 90, 9))]

    def complete(prompt):
        greedy = {"max_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True}}
        response = client.completions.create(model=str(sglang_model_dir), prompt=prompt, **greedy)
        return response.usage

    with ThreadPoolExecutor(len(prompts)) as pool:
        usages = list(pool.map(complete, prompts))
    for prompt, usage in zip(prompts, usages):
        assert usage.completion_tokens == 12
        assert usage.prompt_tokens >= len(prompt.split()), (usage, len(prompt.split()))
