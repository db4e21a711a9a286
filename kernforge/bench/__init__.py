"""Measuring kernforge: the timer, the machine probes and the benchmark record format.

``kernforge.bench.timing``
    ``measure`` / ``compare`` (what every benchmark reports) and ``time_call`` (what the tuners
    time candidates with): one sampler behind all three.
``kernforge.bench.machine``
    What the machine can do, measured in the same run: cache sizes, stream bandwidth, the rate an
    M=1 GEMM streams a weight from DRAM, the bf16 / int8 dot-product peak, the CPU's kind, other
    processes' load.
``kernforge.bench.records``
    The one result format: a figure per JSON line (``emit``, ``write_jsonl``).

The benchmark routines themselves live in the source checkout's ``benchmarks/`` (driver:
``python -m kernforge bench`` or ``benchmarks/run.py``). Of this package, ``import kernforge``
loads ``timing`` alone (through ``kernforge.jit.tuning``), which needs only the standard library;
``machine`` and ``records`` import torch and kernforge's JIT when a probe runs.
"""
