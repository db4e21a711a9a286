"""The shared-memory collectives' kernel module (``templates/include/kernforge/comm/``)."""

from __future__ import annotations

from kernforge.jit.module import Codes, DType, Entry, Module

# Why a collective ended. kBadSegment: the segment's header does not describe the group (attach).
STATUS = Codes(
    "kf::comm::Status", (("kOk", 0), ("kTimeout", 1), ("kPeerExited", 2), ("kMismatch", 3), ("kBadSegment", 4))
)
# What a call does, as ranks compare it: kind * 16 + a reduction's element type (REDUCED_DTYPES[i - 1]).
KIND = Codes("kf::comm::Kind", (("kAllReduce", 1), ("kAllGather", 2), ("kReduceScatter", 3)))
REDUCED_DTYPES = ("fp32", "bf16", "fp16")  # kf::comm::dtype_code
# A failed call's report: the peer, then its descriptor (kind, bytes, row_bytes).
REPORT_INTS = 4

_GROUP = "int64_t base, int64_t world, int64_t rank"
COMM = Module(
    "comm",
    "comm.cpp.jinja",
    params={"dtype": DType()},
    codes=[STATUS, KIND],
    entries=[
        Entry("segment_bytes", "int64_t world, int64_t slot_bytes", returns="int64_t"),
        Entry("attach", f"{_GROUP}, int64_t slot_bytes, int64_t pid, int64_t create", returns="int64_t"),
        Entry(
            "all_reduce",
            f"{_GROUP}, int64_t data, int64_t count, double timeout_s, int64_t shared_cores, int64_t num_threads, "
            "int64_t report",
            returns="int64_t",
        ),
        Entry(
            "reduce_scatter",
            f"{_GROUP}, int64_t src, int64_t out, int64_t count, double timeout_s, int64_t shared_cores, "
            "int64_t num_threads, int64_t report",
            returns="int64_t",
        ),
        Entry(
            "all_gather",
            f"{_GROUP}, int64_t src, int64_t rows, int64_t row_bytes, int64_t out, double timeout_s, "
            "int64_t shared_cores, int64_t num_threads, int64_t report",
            returns="int64_t",
        ),
        Entry("pin_threads", "int64_t cpus, int64_t count", returns="int64_t"),
    ],
)
