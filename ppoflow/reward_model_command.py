"""`ppoflow reward-model`: train a reward model from labelled responses, for reward_model.model.path.

The reward model is a causal LM's backbone (`--base`) with a new score head
(`engine.models.reward_model_from_policy`), fitted by binary cross-entropy to labels 1 (good) and 0
(bad) (`engine.reward_model.train_reward_model`), checked on held-out responses (ROC AUC), and saved
as a Hugging Face directory (safetensors, config, tokenizer). Its inputs are tokenised as a run
tokenises them: the prompt as the actor sees it (chat template applied to a message prompt), then
the response and, unless it ran into the length limit, EOS.

Data: a JSONL file of {"prompt": text or [{"role", "content"}, …], "response": text, "label": 0 or 1,
"finish_reason": "stop" (the default: it ended with EOS) or "length"} (a tenth held out), or
`builtin:addition`, labelled answers to the built-in addition task.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch, transformers and prefect load when training starts, not with the CLI's parser
    import torch

    from ppoflow.engine.forward import SequenceBatch

BUILTIN_DATA = "builtin:addition"
BUILTIN_MODEL = "builtin:tiny-addition"  # tasks.stages.prepare_model.BUILTIN_MODEL, without importing prefect
HELD_OUT = 400
"""Held-out responses of builtin:addition (a JSONL file holds out its last tenth)."""

FINISH_REASONS = ("stop", "length")


@dataclass(frozen=True)
class RewardModelRecipe:
    """How to train: the base model, the labelled data and the optimisation."""

    data: str = BUILTIN_DATA
    base: str = BUILTIN_MODEL
    steps: int = 300
    batch_size: int = 32
    lr: float = 5e-4
    seed: int = 1
    examples: int = 4000
    """Training responses drawn for builtin:addition."""


def train_reward_model_dir(out: Path, recipe: RewardModelRecipe) -> dict[str, float]:
    """Train a reward model as `recipe` says and save it to `out` (which must not exist or be empty);
    returns what the training and the held-out check measured."""
    from ppoflow.engine.models import load_tokenizer, reward_model_from_policy
    from ppoflow.engine.reward_model import train_reward_model
    from ppoflow.tasks.stages.prepare_model import build_tiny_base
    from ppoflow.tasks.storage.checkpoints import readable_as_the_umask_allows

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty folder: choose another --out or delete it")
    base = build_tiny_base(seed=1) if recipe.base == BUILTIN_MODEL else Path(recipe.base)
    tokenizer = load_tokenizer(base)
    train, held_out = _labelled(recipe)
    batch, labels = _encoded(tokenizer, train)
    model = reward_model_from_policy(base, pad_token_id=tokenizer.pad_token_id)
    losses = train_reward_model(
        model, batch, labels, steps=recipe.steps, batch_size=recipe.batch_size, lr=recipe.lr, seed=recipe.seed
    )
    test_batch, test_labels = _encoded(tokenizer, held_out)
    tail = losses[-max(1, len(losses) // 10) :]  # one step's loss is one batch's: noisy
    report = {"train": float(len(train)), "loss_first": losses[0], "loss_last": sum(tail) / len(tail)}
    report |= held_out_report(model, test_batch, test_labels)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / "reward_model_training.json").write_text(json.dumps({**report, "recipe": vars(recipe)}))
        readable_as_the_umask_allows(staging)
        if out.exists():
            out.rmdir()
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return report


def held_out_report(model: torch.nn.Module, batch: SequenceBatch, labels: torch.Tensor) -> dict[str, float]:
    """How well the reward model separates the held-out labels: ROC AUC and mean score per label."""
    from ppoflow.engine.forward import compute_scores
    from ppoflow.engine.reward_model import separation_auc

    if len(batch) == 0 or len(set(labels.tolist())) < 2:
        return {"held_out": float(len(batch))}
    scores = compute_scores(model, batch, micro_batch_size=256)
    return {
        "held_out": float(len(batch)),
        "auc": separation_auc(scores, labels),
        "mean_good": float(scores[labels == 1].mean()),
        "mean_bad": float(scores[labels == 0].mean()),
    }


def _labelled(recipe: RewardModelRecipe) -> tuple[list[dict], list[dict]]:
    from ppoflow.engine.tiny import labelled_addition_responses

    if recipe.data == BUILTIN_DATA:
        return (
            labelled_addition_responses(recipe.examples, seed=recipe.seed),
            labelled_addition_responses(HELD_OUT, seed=recipe.seed + 1),
        )
    examples = read_labelled(Path(recipe.data))
    random.Random(recipe.seed).shuffle(examples)
    cut = len(examples) - len(examples) // 10
    return examples[:cut], examples[cut:]


def read_labelled(path: Path) -> list[dict]:
    """The labelled responses of a JSONL file, one record per line; a ValueError names a bad line."""
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            record = {key: row[key] for key in ("prompt", "response", "label")}
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(
                f"{path}:{number}: not a JSON object with prompt, response and label ({error})"
            ) from None
        record["finish_reason"] = row.get("finish_reason", "stop")
        if (
            not isinstance(record["prompt"], str | list)
            or not isinstance(record["response"], str)
            or record["label"] not in (0, 1)
            or record["finish_reason"] not in FINISH_REASONS
        ):
            raise ValueError(
                f"{path}:{number}: prompt must be text or a list of messages, response text, label 0 or 1, "
                f"finish_reason one of {FINISH_REASONS}"
            )
        records.append(record)
    if not records:
        raise ValueError(f"{path} holds no labelled responses")
    return records


def _encoded(tokenizer, records: list[dict]) -> tuple[SequenceBatch, torch.Tensor]:
    """The records as a run feeds them to a reward model: prompt ids, then response ids and, when the
    response ended (finish_reason stop), EOS."""
    import torch

    from ppoflow.engine.ppo import build_sequence_batch
    from ppoflow.tasks.stages.prompt_rows import prompt_token_ids

    prompts, responses = [], []
    for record in records:
        prompt, chat = record["prompt"], isinstance(record["prompt"], list)
        ids = prompt_token_ids(
            tokenizer, {"prompt_messages": prompt if chat else None, "prompt_text": prompt}
        )
        if isinstance(ids, str):
            raise ValueError(ids)
        prompts.append(ids)
        eos = [tokenizer.eos_token_id] if record["finish_reason"] == "stop" else []
        responses.append([*tokenizer(record["response"], add_special_tokens=False)["input_ids"], *eos])
    labels = torch.tensor([float(record["label"]) for record in records])
    return build_sequence_batch(prompts, responses, pad_token_id=tokenizer.pad_token_id), labels


def report_lines(out: Path, recipe: RewardModelRecipe, report: dict[str, float]) -> list[str]:
    lines = [
        f"reward model   {out}  (from {recipe.base})",
        f"trained        {recipe.steps} steps on {int(report['train']):,} labelled responses · "
        f"loss {report['loss_first']:.3f} → {report['loss_last']:.3f} (last tenth of the steps)",
    ]
    if "auc" in report:
        lines.append(
            f"held out       {int(report['held_out']):,} responses · AUC {report['auc']:.3f} · mean score "
            f"{report['mean_good']:.2f} (label 1) vs {report['mean_bad']:.2f} (label 0)"
        )
    lines.append(f"use it         ppoflow train reward_model.enable=true reward_model.model.path={out}")
    return lines
