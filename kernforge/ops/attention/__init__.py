"""The attention family, FlashInfer's API: the paged KV cache and its append (``page``), batch and
single decode (``decode``), batch prefill over paged or ragged KV and single prefill
(``prefill``), and LSE merging of attention states (``cascade``). ``_wrapper`` holds what the
plan/run wrappers share; :class:`WorkspaceWrapper`, the base of every plan/run wrapper (MLA's
too), is public here for what handles wrappers of any kind (``kernforge.torch_library``)."""

from kernforge.ops.attention import cascade, decode, page, prefill  # noqa: F401  (registers their ops)
from kernforge.ops.attention._wrapper import WorkspaceWrapper

__all__ = ["WorkspaceWrapper"]
