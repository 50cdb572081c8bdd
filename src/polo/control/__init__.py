"""polo.control: REINFORCE, A2C, TRPO, PPO and critic-free GRPO on Gymnasium, from polo.core.

    import polo
    result = polo.control("recipes/ppo_cartpole.yaml", ["train.total_steps=20000"])
    print(result.last_mean(), result.solved_at_step)

The package is callable: `polo.control(recipe, overrides)` is `polo.control.train(recipe, overrides)`,
which returns a `ControlResult`.
"""

import inspect
import sys
import types

from polo.control.config import ControlConfig, load_control_config
from polo.control.trainer import ALGORITHMS, ControlResult, train

__all__ = ["ALGORITHMS", "ControlConfig", "ControlResult", "load_control_config", "train"]


class _CallablePackage(types.ModuleType):
    # The import system binds `polo.control` to this package, so the package itself answers the public call
    # `polo.control(recipe, overrides)`.
    __call__ = staticmethod(train)


__signature__ = inspect.signature(train)  # what inspect.signature(polo.control) and IDEs show for the call


sys.modules[__name__].__class__ = _CallablePackage
