"""How many tokens each verification step accepts per sequence (``--accept``)."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class AcceptDistribution:
    """How many tokens a verification step accepts per sequence, in ``1..block_size``.

    - ``uniform``: every length in ``1..block_size`` equally likely.
    - ``geometric:p``: each drafted token is accepted with probability ``p``, independently,
      until the first rejection; the step keeps the accepted drafts plus the target's own next
      token: ``1 + min(accepted drafts, block_size - 1)``. Mean about ``1 / (1 - p)``.
    - ``fixed:n``: always ``n``.
    """

    kind: str
    param: float | None = None

    def describe(self) -> str:
        if self.kind == "uniform":
            return "uniform"
        if self.kind == "fixed":
            return f"fixed:{int(self.param)}"
        return f"geometric:{self.param:g}"

    def sample(self, rng: np.random.Generator, shape, block_size: int) -> np.ndarray:
        if self.kind == "uniform":
            out = rng.integers(1, block_size + 1, shape)
        elif self.kind == "fixed":
            out = np.full(shape, int(self.param))
        elif self.param >= 1.0:
            out = np.full(shape, block_size)
        else:
            # numpy's geometric counts trials up to the first success (here: the first
            # rejection), so it is already 1 + the accepted drafts.
            out = np.minimum(rng.geometric(1.0 - self.param, shape), block_size)
        return out.astype(np.int32)


ACCEPT_HELP = (
    "uniform | geometric:P (each draft accepted with probability P until the first "
    "rejection; length = 1 + accepted drafts) | fixed:N"
)


def parse_accept(spec: str, block_size: int) -> AcceptDistribution:
    """``uniform``, ``geometric:p`` (0 <= p <= 1) or ``fixed:n`` (1 <= n <= block_size)."""
    kind, _, arg = spec.partition(":")
    if kind == "uniform" and not arg:
        return AcceptDistribution("uniform")
    if kind == "geometric":
        try:
            p = float(arg)
        except ValueError:
            p = float("nan")
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"--accept geometric:P expects 0 <= P <= 1, got {spec!r}")
        return AcceptDistribution("geometric", p)
    if kind == "fixed":
        try:
            n = int(arg)
        except ValueError:
            n = 0
        if not 1 <= n <= block_size:
            raise ValueError(
                f"--accept fixed:N expects 1 <= N <= block size {block_size}, got {spec!r}"
            )
        return AcceptDistribution("fixed", n)
    raise ValueError(f"--accept expects {ACCEPT_HELP}; got {spec!r}")
