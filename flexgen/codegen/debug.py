"""``FLEXGEN_DEBUG=1``: generated kernels check every read of a captured tensor on the device.

The host checks the indices it can (``flexgen.frontend.bounds_check``: those that
depend on positions only). An index that depends on loaded data
(``bias[doc[q_idx]]``) is known only on the device, and there a read past the end
of the tensor is a masked load: it gives 0, silently. In debug mode the printer
adds ``tl.device_assert`` on each load's in-bounds mask (over the real positions
of the tile, not its padding), so the first bad read stops the kernel with a
message naming the tensor:

- compiled (GPU): the kernels are jitted with ``debug=True``, without which
  Triton drops device asserts (Triton's debug mode also checks int32
  arithmetic for overflow);
- under the Triton interpreter, whose ``device_assert`` does nothing unless
  its options say debug: flexgen sets them at import (for every interpreted
  kernel of the process), and a bad read raises an ``AssertionError``
  (inside Triton's ``InterpreterError``).

The flag is read once, at import (set it before importing flexgen), and is part
of every kernel's spec (``KernelSpec.debug``), so debug and normal kernels never
share a cache entry.
"""
from __future__ import annotations

import dataclasses
import os

DEBUG = os.environ.get("FLEXGEN_DEBUG") == "1"


def enable_interpreter_asserts() -> None:
    """Make the Triton interpreter run ``tl.device_assert`` (it skips them by default)."""
    from triton.runtime import interpreter
    builder = interpreter.interpreter_builder
    builder.options = dataclasses.replace(builder.options, debug=True)


if DEBUG:
    enable_interpreter_asserts()
