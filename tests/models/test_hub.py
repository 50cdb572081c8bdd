"""Hugging Face Hub ids as model names (offline-first, through the hub cache) and pushing a trained model.

Nothing here reaches the network: the cache entries are laid out by the tests, exactly as
`hf download` leaves them, and `HfApi` / `snapshot_download` are replaced where a test needs the
Hub to answer (or to prove it was never asked).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
import torch
import yaml
from huggingface_hub.errors import LocalEntryNotFoundError
from safetensors.torch import load_file

from conftest import build_tiny_model, tiny_rl_config
from polo.cli import main
from polo.config import ConfigError, load_config
from polo.models import hub
from polo.models.loading import ModelLoadError, load_policy, load_tokenizer, resolve_model_path
from polo.rl import setup as rl_setup
from polo.rl.publish import publish_model
from polo.rl.train import train
from polo.runtime.checkpoint import SaveError

REPO = "polo-test/tiny"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
REAL_SNAPSHOT_DOWNLOAD = huggingface_hub.snapshot_download


def cache_entry(cache: Path, repo_id: str, source: Path, commit: str = COMMIT, ref: str | None = "main") -> Path:
    """Return the snapshot directory of `source`'s files laid out as the hub cache does: blobs named by digest,
    snapshot links to them, refs/<ref> holding the commit."""
    repo_dir = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / commit
    (repo_dir / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for file in sorted(source.iterdir()):
        blob = repo_dir / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", blob.name))
    if ref is not None:
        (repo_dir / "refs").mkdir(exist_ok=True)
        (repo_dir / "refs" / ref).write_text(commit)  # no newline: huggingface_hub reads the file as is
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, tiny_model_dir) -> Path:
    """A private Hugging Face home whose hub cache holds the tiny model as polo-test/tiny; the Hub offline."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    cache = tmp_path / "hf" / "hub"
    cache_entry(cache, REPO, tiny_model_dir)
    return cache


def no_network(monkeypatch) -> list:
    """Let `snapshot_download` read the cache only; return the list of online calls (each one also fails)."""
    online = []

    def cache_only(repo_id, **kwargs):
        if not kwargs.get("local_files_only"):
            online.append((repo_id, kwargs))
            raise LocalEntryNotFoundError(
                "An error happened while trying to locate the files on the Hub (ConnectError: no network)"
            )
        return REAL_SNAPSHOT_DOWNLOAD(repo_id, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", cache_only)
    return online


def tiny_rl_recipe(model: str, output_dir: Path, **output) -> dict:
    """The tiny run of tests/conftest.py, two steps, no plots or TensorBoard."""
    return tiny_rl_config(
        model,
        output_dir,
        sampling={"max_new_tokens": 6},
        algorithm={"group_size": 2},
        train={"steps": 2, "micro_batch_size": 4},
        eval={"batch_size": 6, "max_new_tokens": 4},
        output={"save_every": 0, "report_to": [], "plots": False, **output},
    )


def cli(recipe: dict, tmp_path: Path, capsys, *overrides: str) -> tuple[int, list[str]]:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    capsys.readouterr()
    status = main(["train", str(path), *overrides])
    return status, capsys.readouterr().err.splitlines()


# ---------------------------------------------------------------- what reads as a Hub id


@pytest.mark.parametrize(
    ("name", "parsed"),
    [
        ("org/name", ("org/name", None)),
        ("Qwen/Qwen2.5-0.5B-Instruct", ("Qwen/Qwen2.5-0.5B-Instruct", None)),
        ("org/name@main", ("org/name", "main")),
        (f"org/name@{COMMIT}", ("org/name", COMMIT)),
        ("org/name@refs/pr/1", ("org/name", "refs/pr/1")),
        ("smollm2-135m-instruct", None),  # a built-in name
        ("runs/grpo/checkpoints/step-000030", None),  # a path
        ("./org/name", None),
        ("/abs/path", None),
        ("org/na--me", None),
        ("org/name@", None),
        ("org/.name", None),
    ],
)
def test_parse_hub_id(name, parsed):
    assert hub.parse_hub_id(name) == parsed


def test_cache_dir_follows_the_environment_at_call_time(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub.hub_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert hub.hub_cache_dir() == tmp_path / "elsewhere"
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "yes")
    assert hub.offline_setting() == "TRANSFORMERS_OFFLINE=yes"


# ---------------------------------------------------------------- loading from the cache


def test_load_policy_reads_a_hub_id_from_the_cache_offline(hub_cache, tiny_model_dir):
    model, tokenizer = load_policy(REPO)
    expected = load_file(str(tiny_model_dir / "model.safetensors"))
    assert all(torch.equal(model.state_dict()[name], weights) for name, weights in expected.items())
    assert tokenizer.padding_side == "left" and tokenizer("7 + 8").input_ids
    assert model.name_or_path == REPO  # a LoRA adapter saved on it names the id, not this cache's path
    assert resolve_model_path(f"{REPO}@{COMMIT}") == hub_cache / "models--polo-test--tiny" / "snapshots" / COMMIT
    assert load_tokenizer(REPO).pad_token is not None


def test_a_revision_selects_its_snapshot(hub_cache, tmp_path):
    other = build_tiny_model(tmp_path / "v2", seed=1)
    cache_entry(hub_cache, REPO, other, commit="f" * 40, ref="v2")
    v2 = load_file(str(other / "model.safetensors"))
    model, _ = load_policy(f"{REPO}@v2")
    assert all(torch.equal(model.state_dict()[name], weights) for name, weights in v2.items())
    main_model, _ = load_policy(REPO)
    assert not torch.equal(main_model.state_dict()["model.embed_tokens.weight"], v2["model.embed_tokens.weight"])


def test_a_local_directory_wins_over_the_hub_id_it_spells(hub_cache, tmp_path, monkeypatch):
    local = build_tiny_model(tmp_path / "work" / "polo-test" / "tiny", seed=2)
    monkeypatch.chdir(tmp_path / "work")
    monkeypatch.setattr(hub, "hub_snapshot", lambda name: pytest.fail("the hub cache was consulted"))
    assert resolve_model_path(REPO) == Path(REPO)
    model, _ = load_policy(REPO)
    assert torch.equal(
        model.state_dict()["model.embed_tokens.weight"],
        load_file(str(local / "model.safetensors"))["model.embed_tokens.weight"],
    )


def test_a_cached_model_loads_without_the_network_when_the_hub_is_online(hub_cache, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    online = no_network(monkeypatch)
    load_policy(REPO)
    assert online == []


def test_fetch_model_takes_a_hub_id(hub_cache, capsys):
    assert main(["fetch-model", REPO]) == 0
    assert capsys.readouterr().out.strip() == str(hub_cache / "models--polo-test--tiny" / "snapshots" / COMMIT)


def test_a_lora_run_on_a_hub_id_names_the_id_as_its_base(hub_cache, tmp_path):
    recipe = tiny_rl_recipe(REPO, tmp_path / "run")
    train(recipe, ["model.lora.r=4", "train.steps=1", "eval.before=false", "eval.after=false"])
    final = tmp_path / "run" / "checkpoints" / "step-000001"
    assert json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"] == REPO
    card = (final / "README.md").read_text()
    assert "A LoRA adapter for `polo-test/tiny`" in card and "lora" in yaml.safe_load(card.split("---\n")[1])["tags"]
    model, _ = load_policy(str(final))  # the base found again through the cache
    assert model.name_or_path == REPO


def test_a_hub_model_must_be_a_causal_lm(hub_cache, tmp_path):
    classifier = tmp_path / "classifier"
    classifier.mkdir()
    (classifier / "config.json").write_text(
        json.dumps({"architectures": ["BertForSequenceClassification"], "model_type": "bert"})
    )
    (classifier / "model.safetensors").write_bytes(
        (tmp_path / "hf" / "hub" / "models--polo-test--tiny" / "snapshots" / COMMIT / "model.safetensors").read_bytes()
    )
    cache_entry(hub_cache, "polo-test/classifier", classifier)
    with pytest.raises(ModelLoadError, match="not a causal language model"):
        load_policy("polo-test/classifier")


def test_a_cached_snapshot_without_weights_is_a_miss(hub_cache, tmp_path):
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(tmp_path / "hf" / "hub" / "models--polo-test--tiny" / "snapshots" / COMMIT / "config.json", config_only)
    cache_entry(hub_cache, "polo-test/partial", config_only)
    with pytest.raises(ModelLoadError, match="not in the local cache"):
        resolve_model_path("polo-test/partial")


# ---------------------------------------------------------------- a miss: one clear line


def test_a_missing_hub_id_is_one_line_through_the_cli(hub_cache, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    status, err = cli(tiny_rl_recipe("polo-test/missing", tmp_path / "run"), tmp_path, capsys)
    assert status == 2 and len(err) == 1, err
    assert err[0] == (
        "polo: error: model 'polo-test/missing' is not a local directory, and as a Hugging Face Hub id it is not in "
        f"the local cache ({hub_cache}) while the Hub is offline (HF_HUB_OFFLINE=1): fetch it on a machine with "
        "internet with 'hf download polo-test/missing' (or 'huggingface-cli download') and copy the cache here, or "
        "point the model at a local directory"
    )


def test_a_missing_revision_names_it_in_the_fetch_command(hub_cache):
    with pytest.raises(ModelLoadError, match=r"'hf download polo-test/tiny --revision v9'"):
        load_policy(f"{REPO}@v9")


def test_eval_with_a_missing_hub_id_is_one_line(hub_cache, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["eval", "--model", "polo-test/missing", "--task", "arith", "--limit", "2", "--greedy"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("polo: error: model 'polo-test/missing' is not a local directory"), err


def test_a_cache_miss_online_that_cannot_download_is_one_line(hub_cache, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    online = no_network(monkeypatch)
    with pytest.raises(ModelLoadError) as error:
        resolve_model_path("polo-test/missing")
    message = str(error.value)
    assert "\n" not in message and [call[0] for call in online] == ["polo-test/missing"]
    assert message.startswith(
        f"model 'polo-test/missing' is not a local directory or in the local Hugging Face cache ({hub_cache}), "
        "and downloading it from the Hub failed (LocalEntryNotFoundError: "
    )
    assert "'hf download polo-test/missing'" in message


def test_a_cache_miss_online_downloads_config_tokenizer_and_weights_only(
    hub_cache, tmp_path, monkeypatch, tiny_model_dir
):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    asked = []

    def download(repo_id, **kwargs):
        if kwargs.get("local_files_only"):
            return REAL_SNAPSHOT_DOWNLOAD(repo_id, **kwargs)
        asked.append((repo_id, kwargs))
        return str(cache_entry(Path(kwargs["cache_dir"]), repo_id, tiny_model_dir))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    path = resolve_model_path("polo-test/fresh")
    assert path == hub_cache / "models--polo-test--fresh" / "snapshots" / COMMIT
    ((repo_id, kwargs),) = asked
    assert (
        repo_id == "polo-test/fresh"
        and kwargs["cache_dir"] == hub_cache
        and "*.safetensors" in kwargs["allow_patterns"]
    )
    assert resolve_model_path("polo-test/fresh") == path and len(asked) == 1  # the second time from the cache


# ---------------------------------------------------------------- a run from a Hub id, pushed to the Hub


class RecordingApi:
    """Stands in for `huggingface_hub.HfApi`: records create_repo and upload_folder (with the folder's files then)."""

    calls: list = []

    def __init__(self, *args, **kwargs):
        pass

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, **kwargs):
        files = sorted(path.name for path in Path(kwargs["folder_path"]).iterdir())
        self.calls.append(("upload_folder", kwargs, files, (Path(kwargs["folder_path"]) / "README.md").read_text()))


@pytest.fixture
def recording_api(monkeypatch):
    RecordingApi.calls = []
    monkeypatch.setattr(huggingface_hub, "HfApi", RecordingApi)
    return RecordingApi.calls


def test_a_run_from_a_hub_id_is_pushed_with_its_model_card(hub_cache, tmp_path, monkeypatch, recording_api, capsys):
    monkeypatch.delenv("HF_HUB_OFFLINE")  # pushing needs the Hub; the model still comes from the cache only
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    online = no_network(monkeypatch)
    recipe = tiny_rl_recipe(REPO, tmp_path / "run", push_to_hub="me/tiny-grpo", hub_private=True)
    result = train(recipe)
    final = tmp_path / "run" / "checkpoints" / "step-000002"
    assert online == [] and f"polo: pushed {final} to https://huggingface.co/me/tiny-grpo" in capsys.readouterr().out

    (create, upload) = recording_api
    assert create == ("create_repo", "me/tiny-grpo", {"private": True, "exist_ok": True, "repo_type": "model"})
    _, kwargs, files, card = upload
    assert (
        kwargs["repo_id"] == "me/tiny-grpo"
        and kwargs["folder_path"] == str(final)
        and "trainer_state.pt" in kwargs["ignore_patterns"]
    )
    assert {"README.md", "config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    assert card == (final / "README.md").read_text()
    front, body = card.removeprefix("---\n").split("\n---\n", 1)
    metadata = yaml.safe_load(front)
    assert metadata["library_name"] == "polo" and metadata["base_model"] == REPO
    assert {"polo", "grpo"} <= set(metadata["tags"])
    assert f"| before training | {result.eval_before['accuracy']:.3f} |" in body
    assert f"| after training | {result.eval_after['accuracy']:.3f} |" in body
    assert "for 2 steps" in body and 'AutoModelForCausalLM.from_pretrained("me/tiny-grpo")' in body
    assert yaml.safe_load(body.split("```yaml\n", 1)[1].split("```", 1)[0]) == yaml.safe_load(
        (tmp_path / "run" / "config.yaml").read_text()
    )
    assert load_policy(str(final))[0] is not None  # the card does not get in the way of loading


def test_without_push_the_card_is_still_written(tiny_model_dir, tmp_path, recording_api):
    train(
        tiny_rl_recipe(str(tiny_model_dir), tmp_path / "run", save_every=1), ["eval.before=false", "eval.after=false"]
    )
    card = (tmp_path / "run" / "checkpoints" / "step-000002" / "README.md").read_text()
    assert recording_api == []
    assert "base_model" not in yaml.safe_load(card.split("---\n")[1])  # a local directory is not a Hub id
    assert "No held-out evaluation was run" in card
    assert not (tmp_path / "run" / "checkpoints" / "step-000001" / "README.md").exists()


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        (
            {"HF_HUB_OFFLINE": "1"},
            "output.push_to_hub=me/tiny-grpo needs the Hugging Face Hub, but it is offline (HF_HUB_OFFLINE=1): "
            "run where the Hub can be reached, or set output.push_to_hub=null "
            "(the final model and its README.md stay in output.dir)",
        ),
        (
            {},
            "output.push_to_hub=me/tiny-grpo needs a Hugging Face token with write access: "
            "run 'hf auth login' or set HF_TOKEN, or set output.push_to_hub=null",
        ),
    ],
)
def test_a_push_that_cannot_happen_is_refused_before_anything_loads(
    tiny_model_dir, tmp_path, monkeypatch, capsys, setting, expected
):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    for name, value in setting.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(rl_setup, "load_models", lambda *args, **kwargs: pytest.fail("the model was loaded"))
    status, err = cli(
        tiny_rl_recipe(str(tiny_model_dir), tmp_path / "run"), tmp_path, capsys, "output.push_to_hub=me/tiny-grpo"
    )
    assert status == 2 and err == [f"polo: error: {expected}"]
    assert not (tmp_path / "run").exists()


def test_push_to_hub_must_be_a_repo_id():
    with pytest.raises(
        ConfigError, match=r"output.push_to_hub: 'my model' is not a Hugging Face Hub repo id; use org/name"
    ):
        load_config({"output": {"push_to_hub": "my model"}})
    assert load_config({"output": {"push_to_hub": None}}).output.push_to_hub is None


def test_a_failed_upload_says_the_model_is_safe(tmp_path, monkeypatch):
    final = tmp_path / "run" / "checkpoints" / "step-000005"
    final.mkdir(parents=True)

    class FailingApi(RecordingApi):
        def upload_folder(self, **kwargs):
            raise OSError("503 Service Unavailable\nretry later")

    monkeypatch.setattr(huggingface_hub, "HfApi", FailingApi)
    config = load_config({"output": {"push_to_hub": "me/x"}, "model": {"name": "org/base@v1"}})
    run = SimpleNamespace(
        config=config,
        checkpointer=SimpleNamespace(latest=lambda: final),
        task=SimpleNamespace(name="arithmetic", eval_rows=[1, 2]),
        eval_before={"accuracy": 0.25},
        output_dir=tmp_path / "run",  # where the card reads the run's starting recipe
    )
    with pytest.raises(SaveError) as error:
        publish_model(run, {"accuracy": 0.5})
    assert str(error.value) == (
        f"could not push {final} to the Hugging Face Hub repo me/x (OSError: 503 Service Unavailable retry later); "
        f"the trained model is intact there: push it again with 'hf upload me/x {final} --exclude trainer_state.pt'"
    )
    card = (final / "README.md").read_text()
    assert (
        "base_model: org/base\n" in card
        and "| before training | 0.250 |" in card
        and "Greedy decoding on 2 held-out problems" in card
    )


# ---------------------------------------------------------------- the card itself


def test_model_card_of_an_adapter():
    card = hub.model_card(
        hub.ModelCard(
            location="me/adapter",
            base_model="smollm2-135m-instruct",
            method="dapo",
            trained_on="gsm8k",
            steps=30,
            recipe="model:\n  name: smollm2-135m-instruct\n",
            held_out=hub.HeldOut("Greedy decoding on 200 held-out problems", ("accuracy",), None, {"accuracy": 0.4}),
            adapter=True,
            tags=("dapo", "reinforcement-learning"),
        )
    )
    metadata = yaml.safe_load(card.split("---\n")[1])
    assert metadata == {
        "library_name": "polo",
        "pipeline_tag": "text-generation",
        "tags": ["polo", "dapo", "reinforcement-learning", "lora", "peft"],
    }
    assert "\n---\n\n# adapter\n" in card
    assert (
        "A LoRA adapter for `smollm2-135m-instruct`" in card
        and 'AutoPeftModelForCausalLM.from_pretrained("me/adapter")' in card
    )
    assert "| before training | not measured |" in card and "| after training | 0.400 |" in card
    assert "```yaml\nmodel:\n  name: smollm2-135m-instruct\n```" in card


def test_model_card_of_a_reward_model():
    card = hub.model_card(
        hub.ModelCard(
            location="runs/rm/final",
            base_model="smollm2-135m-instruct",
            method="reward model",
            trained_on="preferences_train.jsonl",
            steps=12,
            recipe="data: {}\n",
            command="rm",
            held_out=hub.HeldOut(
                "Pair accuracy on 4 rankings",
                ("pair_accuracy", "margin"),
                {"pair_accuracy": 0.5, "margin": 0.0},
                {"pair_accuracy": 1.0, "margin": 2.5},
            ),
            reward_model=True,
            tags=("reward-model",),
        )
    )
    assert yaml.safe_load(card.split("---\n")[1])["pipeline_tag"] == "text-classification"
    assert "| | pair_accuracy | margin |" in card and "| after training | 1.000 | 2.500 |" in card
    assert 'AutoModelForSequenceClassification.from_pretrained("runs/rm/final")' in card
    assert "`polo rm config.yaml` repeats it" in card and "polo eval" not in card


# ---------------------------------------------------------------- every command pushes like polo train


def sft_recipe(model: str, tmp_path: Path) -> dict:
    rows = [{"prompt": f"What is {i} + 1?", "response": f"{i} + 1 = {i + 1}"} for i in range(4)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return {
        "model": {"name": model},
        "data": {"train_path": str(tmp_path / "train.jsonl"), "max_length": 64},
        "train": {"batch_size": 4, "micro_batch_size": 4, "precision": "fp32"},
        "output": {"dir": str(tmp_path / "run"), "report_to": [], "progress": False},
    }


@pytest.mark.parametrize("command", ["sft", "rm", "dpo", "pipeline"])
def test_every_command_refuses_a_push_that_cannot_happen_before_anything_loads(
    tiny_model_dir, tmp_path, monkeypatch, capsys, command
):
    import polo.models.loading as loading
    import polo.pipeline.run as pipeline_run

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name in ("load_policy", "load_tokenizer"):
        monkeypatch.setattr(loading, name, lambda *args, **kwargs: pytest.fail("a model was loaded"))
    monkeypatch.setattr(pipeline_run, "run_plan", lambda *args, **kwargs: pytest.fail("a stage ran"))
    if command == "pipeline":
        recipe = {
            "pipeline": {"dir": str(tmp_path / "run"), "model": str(tiny_model_dir)},
            "task": {"name": "arithmetic", "min_digits": 1, "max_digits": 1, "num_train": 40, "num_eval": 6},
            "stages": {"tune": {"kind": "sft", **sft_recipe(str(tiny_model_dir), tmp_path)}},
        }
        del recipe["stages"]["tune"]["output"]["dir"], recipe["stages"]["tune"]["model"]
        key = "pipeline.push_to_hub"
    else:
        recipe, key = sft_recipe(str(tiny_model_dir), tmp_path), "output.push_to_hub"
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    capsys.readouterr()
    assert main([command, str(path), f"{key}=me/tiny"]) == 2
    where = "pipeline.dir" if command == "pipeline" else "output.dir"
    assert capsys.readouterr().err.splitlines() == [
        f"polo: error: {key}=me/tiny needs the Hugging Face Hub, but it is offline (HF_HUB_OFFLINE=1): "
        f"run where the Hub can be reached, or set {key}=null (the final model and its README.md stay in {where})"
    ]


def test_polo_sft_pushes_its_final_model_with_a_model_card(
    tiny_model_dir, tmp_path, monkeypatch, recording_api, capsys
):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    recipe = sft_recipe(str(tiny_model_dir), tmp_path)
    recipe["output"].update({"push_to_hub": "me/tiny-sft", "hub_private": True})
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["sft", str(path)]) == 0
    final = tmp_path / "run" / "final"
    assert f"polo: pushed {final} to https://huggingface.co/me/tiny-sft" in capsys.readouterr().out
    (create, upload) = recording_api
    assert create == ("create_repo", "me/tiny-sft", {"private": True, "exist_ok": True, "repo_type": "model"})
    _, kwargs, files, card = upload
    assert kwargs["folder_path"] == str(final) and {"README.md", "model.safetensors", "tokenizer.json"} <= set(files)
    assert card == (final / "README.md").read_text()
    metadata = yaml.safe_load(card.removeprefix("---\n").split("\n---\n", 1)[0])
    assert metadata["tags"] == ["polo", "sft"] and "base_model" not in metadata  # a local directory is no Hub id
    assert "No held-out evaluation was run (the recipe sets no data.eval_path)" in card
    assert 'AutoModelForCausalLM.from_pretrained("me/tiny-sft")' in card and "`polo sft config.yaml`" in card
