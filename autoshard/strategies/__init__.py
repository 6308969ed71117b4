"""Per-primitive sharding strategy rules.

Importing this package registers every rule. To support a new primitive, write
``rule(op, ctx) -> list[Strategy]`` in the module of its family and decorate it
with ``@register_strategy("prim_name")`` (``follows=True`` if it should keep its
main operand's layout). Unregistered primitives run replicated, with one warning.
"""

from autoshard.strategies import dot as _dot  # noqa: F401  (registers rules)
from autoshard.strategies import elementwise as _elementwise  # noqa: F401
from autoshard.strategies import indexing as _indexing  # noqa: F401
from autoshard.strategies import layout as _layout  # noqa: F401
from autoshard.strategies import misc as _misc  # noqa: F401
from autoshard.strategies import reduce as _reduce  # noqa: F401
from autoshard.strategies.base import RuleContext as RuleContext
from autoshard.strategies.base import Strategy as Strategy
from autoshard.strategies.base import lookup_rule as lookup_rule
from autoshard.strategies.base import register_strategy as register_strategy
from autoshard.strategies.base import registered_primitives as registered_primitives
from autoshard.strategies.base import replicated_strategy as replicated_strategy
