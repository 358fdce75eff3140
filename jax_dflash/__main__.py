"""``python -m jax_dflash`` and the ``jax-dflash`` console script (see jax_dflash.cli.main)."""

from __future__ import annotations

import sys

from jax_dflash.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
