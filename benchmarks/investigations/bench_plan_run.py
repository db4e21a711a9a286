"""Cost of a stateful op's run(): the raw foreign call vs the plan-bound call vs wrapper.run().

The op is examples/planned_op.py's SegmentSumWrapper on a tiny problem (one 16-element row,
one thread), so the kernel itself costs almost nothing and the differences are the Python
layers: ``kernel.run(...)`` with every argument (the floor), ``kernel.bind("run", ...)``'s
generated function with the plan's arguments fixed, and ``wrapper.run(x, out=out)`` (shape
and dtype checks, pointer extraction, the bound call).

    python benchmarks/investigations/bench_plan_run.py [--quick] [--json PATH]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: _harness and the routines
import _harness as H  # noqa: E402

sys.path.insert(0, str(H.REPO_ROOT / "examples"))
import planned_op  # noqa: E402


def main() -> int:
    args = H.base_parser(__doc__.splitlines()[0]).parse_args()
    H.wait_for_quiet(args.wait_quiet)
    H.setup_threads(args.threads)
    info = H.print_header("plan/run: raw call vs bound call vs wrapper.run()", args)
    indptr = torch.tensor([0, 1])
    x, out = torch.randn(1, 16), torch.empty(1, 16)
    wrapper = planned_op.SegmentSumWrapper(torch.empty(64, dtype=torch.uint8))
    wrapper.plan(indptr, dim=16)
    # The wrapper's own kernel and plan struct (examples/planned_op.py: run takes the declared plan
    # struct, then out, x, x_stride), called three ways.
    kernel, plan = wrapper._kernel, wrapper._plan
    raw, bound = kernel.run, kernel.bind("run", plan=plan)
    xp, op = x.data_ptr(), out.data_ptr()

    fns = {
        "raw kernel.run(4 args)": lambda: raw(plan, op, xp, 16),
        "bound run(3 args)": lambda: bound(op, xp, 16),
        "wrapper.run(x, out=out)": lambda: wrapper.run(x, out=out),
        "empty lambda (timer floor)": lambda: None,
    }
    t = H.compare(fns, budget_s=0.2 if args.quick else 1.0, rounds=3 if args.quick else 5, min_samples=15)
    base = t["raw kernel.run(4 args)"].us
    rows = [[name, H.us(timing), f"{timing.us - base:+.3f}"] for name, timing in t.items()]
    print(H.table(["call", "median", "vs raw (µs)"], rows))
    H.write_json(args.json, {"machine": info, "median_us": {k: v.us for k, v in t.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
