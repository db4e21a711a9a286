"""Cases the fuzzer once failed on, kept after their fix: (target, case seed), replayed on every tier
by test_fuzz.py. Each line says what the case found."""

REGRESSIONS: list[tuple[str, int]] = []
