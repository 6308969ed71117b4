"""Strategy selection: pick one sharding strategy per node at least cost.

``solve(problem, time_limit=..., seed=0)`` is the only entry point the planner uses.
"""

from autoshard.solver.problem import ShardingProblem as ShardingProblem
from autoshard.solver.problem import ShardingSolution as ShardingSolution
from autoshard.solver.solve import solve as solve
