"""Generate the demo model's synthetic corpus and its held-out arithmetic split.

Everything comes from one `random.Random(seed)`, so the same seed gives byte-identical files.

Outputs (in --out):
  train.jsonl    one document per line: {"kind": "chat", "messages": [...]} or {"kind": "text", "text": ...}
  heldout.jsonl  held-out questions, shuffled: {"id", "kind", "question", "answer", "choices", "label"}
  fewshot.jsonl  a few training-distribution questions (same schema) for lm-eval's few-shot split

No held-out problem overlaps training: every held-out problem has a key (operation and operands,
unordered for + and ×) and no training document (chat, plain text, word problem or times table)
uses a problem with that key.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Callable, NamedTuple

SEED = 1234
NUM_DOCS = 300_000

ADD_TEMPLATES = [
    "What is {a} + {b}?", "What is {a} plus {b}?", "Compute {a} + {b}.", "{a} + {b} = ?",
    "Calculate {a} + {b}.", "What is the sum of {a} and {b}?", "Add {a} and {b}.",
]
SUB_TEMPLATES = [
    "What is {a} - {b}?", "What is {a} minus {b}?", "Compute {a} - {b}.", "{a} - {b} = ?",
    "Calculate {a} - {b}.", "Subtract {b} from {a}.",
]
MUL_TEMPLATES = [
    "What is {a} × {b}?", "What is {a} * {b}?", "What is {a} times {b}?", "Compute {a} × {b}.",
    "{a} × {b} = ?", "Calculate {a} * {b}.", "Multiply {a} by {b}.",
]
NAMES = ["Tom", "Anna", "Sam", "Lily", "Max", "Mia", "Ben", "Emma", "Leo", "Zoe", "Jack", "Sara"]
OBJECTS = ["apples", "pencils", "stickers", "marbles", "books", "cookies", "cards", "coins",
           "shells", "balloons", "stamps", "toy cars"]
WORD_ADD = [
    "{n} has {a} {o} and buys {b} more. How many {o} does {n} have?",
    "{n} has {a} {o}. {m} gives {n} {b} more. How many {o} does {n} have now?",
    "There are {a} {o} in a box and {b} {o} on the table. How many {o} are there in all?",
    "{n} found {a} {o} on Monday and {b} {o} on Tuesday. How many {o} did {n} find?",
]
WORD_SUB = [
    "{n} has {a} {o} and gives away {b}. How many {o} does {n} have left?",
    "{n} had {a} {o} and lost {b} of them. How many {o} does {n} have now?",
    "There are {a} {o} in a box. {n} takes {b} of them. How many {o} are left in the box?",
]
WORD_MUL = [
    "There are {a} boxes with {b} {o} in each box. How many {o} are there in total?",
    "{n} buys {a} packs of {o}. Each pack has {b} {o}. How many {o} does {n} buy?",
]

# Held-out split: how many problems of each kind (1,000 in all). The 0-12 times table is not held
# out: those are facts to memorize, not to compute, so a held-out one would measure nothing. The
# held-out products are two-digit by one-digit ones, which follow from the table.
HELDOUT_COUNTS = {"add": 400, "sub": 300, "mul": 50, "add3": 100, "word": 150}


class Problem(NamedTuple):
    kind: str       # add, sub, mul_table, mul, add3, word
    op: str         # "+", "-", "*"
    a: int
    b: int
    question: str

    @property
    def answer(self) -> int:
        return {"+": self.a + self.b, "-": self.a - self.b, "*": self.a * self.b}[self.op]

    @property
    def key(self) -> tuple[str, int, int]:
        return problem_key(self.op, self.a, self.b)


def problem_key(op: str, a: int, b: int) -> tuple[str, int, int]:
    """Identity of a problem for the no-overlap rule (+ and × are commutative)."""
    if op in "+*":
        a, b = min(a, b), max(a, b)
    return (op, a, b)


def small_or_two_digit(rng: random.Random) -> int:
    """0-99, with one in four drawn from 0-9 so one-digit operands are common."""
    return rng.randint(0, 9) if rng.random() < 0.25 else rng.randint(10, 99)


def operands(kind: str, rng: random.Random) -> tuple[str, int, int]:
    if kind == "add":
        return "+", small_or_two_digit(rng), small_or_two_digit(rng)
    if kind == "sub":
        a, b = small_or_two_digit(rng), small_or_two_digit(rng)
        return "-", max(a, b), min(a, b)
    if kind == "mul_table":
        return "*", rng.randint(0, 12), rng.randint(0, 12)
    if kind == "mul":
        a, b = rng.randint(10, 99), rng.randint(2, 9)
        return ("*", a, b) if rng.random() < 0.5 else ("*", b, a)
    if kind == "add3":
        a, b = rng.randint(100, 999), rng.randint(10, 99)
        return ("+", a, b) if rng.random() < 0.7 else ("+", b, a)
    raise ValueError(f"unknown problem kind {kind!r}")


def word_question(op: str, a: int, b: int, rng: random.Random) -> str:
    n, m = rng.sample(NAMES, 2)
    o = rng.choice(OBJECTS)
    templates = {"+": WORD_ADD, "-": WORD_SUB, "*": WORD_MUL}[op]
    return rng.choice(templates).format(n=n, m=m, o=o, a=a, b=b)


def make_problem(kind: str, rng: random.Random) -> Problem:
    if kind == "word":
        r = rng.random()
        if r < 0.45:
            op, a, b = operands("add", rng)
        elif r < 0.90:
            op, a, b = operands("sub", rng)
        else:
            op, a, b = operands("mul", rng)
        return Problem(kind, op, a, b, word_question(op, a, b, rng))
    op, a, b = operands(kind, rng)
    templates = {"+": ADD_TEMPLATES, "-": SUB_TEMPLATES, "*": MUL_TEMPLATES}[op]
    return Problem(kind, op, a, b, rng.choice(templates).format(a=a, b=b))


TRAIN_KIND_WEIGHTS = {"add": 0.30, "sub": 0.23, "mul_table": 0.08, "mul": 0.14, "add3": 0.10, "word": 0.15}


def training_problem(rng: random.Random, heldout_keys: set) -> Problem:
    kinds, weights = zip(*TRAIN_KIND_WEIGHTS.items())
    while True:
        p = make_problem(rng.choices(kinds, weights)[0], rng)
        if p.key not in heldout_keys:
            return p


def distractors(answer: int, rng: random.Random) -> list[int]:
    """Three wrong numeric choices near the answer (off by one, by ten, digits swapped)."""
    candidates = {answer + d for d in (-10, -2, -1, 1, 2, 10)}
    s = str(answer)
    if len(s) >= 2 and s[-1] != s[-2]:
        candidates.add(int(s[:-2] + s[-1] + s[-2]))
    candidates = sorted(c for c in candidates if c >= 0 and c != answer)
    return rng.sample(candidates, 3)


def heldout_item(idx: int, p: Problem, rng: random.Random) -> dict:
    choices = distractors(p.answer, rng) + [p.answer]
    rng.shuffle(choices)
    return {"id": idx, "kind": p.kind, "question": p.question, "answer": str(p.answer),
            "choices": [str(c) for c in choices], "label": choices.index(p.answer)}


def make_heldout(rng: random.Random) -> tuple[list[dict], set]:
    items, keys = [], set()
    for kind, count in HELDOUT_COUNTS.items():
        made = 0
        while made < count:
            p = make_problem(kind, rng)
            if p.key in keys:
                continue
            keys.add(p.key)
            items.append(heldout_item(len(items), p, rng))
            made += 1
    return items, keys


# ---------------------------------------------------------------- chat and text documents

COLORS = ["red", "blue", "green", "yellow", "orange", "purple", "pink", "brown", "black", "white"]
FRUITS = ["apple", "banana", "orange", "pear", "grape", "peach", "plum", "cherry", "lemon", "mango"]
FRUIT_PLURALS = {"peach": "peaches", "cherry": "cherries", "mango": "mangoes"}
ANIMALS = ["cat", "dog", "bird", "fish", "horse", "cow", "duck", "rabbit", "fox", "bear"]
PLACES = ["park", "garden", "house", "school", "forest", "river", "town", "beach"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December"]
VERBS = ["likes", "sees", "has", "wants", "finds", "draws"]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
                "ten", "eleven", "twelve"]
SYSTEM_PROMPTS = ["You are a helpful assistant.", "You are Atom, a small demo model.",
                  "Answer with a number only."]
GREETINGS = ["Hello!", "Hi!", "Hello", "Hi there!", "Hey!", "Good morning!"]
GREETING_REPLY = "Hello! I am Atom, a small demo model. Ask me an arithmetic question, like: What is 12 + 30?"
WHO_QUESTIONS = ["Who are you?", "What are you?", "What is your name?", "What can you do?"]
WHO_REPLY = "I am Atom, a small demo model. I can add, subtract and multiply small numbers."


def plural(fruit: str) -> str:
    return FRUIT_PLURALS.get(fruit, fruit + "s")


def sentence(rng: random.Random) -> str:
    name, verb = rng.choice(NAMES), rng.choice(VERBS)
    color, animal, place = rng.choice(COLORS), rng.choice(ANIMALS), rng.choice(PLACES)
    return rng.choice([
        f"{name} {verb} a {color} {animal}.",
        f"The {animal} is in the {place}.",
        f"{name} goes to the {place} with a {animal}.",
        f"The {color} {animal} runs to the {place}.",
        f"{name} has {NUMBER_WORDS[rng.randint(2, 9)]} {plural(rng.choice(FRUITS))}.",
        f"It is a sunny day in the {place}.",
    ])


def story(rng: random.Random) -> str:
    name, animal, place = rng.choice(NAMES), rng.choice(ANIMALS), rng.choice(PLACES)
    color, fruit = rng.choice(COLORS), rng.choice(FRUITS)
    return (f"Once upon a time, there was a little {animal} named {name}. "
            f"{name} lived near the {place}. One day, {name} found a {color} {fruit}. "
            f"{name} was very happy and shared the {fruit} with a friend. The end.")


def counting(rng: random.Random) -> tuple[str, str]:
    step = rng.choice([1, 1, 1, 2, 5, 10])
    start = rng.randint(0, 20) * step
    n = rng.randint(4, 10)
    seq = [start + i * step for i in range(n)]
    if rng.random() < 0.2:
        seq = seq[::-1]
        return f"Count down from {seq[0]} to {seq[-1]}.", ", ".join(map(str, seq))
    if step == 1:
        return f"Count from {seq[0]} to {seq[-1]}.", ", ".join(map(str, seq))
    return f"Count by {step}s from {seq[0]} to {seq[-1]}.", ", ".join(map(str, seq))


def list_of(rng: random.Random) -> tuple[str, str]:
    noun, pool = rng.choice([("colors", COLORS), ("fruits", FRUITS), ("animals", ANIMALS)])
    k = rng.randint(2, 5)
    return f"List {NUMBER_WORDS[k]} {noun}.", ", ".join(rng.sample(pool, k))


def next_in(rng: random.Random) -> tuple[str, str]:
    seq = rng.choice([DAYS, MONTHS])
    i = rng.randrange(len(seq))
    return f"What comes after {seq[i]}?", seq[(i + 1) % len(seq)]


def spell(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(ANIMALS + COLORS + FRUITS)
    return f"Spell {word}.", "-".join(word)


def compare(rng: random.Random) -> tuple[str, str]:
    a, b = rng.sample(range(100), 2)
    return f"Is {a} bigger than {b}?", "Yes" if a > b else "No"


def misc_chat(rng: random.Random) -> tuple[str, str]:
    r = rng.random()
    if r < 0.10:
        return rng.choice(GREETINGS), GREETING_REPLY
    if r < 0.18:
        return rng.choice(WHO_QUESTIONS), WHO_REPLY
    if r < 0.26:
        return rng.choice(["Tell me a story.", "Tell me a short story.", "Write a short story."]), story(rng)
    if r < 0.34:
        return "Write a sentence.", sentence(rng)
    maker: Callable = rng.choice([counting, list_of, next_in, spell, compare])
    return maker(rng)


def chat_doc(rng: random.Random, heldout_keys: set) -> dict:
    messages = []
    if rng.random() < 0.1:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    for _ in range(rng.choices([1, 2, 3, 4], [50, 25, 15, 10])[0]):
        if rng.random() < 0.85:
            p = training_problem(rng, heldout_keys)
            q, a = p.question, str(p.answer)
        else:
            q, a = misc_chat(rng)
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return {"kind": "chat", "messages": messages}


def qa_text_doc(rng: random.Random, heldout_keys: set) -> dict:
    """Plain 'Question: ...\\nAnswer: ...' blocks, or bare 'What is 3 + 4? 7' lines."""
    problems = [training_problem(rng, heldout_keys) for _ in range(rng.randint(1, 4))]
    if rng.random() < 0.6:
        text = "\n\n".join(f"Question: {p.question}\nAnswer: {p.answer}" for p in problems)
    else:
        text = "\n".join(f"{p.question} {p.answer}" for p in problems)
    return {"kind": "text", "text": text}


def times_table(rng: random.Random, heldout_keys: set) -> str:
    a = rng.randint(2, 12)
    lines = [f"{a} × {b} = {a * b}" for b in range(1, 11) if problem_key("*", a, b) not in heldout_keys]
    return f"The {a} times table:\n" + "\n".join(lines)


def structured_text_doc(rng: random.Random, heldout_keys: set) -> dict:
    r = rng.random()
    if r < 0.25:
        text = " ".join(sentence(rng) for _ in range(rng.randint(2, 5)))
    elif r < 0.40:
        text = story(rng)
    elif r < 0.55:
        q, a = counting(rng)
        text = f"{q[:-1]}: {a}."
    elif r < 0.70:
        noun, pool = rng.choice([("Shopping list", FRUITS), ("Colors", COLORS), ("Animals", ANIMALS)])
        text = f"{noun}:\n" + "\n".join(f"{i + 1}. {x}" for i, x in enumerate(rng.sample(pool, rng.randint(3, 6))))
    elif r < 0.80:
        seq = rng.choice([DAYS, MONTHS])
        text = f"The {'days of the week' if seq is DAYS else 'months of the year'} are: " + ", ".join(seq) + "."
    else:
        text = times_table(rng, heldout_keys)
    return {"kind": "text", "text": text}


DOC_MAKERS = [(chat_doc, 0.62), (qa_text_doc, 0.18), (structured_text_doc, 0.20)]


def make_corpus(num_docs: int, seed: int) -> tuple[list[dict], list[dict], list[dict]]:
    rng = random.Random(seed)
    heldout, heldout_keys = make_heldout(rng)
    makers, weights = zip(*DOC_MAKERS)
    docs = [rng.choices(makers, weights)[0](rng, heldout_keys) for _ in range(num_docs)]
    fewshot = [heldout_item(i, training_problem(rng, heldout_keys), rng) for i in range(20)]
    return docs, heldout, fewshot


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--num-docs", type=int, default=NUM_DOCS)
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    docs, heldout, fewshot = make_corpus(args.num_docs, args.seed)
    write_jsonl(args.out / "train.jsonl", docs)
    # Shuffled with a separate generator (the corpus stays as it is) so that any prefix, such as
    # lm-eval's --limit N, mixes every kind of question.
    write_jsonl(args.out / "heldout.jsonl", random.Random(args.seed + 1).sample(heldout, len(heldout)))
    write_jsonl(args.out / "fewshot.jsonl", fewshot)
    print(f"wrote {len(docs)} documents, {len(heldout)} held-out and {len(fewshot)} few-shot questions to {args.out}")


if __name__ == "__main__":
    main()
