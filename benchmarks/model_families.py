"""Step time and peak memory of the two built-in model families on the same job, full fine-tuning and LoRA.

SmolLM2-135M-Instruct (llama: 30 layers, d=576, 49k vocabulary) against Gemma 3 270M base
(gemma3_text: 18 layers, d=640, sliding-window + global attention, 262k vocabulary, embeddings
scaled by sqrt(d)). Each (model, mode) runs the same recipe (default: the demo job,
recipes/grpo_arith.yaml: 8 prompts x 8 completions, at most 32 new tokens) for a few steps in its
own subprocess; the figures are the median `time/step` from metrics.jsonl and the child's peak RSS
(ru_maxrss). Only the model (and, for LoRA, `model.lora.r`) changes between runs, so prompts are each
model's own rendering of the same questions (SmolLM2 through its chat template, Gemma as plain
text), and how long completions run is the model's own doing: the table gives the mean length.

    .venv/bin/python benchmarks/model_families.py                     # 4 runs x 5 steps
    .venv/bin/python benchmarks/model_families.py --steps 8 --recipe recipes/gemma_arith.yaml

On a shared machine the step times are inflated by whatever else runs; the table notes the CPU
other processes used during each run. The last line is
`model_families gemma_vs_smollm2 full_step_time=<r> full_peak_rss=<r> lora_step_time=<r> lora_peak_rss=<r>`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from algorithms_lm import ROOT, run_recipe
from bench_common import ForeignLoad

MODELS = {"smollm2": "smollm2-135m-instruct", "gemma3": "gemma3-270m"}
MODES = {"full": [], "lora": ["model.lora.r=16", "model.lora.alpha=32"]}


def run_one(model: str, mode: str, recipe: Path, out_dir: Path, steps: int) -> dict:
    """Train `recipe` on `model` in `mode` for `steps` steps in a child process; return its figures."""
    name = f"{model}-{mode}"
    overrides = [f"model.name={MODELS[model]}", "eval.after=false", "output.plots=false", *MODES[mode]]
    monitor = ForeignLoad(include_children=True)
    result = run_recipe(recipe, out_dir / name, out_dir / f"{name}.log", steps, eval_before=False, overrides=overrides)
    result.update(
        model=model,
        mode=mode,
        other_cores=monitor.cores(),
        mean_completion_length=statistics.mean(result["completion_length"]),
    )
    return result


def table(results: list[dict]) -> str:
    lines = [
        "| model | mode | median step | peak RSS | mean completion length | other processes' CPU |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for result in results:
        lines.append(
            f"| {MODELS[result['model']]} | {result['mode']} | {result['median_step_s']:.1f} s | "
            f"{result['peak_rss_bytes'] / 2**30:.2f} GiB | {result['mean_completion_length']:.1f} | "
            f"{result['other_cores']:.1f} cores |"
        )
    return "\n".join(lines)


def ratios(results: list[dict]) -> str:
    by_key = {(result["model"], result["mode"]): result for result in results}
    parts = []
    for mode in MODES:
        gemma, smol = by_key.get(("gemma3", mode)), by_key.get(("smollm2", mode))
        if gemma and smol:
            parts.append(f"{mode}_step_time={gemma['median_step_s'] / smol['median_step_s']:.2f}")
            parts.append(f"{mode}_peak_rss={gemma['peak_rss_bytes'] / smol['peak_rss_bytes']:.2f}")
    return " ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "grpo_arith.yaml"))
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES))
    parser.add_argument("--out", default=str(ROOT / "runs" / "model_families"))
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for mode in args.modes:
        for model in args.models:
            result = run_one(model, mode, Path(args.recipe), out_dir, args.steps)
            results.append(result)
            print(
                f"{model:>8} {mode}: median step {result['median_step_s']:.1f} s  "
                f"peak RSS {result['peak_rss_bytes'] / 2**30:.2f} GiB  "
                f"completion length {result['mean_completion_length']:.1f}  others {result['other_cores']:.1f} cores",
                flush=True,
            )
            (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    markdown = table(results)
    (out_dir / "model_families.md").write_text(markdown + "\n")
    print(markdown)
    print(f"model_families gemma_vs_smollm2 {ratios(results)}")


if __name__ == "__main__":
    main()
