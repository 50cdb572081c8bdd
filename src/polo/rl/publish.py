"""The end of an RL run: a model card in the final checkpoint, and the upload that `output.push_to_hub` asks for.

Whether the upload can happen (the Hub reachable, a token) is checked in `polo.rl.setup` before
anything loads, so a run is never trained for an hour only to find it cannot be pushed.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from polo.config import config_to_dict
from polo.models.hub import model_card, push_folder
from polo.models.lora import is_adapter_dir
from polo.runtime.checkpoint import SaveError
from polo.runtime.parallel import is_main_process

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
    repo_id = config.output.push_to_hub
    card = model_card(
        location=repo_id or str(final),
        base_model=config.model.name,
        algorithm=config.algorithm.name,
        task=run.task.name,
        steps=int(final.name.split("-")[1]),
        recipe=yaml.safe_dump(config_to_dict(config), sort_keys=False),
        eval_before=run.eval_before,
        eval_after=eval_after,
        num_eval=len(run.task.eval_rows),
        adapter=is_adapter_dir(final),
    )
    (final / "README.md").write_text(card)
    if repo_id:
        message = f"polo {config.algorithm.name}: {config.model.name} after {final.name} on {run.task.name}"
        try:
            url = push_folder(final, repo_id, private=config.output.hub_private, message=message)
        except Exception as error:
            raise SaveError(
                f"could not push {final} to the Hugging Face Hub repo {repo_id} ({type(error).__name__}: {' '.join(str(error).split())[:300]}); "
                f"the trained model is intact there: push it again with 'hf upload {repo_id} {final} --exclude trainer_state.pt'"
            ) from error
        print(f"polo: pushed {final} to {url}", flush=True)
    return final
