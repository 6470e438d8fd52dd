"""The built-in tiny model and its task: single-digit addition.

`ppoflow train` with no arguments trains this model on CPU in minutes. The model is a Qwen2-style
causal LM of about 0.45M parameters over a character tokenizer of 20 tokens; the task is
"a + b = " → "c" followed by EOS. A policy from random initialisation never finds the reward on this
task, so the model is warm-started with a few seconds of supervised steps until its greedy accuracy
reaches a plausible "pretrained" level (0.75 or a little more), and PPO takes it from there.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
CHARACTERS = list("0123456789") + [" ", "+", "=", "-", "*", "#", "?"]
ADDITION_DATA_SOURCE = "ppoflow/addition"


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer (one token per character) wrapped as a real HF fast tokenizer.

    Padding is on the left, as batched generation needs. Reload a saved copy with
    `AutoTokenizer.from_pretrained` (its tokenizer_config names PreTrainedTokenizerFast) or with
    `PreTrainedTokenizerFast.from_pretrained`; the ids are then unchanged.
    """
    vocab = {token: i for i, token in enumerate([PAD, EOS, UNK, *CHARACTERS])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD, eos_token=EOS, unk_token=UNK, padding_side="left"
    )
    return tokenizer


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast, *, seed: int, tie_embeddings: bool = False
) -> Qwen2ForCausalLM:
    """A freshly initialised Qwen2-style causal LM sized for CPU (about 0.45M parameters).

    The output head has its own weights unless `tie_embeddings`. With one vector per character for
    reading it (in the prompt) and writing it (in the answer), an RL update that makes an answer
    digit less likely also moves how that digit is read in every prompt that contains it: on the
    addition task that interference drove the right answers of problems not yet solved towards zero,
    and some seeds stalled below 0.90 (docs/MODELS.md, "The built-in tiny model").
    """
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        attention_dropout=0.0,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


@dataclass(frozen=True)
class AdditionProblem:
    """One "a + b = " problem; `answer` is the ground truth the reward compares against."""

    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a} + {self.b} = "

    @property
    def answer(self) -> str:
        return str(self.a + self.b)


def all_addition_problems() -> list[AdditionProblem]:
    """The 100 distinct single-digit problems, in a fixed order (the validation set)."""
    return [AdditionProblem(a, b) for a in range(10) for b in range(10)]


def sample_addition_problems(count: int, *, seed: int) -> list[AdditionProblem]:
    """`count` problems drawn uniformly with replacement (the training set)."""
    rng = random.Random(seed)
    return [AdditionProblem(rng.randrange(10), rng.randrange(10)) for _ in range(count)]


def warm_start(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    *,
    seed: int,
    target_accuracy: float = 0.75,
    max_steps: int = 1000,
    check_every: int = 10,
    batch_size: int = 32,
    lr: float = 3e-3,
    grad_clip: float = 1.0,
) -> dict[str, float]:
    """Supervised steps on "prompt answer<eos>" until greedy accuracy reaches `target_accuracy`.

    Stopping at a target rather than after a fixed number of steps makes the base a "plausible
    pretrained model" that still leaves PPO most of the task to learn. Deterministic for a seed.
    The gradient norm is clipped at 1: without it some seeds' accuracy swung for hundreds of steps
    (seed 17: still 0.18 after 1,000); with it seeds 1-32 got there in 130-710 steps. A lower lr
    (1e-3) got there sooner, but PPO from those bases was unstable (docs/MODELS.md).
    Returns {"steps", "accuracy"}.
    """
    generator = torch.Generator().manual_seed(seed)
    problems = all_addition_problems()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    accuracy, step = greedy_accuracy(model, tokenizer, problems), 0
    while accuracy < target_accuracy and step < max_steps:
        model.train()
        for _ in range(check_every):
            picks = torch.randint(len(problems), (batch_size,), generator=generator).tolist()
            loss = _supervised_loss(model, tokenizer, [problems[i] for i in picks])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            optimizer.step()
            step += 1
        accuracy = greedy_accuracy(model, tokenizer, problems)
    model.eval()
    return {"steps": float(step), "accuracy": accuracy}


def _supervised_loss(model, tokenizer, problems: list[AdditionProblem]) -> torch.Tensor:
    """Cross-entropy on the answer tokens and EOS only (the prompt is given, not learned)."""
    rows = [tokenizer(p.prompt)["input_ids"] for p in problems]
    answers = [tokenizer(p.answer)["input_ids"] + [tokenizer.eos_token_id] for p in problems]
    width = max(len(r) + len(a) for r, a in zip(rows, answers, strict=True))
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (prompt, answer) in enumerate(zip(rows, answers, strict=True)):
        seq = prompt + answer
        input_ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, len(prompt) : len(seq)] = torch.tensor(answer)
        attention[i, : len(seq)] = 1
    return model(input_ids=input_ids, attention_mask=attention, labels=labels).loss


@torch.no_grad()
def greedy_accuracy(model, tokenizer, problems: list[AdditionProblem], max_new_tokens: int = 4) -> float:
    """Share of problems whose greedy answer (up to EOS) is exactly right."""
    from .rollout import HFRolloutEngine, SamplingParams

    engine = HFRolloutEngine(
        model, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id
    )
    prompts = [tokenizer(p.prompt)["input_ids"] for p in problems]
    out = engine.generate(prompts, SamplingParams.greedy(max_new_tokens), seeds=[0] * len(prompts))
    texts = tokenizer.batch_decode(out.response_ids, skip_special_tokens=True)
    return sum(t.strip() == p.answer for t, p in zip(texts, problems, strict=True)) / len(problems)


def labelled_addition_responses(count: int, *, seed: int) -> list[dict]:
    """`count` labelled responses to addition problems, for training a reward model: records
    {"prompt", "response", "label", "finish_reason"}, label 1 for a right answer, else 0 (the
    addition reward's correctness). Half are right answers; the rest a wrong number (near the sum or
    anywhere), a malformed answer of one to three random characters, or four characters that run
    into the length limit without EOS (finish_reason "length"), as a rambling policy's do.
    Deterministic for a seed."""
    from .rewards import addition_components

    rng = random.Random(seed + 1_000_003)  # not the problems' stream
    records = []
    for problem in sample_addition_problems(count, seed=seed):
        total, draw, finish = problem.a + problem.b, rng.random(), "stop"
        if draw < 0.5:
            response = problem.answer
        elif draw < 0.65:
            response = str(abs(total + rng.choice([-3, -2, -1, 1, 2, 3])) if total > 3 else total + 1)
        elif draw < 0.75:
            response = str(rng.choice([n for n in range(19) if n != total]))
        elif draw < 0.85:
            response = "".join(rng.choice(CHARACTERS) for _ in range(rng.randint(1, 3)))
        else:
            response = (problem.answer + "".join(rng.choice(CHARACTERS) for _ in range(4)))[:4]
            finish = "length"
        label = addition_components(response, problem.answer)["correctness"]
        records.append(
            {"prompt": problem.prompt, "response": response, "label": label, "finish_reason": finish}
        )
    return records
