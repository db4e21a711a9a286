"""Shared fixtures and the suite's shape.

* Layout: one folder per op family, as in FlashInfer (``attention/``, ``gemm/``, ``ops/`` for
  norm/activation/rope/sampling, ``jit/`` for the JIT core and the tools, ``integrations/``); the
  helpers every family imports stay here (``op_helpers``, ``references``, ``kernels``, this file),
  importable by their bare names because pytest puts this folder on ``sys.path``. The folders have
  no ``__init__.py``: test modules import by basename, so a basename must be unique in the suite.
  Paths to other parts of the repository come from here (``TESTS_DIR``, ``REPO_ROOT``,
  ``EXAMPLES_DIR``, ``TEST_TEMPLATES``), not from a test file's own location.
* The cache: every run compiles on demand into its own brand-new private
  ``KERNFORGE_CACHE_DIR`` (so a stale cache can never make CI green), or, with
  ``--reuse-cache`` (local runs), into a persistent private one
  (``$KERNFORGE_TEST_CACHE``, else ``~/.cache/kernforge-test``): the content keys
  already rule out staleness, so a second run compiles only what changed.
  ``kernforge_cache_dir`` (session fixture) is that directory.
* ``tier``: parametrizes a test over every ISA tier this CPU can run and forces
  that tier for the duration of the test. The best tier runs the full matrix;
  on the lower tiers each parametrized test keeps a deterministic representative
  slice (see ``pytest_collection_modifyitems``); ``--all-tiers`` keeps everything,
  ``@pytest.mark.all_tiers`` keeps one test everywhere; ``--cover`` keeps only the covering part
  of that slice, on every tier the best one included (the sanitizer runs, ``make test-sanitize``).
  The vector layer itself is checked on every tier by its own conformance test.
* ``slow`` marks the multi-process tests and the long ones; ``make test`` (CI)
  runs everything, ``make test-fast`` deselects them.
* ``assert_close_ref``: compares a kernel result against a float32 PyTorch
  reference with per-dtype tolerances.
"""

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import pytest
import torch

import kernforge
import kernforge.jit.isa
from kernforge.jit import core, render

import kernels  # noqa: F401  (registers the test modules: axpy, broken, philox_kat, ...)

# Tolerances (atol, rtol) per *kernel* dtype. The reference is always computed
# in float32 from the same, already-rounded inputs.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (1e-2, 1e-2),
    torch.float16: (1e-3, 1e-3),
}

_CACHE_ENV = "KERNFORGE_CACHE_DIR"
_REUSED_CACHE_ENV = "KERNFORGE_TEST_CACHE"
_saved_cache_env = os.environ.get(_CACHE_ENV)
_run_cache: Path | None = None  # set in pytest_configure
_run_cache_is_temporary = False
_tiers: list[str] = []  # runnable tiers, best first (pytest_configure)

# Lower-tier slice: besides a cover of every parameter value, about one item in
# _EXTRA_ONE_IN of each test (by a stable hash of its parameters) runs there too.
_EXTRA_ONE_IN = 8


def pytest_addoption(parser):
    group = parser.getgroup("kernforge")
    group.addoption(
        "--reuse-cache",
        action="store_true",
        help=f"compile into a persistent private cache (${_REUSED_CACHE_ENV}, else "
        "~/.cache/kernforge-test) instead of a fresh one per run",
    )
    group.addoption(
        "--all-tiers",
        action="store_true",
        help="run the full parametrized matrix on every runnable tier, not only the best one",
    )
    group.addoption(
        "--cover",
        action="store_true",
        help="on every runnable tier, only a covering slice of each parametrized test (every value of every "
        "parameter at least once): the sanitizer slice (`make test-sanitize`)",
    )
    group.addoption(
        "--fuzz-seconds",
        type=float,
        default=120.0,
        help="the differential fuzzer's budget (tests/fuzz), shared by its targets; `make fuzz`: 3600",
    )
    group.addoption(
        "--fuzz-seed", type=int, default=0, help="the fuzzer's master seed (every case's seed derives from it)"
    )
    group.addoption("--fuzz-case", type=int, help="replay one fuzz case by the seed a failure printed")
    group.addoption("--fuzz-report", help="append the fuzzer's cases per target (JSON lines) to this file")


def _reused_cache_dir() -> Path:
    path = Path(os.environ.get(_REUSED_CACHE_ENV) or Path.home() / ".cache" / "kernforge-test").expanduser()
    if not path.exists():
        path.mkdir(parents=True, mode=0o700)
        os.chmod(path, 0o700)  # whatever the umask
    # An existing directory is used as it is: kernforge refuses it (CacheSecurityError) if others can write it.
    return path


def pytest_configure(config):
    global _run_cache, _run_cache_is_temporary
    config.addinivalue_line(
        "markers", "all_tiers: run every parametrization on every runnable tier (not only on the best one)"
    )
    if _run_cache is None:
        if config.getoption("reuse_cache"):
            _run_cache = _reused_cache_dir()
        else:
            # mkdtemp makes it 0700. Set before collection: finding the tiers runs the JIT-compiled CPU probe.
            _run_cache, _run_cache_is_temporary = Path(tempfile.mkdtemp(prefix="kernforge-test-cache-")), True
        os.environ[_CACHE_ENV] = str(_run_cache)
    _tiers[:] = kernforge.jit.isa.runnable_tiers()


def pytest_unconfigure(config):
    global _run_cache
    if _saved_cache_env is None:
        os.environ.pop(_CACHE_ENV, None)
    else:
        os.environ[_CACHE_ENV] = _saved_cache_env
    if _run_cache is not None and _run_cache_is_temporary:
        shutil.rmtree(_run_cache, ignore_errors=True)
    _run_cache = None


@pytest.fixture(scope="session")
def kernforge_cache_dir():
    """This run's cache directory (kernels compile into it on first use)."""
    return _run_cache


# Compiles every op variant, best tier first, in a child process while the tests run: the
# compiler then uses the core the test process leaves idle, instead of each first use compiling
# in turn. A test that needs a variant the child is building waits on its file lock and loads
# the result (same key: the child gets this process's environment as the session starts); one
# the child has not reached compiles on demand as before. A child, not a thread, because tests
# change the environment (compiler, cache dir, cffi mode) of this process while they run.
_BACKGROUND_PREWARM = """
import sys, kernforge
from kernforge.prewarm import all_ops_manifest, specs_from_manifest
for tier in sys.argv[1:]:
    kernforge.prewarm(specs_from_manifest(all_ops_manifest(), tier), jobs=1, progress=False)
"""


@pytest.fixture(scope="session", autouse=True)
def background_prewarm(request):
    if request.config.getoption("reuse_cache") and not _run_cache_is_temporary:
        yield None  # a reused cache is warm already
        return
    child = subprocess.Popen(
        [sys.executable, "-c", _BACKGROUND_PREWARM, *_tiers], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    yield child
    child.kill()  # the tests are done: whatever it is still compiling is not needed
    child.wait()


# --------------------------------------------------------------------------- tiers


def pytest_generate_tests(metafunc):
    if "tier" in metafunc.fixturenames:
        metafunc.parametrize("tier", _tiers, ids=[f"isa={t}" for t in _tiers], indirect=True)


@pytest.fixture
def tier(request):
    """Run the test with ``kernforge.use_isa(tier)`` active, for every runnable tier."""
    with kernforge.use_isa(request.param):
        yield request.param


def _stable_repr(value) -> str:
    """A parameter value's repr without memory addresses (``<function f at 0x...>``)."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))


def _stable_hash(*parts) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little")


def _values(item) -> frozenset:
    """(name, value) of each parameter of ``item`` but the tier."""
    return frozenset((name, _stable_repr(value)) for name, value in item.callspec.params.items() if name != "tier")


# The op tests' parameters that pick which kernel variant (module parameters) a test compiles.
_VARIANT_PARAMS = ("op", "name", "dtype")


def _variant(item) -> tuple:
    return tuple(sorted((name, value) for name, value in _values(item) if name in _VARIANT_PARAMS))


def _lower_tier_slice(groups: list[list], extra: bool = True) -> set:
    """The items that still run on one lower tier; ``groups`` holds each test function's items there.

    Deterministic: per test, a greedy cover in which every value of every parameter (each op,
    dtype, shape, layout ...) appears at least once, preferring kernel variants the tier already
    uses (each variant compiled is ~1 s on a cold run); then about one item in ``_EXTRA_ONE_IN``
    more, by a stable hash, among the variants already in use (unless not ``extra``: ``--cover``).
    The order depends on the tier, so the lower tiers between them cover more combinations. A test
    whose only parameter is the tier keeps its one item.
    """
    tier = groups[0][0].callspec.params.get("tier")
    keep, used = set(), set()
    for items in groups:
        ordered = sorted(items, key=lambda item: _stable_hash(tier, sorted(_values(item))))
        missing = set().union(*map(_values, items))
        kept = set()
        while missing or not kept:  # max() returns the first best item in hash order
            best = max(ordered, key=lambda item: (len(_values(item) & missing), _variant(item) in used))
            kept.add(best)
            used.add(_variant(best))
            missing -= _values(best)
        keep |= kept
    for items in groups if extra else ():
        keep |= {
            item
            for item in items
            if _variant(item) in used
            and _stable_hash("extra", item.originalname, sorted(_values(item))) % _EXTRA_ONE_IN == 0
        }
    return keep


def pytest_collection_modifyitems(config, items):
    """Full matrix on the best tier; a representative slice of each test on the lower tiers
    (``--cover``: on every tier, the covering slice alone)."""
    cover = config.getoption("cover")
    if not cover and (config.getoption("all_tiers") or len(_tiers) < 2):
        return
    best = _tiers[0]
    groups = defaultdict(lambda: defaultdict(list))  # tier -> test function -> its items
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is None:
            continue
        if cover:
            groups[callspec.params.get("tier")][(item.path, item.cls, item.originalname)].append(item)
            continue
        if callspec.params.get("tier", best) == best or item.get_closest_marker("all_tiers"):
            continue
        groups[callspec.params["tier"]][(item.path, item.cls, item.originalname)].append(item)
    keep = set()
    for by_test in groups.values():
        keep |= _lower_tier_slice(list(by_test.values()), extra=not cover)
    dropped = {item for by_test in groups.values() for group in by_test.values() for item in group} - keep
    if dropped:
        config.hook.pytest_deselected(items=[item for item in items if item in dropped])
        items[:] = [item for item in items if item not in dropped]


# --------------------------------------------------------------------------- templates, caches, environments

# Paths for the test files, whatever family folder they sit in.
TESTS_DIR = Path(__file__).resolve().parent  # on sys.path: conftest, kernels, op_helpers, references
REPO_ROOT = TESTS_DIR.parent
EXAMPLES_DIR = REPO_ROOT / "examples"
TEST_TEMPLATES = TESTS_DIR / "templates"
# Settings a JIT/cache test must not inherit from the caller's environment.
_JIT_ENV_VARS = (
    "KERNFORGE_JIT",
    "KERNFORGE_ISA",
    "KERNFORGE_CXX",
    "CXX",
    "KERNFORGE_CFFI_MODE",
    "KERNFORGE_LOCK_TIMEOUT",
    "KERNFORGE_JIT_DEBUG",
    "KERNFORGE_SANITIZE",
    "KERNFORGE_EXTRA_CFLAGS",
)


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
def user_template_dirs():
    """Restore the template search path after a test that registers its own folders."""
    saved = list(render._user_dirs)
    yield
    render._user_dirs[:] = saved
    render.search_path_changed()


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
        actual.to(torch.float32),
        expected.to(torch.float32),
        atol=atol,
        rtol=rtol,
        check_device=True,
        **kwargs,
    )


@pytest.fixture
def assert_close_ref():
    """The tolerance helper: ``assert_close_ref(actual, expected_fp32, dtype, msg=None)``."""
    return _assert_close_ref


def pytest_terminal_summary(terminalreporter, config):
    fuzz = sys.modules.get("test_fuzz")  # tests/fuzz ran: its cases per target
    if fuzz is not None:
        from fuzz_report import summarize

        summarize(terminalreporter, config, fuzz.TALLIES)
