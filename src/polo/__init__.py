"""polo: policy optimization from REINFORCE to GRPO.

`polo.train(recipe_or_config, overrides)` runs a language-model RL job, the same as
`polo train RECIPE.yaml key=value ...` on the command line.
"""

__version__ = "0.1.0"


def train(config=None, overrides=None, **kwargs):
    """Train a causal LM from a recipe path, mapping or `polo.config.Config`; see `polo.rl.train.train`."""
    from polo.rl.train import train as _train

    return _train(config, overrides, **kwargs)
