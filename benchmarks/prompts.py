"""Prompts for ``omnistage bench``: a built-in set of varied lengths, or one per line from a file,
drawn into a request sequence that depends only on the seed."""

from __future__ import annotations

import random
from pathlib import Path

# From 10 to ~125 prompt tokens. Every one makes the tiny checkpoint speak (a reply with no
# codec frames has no time to first audio, and transformers' generate() cannot return audio
# for it), at the default and at small token limits.
BUILTIN_PROMPTS: tuple[str, ...] = (
    "Hi",
    "Good morning.",
    "What time is it?",
    "Tell me a joke about cats.",
    "Read this sentence aloud, please.",
    "How do I boil an egg so the yolk stays soft?",
    "Can you recommend a good book for a long train ride?",
    "Write a short poem about the sea at night, with the moon on the water and a lighthouse far away "
    "blinking slowly.",
    "Imagine you are a tour guide in an old city. Welcome a group of visitors, tell them what they "
    "will see today, and remind them to stay together.",
    "My neighbour plays loud music late every night and I have to get up early for work. I do not "
    "want to start a fight. How should I talk to them about it, and what should I do if nothing "
    "changes after a week?",
)


def load_prompts(path: Path | None) -> list[str]:
    """The built-in set, or the non-empty lines of ``path``."""
    if path is None:
        return list(BUILTIN_PROMPTS)
    lines = [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines()]
    prompts = [line for line in lines if line]
    if not prompts:
        raise ValueError(f"{path}: no prompts (one per line expected)")
    return prompts


def request_sequence(num_prompts: int, num_requests: int, seed: int) -> list[int]:
    """Prompt index of each request: shuffled passes over the prompt set, repeatable per seed, so
    every configuration of a run sees the same request mix in the same order."""
    rng = random.Random(seed)
    order: list[int] = []
    while len(order) < num_requests:
        batch = list(range(num_prompts))
        rng.shuffle(batch)
        order.extend(batch)
    return order[:num_requests]
