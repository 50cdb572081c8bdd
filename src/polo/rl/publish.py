"""The end of an RL run: a model card in the final checkpoint, and the upload that `output.push_to_hub` asks for.

Whether the upload can happen (the Hub reachable, a token) is checked in `polo.rl.setup` before
anything loads, so a run is never trained for an hour only to find it cannot be pushed.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from polo.config import config_to_dict
from polo.models.hub import HeldOut, ModelCard, publish
from polo.models.lora import is_adapter_dir
from polo.runtime.parallel import is_main_process
from polo.runtime.resume import started_recipe

if TYPE_CHECKING:
    from polo.rl.setup import Run


def publish_model(run: Run, eval_after: dict | None) -> Path | None:
    """Write README.md into the run's final checkpoint and push that directory to `output.push_to_hub` when set.

    Every rank may call it; only the main process writes and uploads. Returns the final directory
    (None off the main process, or when no checkpoint exists).
    """
    final = run.checkpointer.latest()
    if not is_main_process() or final is None:
        return None
    config = run.config
    # What the run started from, with a line per change a resume was allowed (polo.runtime.resume): the card
    # never names a later model.name as the base of the whole run.
    started, changes = started_recipe(config_to_dict(config), run.output_dir)
    card = ModelCard(
        location=config.output.push_to_hub or str(final),
        base_model=started["model"]["name"],
        method=started["algorithm"]["name"],
        trained_on=run.task.name,
        steps=int(final.name.split("-")[1]),
        recipe=changes + yaml.safe_dump(started, sort_keys=False),
        held_out=HeldOut(
            f"Greedy decoding on {len(run.task.eval_rows)} held-out problems",
            ("accuracy",),
            run.eval_before,
            eval_after,
        ),
        adapter=is_adapter_dir(final),
        tags=(config.algorithm.name, "reinforcement-learning"),
    )
    publish(final, card, config.output.push_to_hub, config.output.hub_private)
    return final
