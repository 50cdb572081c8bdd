"""A pipeline recipe on the tiny random model, small enough for the CPU test suite."""

from __future__ import annotations

QUIET = {"report_to": [], "progress": False}


def tiny_grpo(steps: int = 2) -> dict:
    return {
        "kind": "grpo",
        "rewards": {"correct": 1.0, "r1_format": 0.5, "tag_count": 0.25},
        "sampling": {"max_new_tokens": 8},
        "algorithm": {"group_size": 2},
        "train": {
            "steps": steps,
            "prompts_per_step": 2,
            "micro_batch_size": 4,
            "learning_rate": 1e-3,
            "precision": "fp32",
        },
        "eval": {"batch_size": 6, "max_new_tokens": 6, "every": 1},
        "output": {**QUIET, "save_every": 1, "plots": True},
    }


def tiny_sft(kind: str = "sft", **sections) -> dict:
    stage = {
        "kind": kind,
        "train": {"batch_size": 4, "micro_batch_size": 4, "learning_rate": 1e-3, "precision": "fp32"},
        "output": dict(QUIET),
    }
    stage.update(sections)
    return stage


def tiny_pipeline(model_dir, pipeline_dir) -> dict:
    """All four R1 stages on 1-digit sums: 2 RL steps of 2 prompts x 2 samples, a few SFT steps, 3 held-out problems."""
    return {
        "pipeline": {"dir": str(pipeline_dir), "model": str(model_dir), "progress": False},
        "task": {
            "name": "arithmetic",
            "min_digits": 1,
            "max_digits": 1,
            "num_train": 40,
            "num_eval": 6,
            "answer_in_tags": True,
        },
        "eval": {"samples": 2, "num_problems": 3, "max_new_tokens": 6, "batch_size": 8, "precision": "fp32"},
        "stages": {
            "cold_start": tiny_sft(demos={"num_train": 8, "num_eval": 2}),
            "reason": tiny_grpo(),
            "reject": tiny_sft(
                "reject_sft", rejection={"num_prompts": 3, "samples": 3, "max_per_prompt": 2, "max_new_tokens": 8}
            ),
            "reason2": tiny_grpo(),
        },
    }
