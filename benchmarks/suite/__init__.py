"""The comparison suite behind ``python -m benchmarks.run``: autoshard against hand-written shardings.

cases    models, batch sizes, presets and the meshes each method may use
measure  compile every method from abstract shapes; read collectives, memory and step time
execute  run the tiny configs and compare their losses with a single-device reference
report   markdown tables, the plot, the progress bar
"""

from benchmarks.suite.cases import METHODS as METHODS
from benchmarks.suite.cases import PRESETS as PRESETS
from benchmarks.suite.cases import SUITES as SUITES
from benchmarks.suite.cases import Case as Case
from benchmarks.suite.cases import select_cases as select_cases

__all__ = ["METHODS", "PRESETS", "SUITES", "Case", "select_cases"]
