"""Prompts for `jaxserve bench speculative`, cut from Python's standard library (present wherever
Python is, so the bench needs no data files).

- code: stretches of library source: a draft model trained on code proposes well here;
- editing: a function, then the start of its own copy: the output repeats the prompt, the case
  prompt lookup (n-gram drafting) is for;
- edit: chat requests to edit a ~20-line snippet and show the whole code (rename a variable, add
  docstrings, add type hints, a dict for a Counter): the answer repeats much of the prompt, as
  a user's editing requests do;
- chat: questions a user asks an instruct model (coding and general), as chat messages the
  bench renders with the model's chat template. None of them is in the EAGLE head's training
  prompts (scripts/train_eagle.py builds those from standard-library docstrings).
"""

from __future__ import annotations

import difflib
import inspect
import json
import statistics
import textwrap


def code_prompts(n: int) -> list[str]:
    out = []
    for mod in (textwrap, difflib, json.decoder, statistics):
        src = inspect.getsource(mod)
        out += [src[i : i + 300] for i in range(0, len(src) - 400, len(src) // 6)]
    return (out * (n // len(out) + 1))[:n]


def editing_prompts(n: int) -> list[str]:
    funcs = [
        textwrap.dedent,
        textwrap.indent,
        textwrap.shorten,
        textwrap.fill,
        statistics.median,
        statistics.mode,
        statistics.variance,
        json.dumps,
    ]
    out = []
    for f in funcs:
        src = inspect.getsource(f)
        out.append(f"{src}\n\n# The same function, unchanged:\n{src.splitlines()[0]}\n")
    return (out * (n // len(out) + 1))[:n]


CHAT_QUESTIONS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "What causes the seasons on Earth?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain what a hash table is in two sentences.",
    "How do I read a text file line by line in Python?",
    "What is the difference between a list and a tuple in Python?",
    "Give me three tips for writing clean code.",
    "Write a Python function that counts the vowels in a string.",
    "Why is the sky blue?",
    "Write a function in Python that merges two sorted lists.",
    "What is photosynthesis?",
    "How do I sort a dictionary by its values in Python?",
    "Explain recursion to a beginner.",
    "Write a Python class for a simple bank account with deposit and withdraw methods.",
    "What are the main causes of climate change?",
    "Write a Python function that removes duplicates from a list while keeping the order.",
]


def chat_prompts(n: int) -> list[list[dict]]:
    out = [[{"role": "user", "content": q}] for q in CHAT_QUESTIONS]
    return (out * (n // len(out) + 1))[:n]


SNIPPETS = [
    """def word_counts(path):
    counts = {}
    with open(path) as f:
        for line in f:
            for word in line.split():
                word = word.strip(".,;:!?").lower()
                if not word:
                    continue
                if word in counts:
                    counts[word] += 1
                else:
                    counts[word] = 1
    return counts


def top_words(path, n):
    counts = word_counts(path)
    items = sorted(counts.items(), key=lambda kv: kv[1], reverse=True)
    return items[:n]
""",
    """def load_scores(lines):
    data = {}
    for line in lines:
        name, score = line.split(",")
        name = name.strip()
        score = int(score)
        if name not in data:
            data[name] = []
        data[name].append(score)
    return data


def averages(data):
    result = {}
    for name, scores in data.items():
        total = 0
        for s in scores:
            total += s
        result[name] = total / len(scores)
    return result
""",
]
EDITS = [
    "Rename the variable `counts` to `frequencies` everywhere (in the second snippet rename `data` to `table`). "
    "Show the whole code.",
    "Add a docstring to each function. Show the whole code.",
    "Add type hints to every function. Show the whole code.",
    "Replace the dictionary counting with collections.Counter where it fits. Show the whole code.",
]


def edit_prompts(n: int) -> list[list[dict]]:
    out = [[{"role": "user", "content": f"{edit}\n\n```python\n{code}```"}] for code in SNIPPETS for edit in EDITS]
    return (out * (n // len(out) + 1))[:n]


def prompts(kind: str, n: int) -> list:
    """Prompt texts (chat, edit: message lists, rendered by the caller with the model's template)."""
    return {"code": code_prompts, "editing": editing_prompts, "edit": edit_prompts, "chat": chat_prompts}[kind](n)
