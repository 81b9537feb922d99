"""dsv41-passes: torch.compile passes that fuse DeepSeek-V4.1 subgraphs into Triton/TileLang kernels.

Public API::

    import dsv41_passes as dp
    fast = dp.compile(model, dp.PassConfig())      # or torch.compile(model, backend="dsv41")
    fast(input_ids, positions, cu_seqlens)
    print(dp.last_report().to_markdown())

    torch.compile(model, options=dp.inductor_options(cfg))   # install into your own Inductor compile
    with dp.batch_invariant():                                 # bitwise row invariance across M
        ...
"""

__version__ = "0.1.0"

from . import lowering  # noqa: E402,F401  (registers torch.ops.dsv41.*: compiled graphs call them, also on cache hits)
from .backend import compile, dsv41_backend, inductor_options, make_backend, register  # noqa: E402
from .config import PassConfig  # noqa: E402
from .guards import batch_invariant, is_batch_invariant  # noqa: E402
from .report import RewriteReport, SiteRow, last_report, reports  # noqa: E402
from .tuning import load_tactics, save_tactics, warmup  # noqa: E402

register()

__all__ = [
    "PassConfig",
    "RewriteReport",
    "SiteRow",
    "batch_invariant",
    "compile",
    "dsv41_backend",
    "inductor_options",
    "is_batch_invariant",
    "last_report",
    "load_tactics",
    "make_backend",
    "reports",
    "save_tactics",
    "warmup",
    "__version__",
]
