"""The vLLM plugin's tests: run in vLLM's own environment by ``make test-vllm`` (``make test``'s
environment has no vLLM and leaves this folder out).

* ``model_dir``: a tiny random-weight Llama directory (GQA, Llama 3 RoPE scaling, a word-level
  tokenizer), built once per session.
* ``moe_model_dir``: the same size as a Qwen3-MoE (8 experts of 96, 2 per token, renormalized; the
  tiny Llama's tokenizer), built once per session.
* ``mla_model_dir``: a DeepSeek-V2 as small as vLLM's CPU MLA takes (its 512 + 64 latent; 4 heads,
  a dense layer then 8 experts of 96, 2 per token, and a shared one), built once per session.
* ``vllm_config``: vLLM's config for that model, current while a test builds vLLM layers.
"""

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs these tests in its environment")

from kernforge.integrations.random_llama import make_model_dir  # noqa: E402


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("vllm-model") / "tiny-llama", "tiny", max_position=2048)


@pytest.fixture(scope="session")
def moe_model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("vllm-moe-model") / "tiny-moe", "tiny-moe", max_position=2048)


@pytest.fixture(scope="session")
def mla_model_dir(tmp_path_factory):
    return make_model_dir(
        tmp_path_factory.mktemp("vllm-mla-model") / "tiny-deepseek", "tiny-deepseek", max_position=2048
    )


@pytest.fixture
def vllm_config(model_dir):
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config

    config = VllmConfig(model_config=ModelConfig(model=str(model_dir), dtype="bfloat16", skip_tokenizer_init=True))
    with set_current_vllm_config(config):
        yield config
