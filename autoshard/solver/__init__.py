"""Strategy selection: pick one sharding strategy per node at least cost.

``solve(problem, time_limit=..., seed=0)`` is the entry point the planner uses; ``least_peak(problem)`` bounds
what any choice's memory row can reach.
"""

from autoshard.solver.problem import ShardingProblem as ShardingProblem
from autoshard.solver.problem import ShardingSolution as ShardingSolution
from autoshard.solver.solve import least_peak as least_peak
from autoshard.solver.solve import solve as solve
