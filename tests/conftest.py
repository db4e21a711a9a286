"""Shared fixtures for the kernforge op tests.

* ``kernforge_cache_dir`` (session, autouse): every test session compiles into
  a brand-new, private ``KERNFORGE_CACHE_DIR`` (pre-warmed in parallel), so a
  stale cache can never make CI green.
* ``tier``: parametrizes a test over every ISA tier this CPU can run and
  forces that tier for the duration of the test.
* ``assert_close_ref``: compares a kernel result against a float32 PyTorch
  reference with per-dtype tolerances.
"""

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

import kernforge
import kernforge.jit.isa
from kernforge.jit import core, render

# Tolerances (atol, rtol) per *kernel* dtype. The reference is always computed
# in float32 from the same, already-rounded inputs.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (1e-2, 1e-2),
    torch.float16: (1e-3, 1e-3),
}

_CACHE_ENV = "KERNFORGE_CACHE_DIR"

# Every session compiles into a brand-new private cache (mkdtemp makes it 0700),
# so a stale cache can never make CI green. It is set at import, before
# collection, because discovering the tiers already runs the JIT-compiled CPU probe.
_SESSION_CACHE = tempfile.mkdtemp(prefix="kernforge-test-cache-")
_SAVED_CACHE_ENV = os.environ.get(_CACHE_ENV)
os.environ[_CACHE_ENV] = _SESSION_CACHE
_TIERS = list(kernforge.jit.isa.runnable_tiers())


@pytest.fixture(scope="session", autouse=True)
def kernforge_cache_dir():
    """The session's fresh cache, pre-warmed with every op variant on every
    runnable tier (in parallel on all cores, instead of one by one in the tests)."""
    specs = list({
        variant.spec(tier): None
        for tier in _TIERS for variants in kernforge.ops.OP_VARIANTS.values() for variant in variants.values()
    })
    kernforge.prewarm(specs, progress=False)
    yield Path(_SESSION_CACHE)
    if _SAVED_CACHE_ENV is None:
        os.environ.pop(_CACHE_ENV, None)
    else:
        os.environ[_CACHE_ENV] = _SAVED_CACHE_ENV
    shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


@pytest.fixture(params=_TIERS, ids=[f"isa={t}" for t in _TIERS])
def tier(request):
    """Run the test with ``kernforge.use_isa(tier)`` active, for every runnable tier."""
    with kernforge.use_isa(request.param):
        yield request.param


TEST_TEMPLATES = Path(__file__).resolve().parent / "templates"
# Settings a JIT/cache test must not inherit from the caller's environment.
_JIT_ENV_VARS = ("KERNFORGE_JIT", "KERNFORGE_ISA", "KERNFORGE_CXX", "CXX", "KERNFORGE_CFFI_MODE",
                 "KERNFORGE_LOCK_TIMEOUT")


def clean_env(**extra) -> dict:
    """This process's environment without kernforge JIT settings, plus ``extra``: for child processes."""
    env = {k: v for k, v in os.environ.items() if k not in _JIT_ENV_VARS}
    env.update({k: str(v) for k, v in extra.items()})
    return env


@pytest.fixture(scope="module")
def test_templates():
    """Put tests/templates on the template search path for a module, then take it off again."""
    saved = list(render._user_dirs)
    kernforge.register_template_dir(TEST_TEMPLATES)
    yield TEST_TEMPLATES
    render._user_dirs[:] = saved
    core.invalidate_dispatch()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh private cache root, a neutral environment and an empty in-process memo."""
    root = tmp_path / "kf-cache"
    root.mkdir()
    os.chmod(root, 0o700)
    monkeypatch.setenv("KERNFORGE_CACHE_DIR", str(root))
    for var in _JIT_ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(core, "_memo", {})
    return root


def _assert_close_ref(actual, expected, dtype, msg=None):
    """Compare ``actual`` (kernel output, any float dtype) against a float32 reference.

    ``dtype`` selects the tolerance (the dtype the kernel computed in).
    """
    atol, rtol = TOLERANCES[dtype]
    assert actual.shape == expected.shape, (
        f"{msg + ': ' if msg else ''}shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    kwargs = {}
    if msg is not None:
        kwargs["msg"] = lambda m: f"{msg}\n{m}"
    torch.testing.assert_close(
        actual.to(torch.float32), expected.to(torch.float32),
        atol=atol, rtol=rtol, check_device=True, **kwargs,
    )


@pytest.fixture
def assert_close_ref():
    """The tolerance helper: ``assert_close_ref(actual, expected_fp32, dtype, msg=None)``."""
    return _assert_close_ref
