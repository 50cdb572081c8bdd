"""Multi-stage training in one command: DeepSeek-R1's pipeline (`polo pipeline RECIPE.yaml`).

cold-start SFT on formatted demonstrations -> GRPO with accuracy and format rewards -> rejection
sampling (the RL model's correct, well-formed answers) and SFT on them -> a second GRPO stage.
Each stage is a normal polo run directory under the pipeline's, starting from the previous
stage's final model; each is evaluated when it ends, and one report shows them side by side.

    import polo
    result = polo.pipeline("recipes/r1_arith.yaml", ["stages.reason.train.steps=10"])

The package is callable: `polo.pipeline(recipe, overrides)` is `run_pipeline(recipe, overrides)`,
which returns a `PipelineResult`.

Recipe format: `polo.pipeline.recipe`; docs/r1.md.
"""

import inspect
import sys
import types

from polo.pipeline.recipe import Plan, load_pipeline
from polo.pipeline.rejection import select
from polo.pipeline.run import PipelineResult, StageResult, run_pipeline

__all__ = ["PipelineResult", "Plan", "StageResult", "load_pipeline", "run_pipeline", "select"]


class _CallablePackage(types.ModuleType):
    # The import system binds `polo.pipeline` to this package, so the package itself answers the public call
    # `polo.pipeline(recipe, overrides)`.
    __call__ = staticmethod(run_pipeline)


__signature__ = inspect.signature(run_pipeline)  # what inspect.signature(polo.pipeline) and IDEs show for the call


sys.modules[__name__].__class__ = _CallablePackage
