"""Per-primitive sharding strategy rules, and the registry of what each primitive is.

Importing this package registers every rule. To support a new primitive, write
``rule(op, ctx) -> list[Strategy]`` in the module of its family and decorate it
with ``@register_strategy("prim_name")`` (``follows=True`` if it should keep its
main operand's layout); give it its other properties (fusion, reduction, contraction,
flops, ...) with ``register_op("prim_name", ...)`` in the same file. ``op_info(name)``
returns everything known about a primitive (an :class:`OpInfo`). A primitive that is
right to run replicated is registered with ``register_replicated("prim_name", why=...)``.
``coverage()`` classifies every primitive; unregistered ones run replicated, with one warning.
"""

from autoshard.strategies import annotations as _annotations  # noqa: F401  (registers rules)
from autoshard.strategies import attention as _attention  # noqa: F401
from autoshard.strategies import dot as _dot  # noqa: F401
from autoshard.strategies import elementwise as _elementwise  # noqa: F401
from autoshard.strategies import indexing as _indexing  # noqa: F401
from autoshard.strategies import layout as _layout  # noqa: F401
from autoshard.strategies import linalg as _linalg  # noqa: F401
from autoshard.strategies import manual as _manual  # noqa: F401
from autoshard.strategies import misc as _misc  # noqa: F401
from autoshard.strategies import pallas as _pallas  # noqa: F401
from autoshard.strategies import random as _random  # noqa: F401
from autoshard.strategies import reduce as _reduce  # noqa: F401
from autoshard.strategies.base import RuleContext as RuleContext
from autoshard.strategies.base import Strategy as Strategy
from autoshard.strategies.base import lookup_rule as lookup_rule
from autoshard.strategies.base import register_replicated as register_replicated
from autoshard.strategies.base import register_strategy as register_strategy
from autoshard.strategies.base import registered_primitives as registered_primitives
from autoshard.strategies.base import replicated_strategy as replicated_strategy
from autoshard.strategies.coverage import coverage as coverage
from autoshard.strategies.coverage import installed_primitives as installed_primitives
from autoshard.strategies.opinfo import OpInfo as OpInfo
from autoshard.strategies.opinfo import is_scan as is_scan
from autoshard.strategies.opinfo import op_flops as op_flops
from autoshard.strategies.opinfo import op_info as op_info
from autoshard.strategies.opinfo import partial_sum_axes as partial_sum_axes
from autoshard.strategies.opinfo import register_op as register_op
from autoshard.strategies.opinfo import scan_counts as scan_counts
