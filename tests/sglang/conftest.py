"""SGLang's tests: run in SGLang's own environment by ``make test-sglang`` (``make test``'s environment
has no SGLang and leaves this folder out; see tests/sglang/README.md).

* ``sglang_model_dir``: a tiny random-weight Llama directory whose vocabulary (10240) covers the token ids
  ``sglang.benchmark.one_batch`` draws (``randint(0, 10000)``), built once per session.
"""

import pytest

# sglang.version, not sglang: where SGLang is not installed, `sglang` imports as a namespace package,
# this folder (tests/ is on sys.path while pytest collects).
pytest.importorskip(
    "sglang.version", reason="SGLang is not installed here: `make test-sglang` runs these tests in its environment"
)


@pytest.fixture(scope="session")
def sglang_model_dir(tmp_path_factory):
    from kernforge.integrations import random_llama

    path = tmp_path_factory.mktemp("sglang-model") / "tiny-llama-10k"
    model = random_llama.random_llama("tiny", max_position_embeddings=4096, vocab_size=10240)
    model.save_pretrained(path)
    random_llama._tokenizer(model.config.vocab_size).save_pretrained(path)
    return path
