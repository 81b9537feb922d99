"""Registers of a kernel with one producer warpgroup and consumer warpgroups (``setmaxnreg``).

The warpgroups share what the launch holds. A consumer ``setmaxnreg.inc`` past it waits forever (a split
of 96 / 208 at 384 threads hung the WO-A kernel in run 99), and one below the launch's count is undefined.
"""

PRODUCER_REGS, CONSUMER_REGS = 24, 240  # setmaxnreg budgets (TileLang's own split at 384 threads)


def launch_regs(threads: int) -> int:
    """Registers a thread of a ``threads``-thread CTA gets at launch (one CTA an SM, allocated by 8s)."""
    return min(255, 65536 // threads // 8 * 8)


def split_reason(consumers: int) -> str | None:
    """Why ``PRODUCER_REGS`` / ``CONSUMER_REGS`` cannot be split between a 128-thread producer warpgroup and
    ``consumers`` consumer threads (None when they fit in what the launch holds)."""
    threads = 128 + consumers
    regs = launch_regs(threads)
    if 128 * PRODUCER_REGS + consumers * CONSUMER_REGS > regs * threads:
        return f"setmaxnreg {PRODUCER_REGS} / {CONSUMER_REGS} exceeds the {regs} registers a thread of {threads} holds"
    return None
