"""Inter-operator parallelism: gradient accumulation and pipelines over sub-meshes.

```
parallelize(..., num_microbatches=k, pipeline=PipelineOptions(...))      api.make_step -> step.PipelinedStep
  analyze_step      capture at B and B/k; regions P / M / R; frontier     accumulate.py
  cluster_layers    forward ops -> L layers (or pipeline_boundary cuts)   cluster_layers.py, boundary.py
  partition         ops -> tasks F(s), B(s), R(s, wave)                   partition.py
  assign_stages     Alpa's stage-mesh DP over per-layer planned costs      stage_dp.py, submesh.py, search.py
  driver.plan       each stage's intra-op plan, boundaries as typed pins   search.py (boundary_pins)
  PipelineExecutable  jitted tasks, device_put between stages, schedule  runtime.py, schedule.py
  SpmdPipelineExecutable  one SPMD program, ppermute between stages (multi-process)  spmd.py
  measure           measured Gantt chart and bubble fraction               timeline.py
```
"""

from autoshard.pipeline.boundary import pipeline_boundary as pipeline_boundary
from autoshard.pipeline.options import PipelineOptions as PipelineOptions
from autoshard.pipeline.plan import PipelinePlan as PipelinePlan
from autoshard.pipeline.plan import StagePlan as StagePlan
from autoshard.pipeline.stage_dp import StageProblem as StageProblem
from autoshard.pipeline.stage_dp import assign_stages as assign_stages
from autoshard.pipeline.stage_dp import brute_force as brute_force
from autoshard.pipeline.step import PipelinedStep as PipelinedStep

__all__ = ["PipelineOptions", "PipelinePlan", "PipelinedStep", "StagePlan", "StageProblem", "assign_stages",
           "brute_force", "pipeline_boundary"]
