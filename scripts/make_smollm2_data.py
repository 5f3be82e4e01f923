"""Training data for SmolLM2-135M-Instruct's drafters, the seed recipe's way: prompts, and the
target's own answers to them (half greedy, half at the card's sampling settings: temperature 0.6,
top-p 0.95, top-k 20).

    python scripts/make_smollm2_data.py [--per-category 1500] [--batch 64] [--limit-seconds S]
    python scripts/make_smollm2_data.py --heldout   # heldout_answers.npz: for evaluation only

Prompts (prompts.jsonl: id, category, prompt, and whether its answer is sampled), deduplicated and disjoint from the held-out
evaluation set (qspec_ext.prompts: no shared text, no 6 words in a row in common), balanced over
the held-out set's four categories:
- chat: everyday questions and requests from hand-written frames over hand-written topics, and
  Magpie prompts (user turns the target wrote itself after its chat template's user header,
  magpie.jsonl, kept from the first data set);
- math: arithmetic word problems from many templates (rates, percentages, areas, ages, averages,
  fractions, equations, probability, unit conversions) with random numbers, names and objects;
- coding: requests for Python functions (hand-written tasks, and the standard library's documented
  functions), explanations of Python concepts;
- summarization: requests (many phrasings) to summarize general-knowledge passages the target
  wrote itself on hand-written topics (the "passage" prompts, whose answers are training data too).
Answers (answers.npz: every answer's conversation as uint16 token ids laid end to end, with each
record's prompt id, prompt length and mode) are written whole batch by batch; a rerun skips what
is there, so the run can stop (--limit-seconds, or a kill) and resume, across sessions too. The
prompts are answered in a fixed interleaved order (passages first, then the categories in turn),
so a partial data set is balanced.

--heldout writes heldout_answers.npz: the target's answers (greedy and sampled, 128 new tokens)
to the held-out prompts, record 2 i + 1 (sampled) and 2 i (greedy) for prompt i of heldout.jsonl:
what the trainer's held-out teacher-forced accuracy reads (never training data).
"""

import argparse
import ast
import gzip
import itertools
import json
import random
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch

from qspec_ext import generate_plain, load_target
from qspec_ext.prompts import HeldoutFilter, heldout_prompts, words
from qspec_ext.shipped import target_dir
from qspec_ext.text import chat_ids, load_tokenizer, stop_ids

REPO = Path(__file__).resolve().parents[1]
SAMPLING = dict(temperature=0.6, top_p=0.95, top_k=20)
PASSAGE_TOKENS = 160  # a passage to summarize: at most this long
LONG_PROMPT = 512  # prompts past this many tokens go in smaller batches

TOPICS = """the water cycle; volcanoes; earthquakes; the solar system; the moon; black holes; comets;
the northern lights; rainbows; thunderstorms; hurricanes; glaciers; deserts; rainforests; coral reefs;
the deep ocean; rivers; mountains; caves; soil; fossils; dinosaurs; evolution; DNA; cells; the immune
system; the human heart; the brain; muscles; bones; digestion; vitamins; vaccines; antibiotics; bacteria;
viruses; sleep; dreams; memory; habits; stress; exercise; yoga; meditation; nutrition; coffee; tea;
chocolate; bread; cheese; rice; spices; honey; bees; ants; butterflies; spiders; sharks; whales;
dolphins; penguins; owls; eagles; wolves; elephants; lions; tigers; pandas; camels; horses; dogs; cats;
octopuses; frogs; snakes; trees; flowers; mushrooms; cactus plants; bamboo; seeds; farming; irrigation;
fishing; forests; wildfires; pollution; climate change; renewable energy; solar panels; wind turbines;
nuclear power; batteries; electric cars; bicycles; trains; airplanes; ships; bridges; skyscrapers;
roads; cities; villages; castles; pyramids; the Roman Empire; ancient Greece; ancient Egypt; the Silk
Road; the Vikings; the Middle Ages; the Renaissance; the Industrial Revolution; the printing of books;
the telephone; radio; television; the internet; computers; smartphones; robots; artificial
intelligence; satellites; space travel; telescopes; microscopes; electricity; magnets; light; sound;
gravity; friction; atoms; chemical reactions; water; salt; gold; iron; glass; plastic; paper;
recycling; money; banks; taxes; markets; trade; advertising; small businesses; teamwork; leadership;
public libraries; schools; universities; museums; music; jazz; classical music; painting; sculpture;
photography; film; theater; dance; poetry; novels; fairy tales; languages; writing systems;
mathematics; numbers; maps; calendars; clocks; the Olympic Games; football; chess; board games;
video games; gardening; cooking; baking; camping; hiking; swimming; running; cycling; volunteering;
friendship; family traditions; holidays; festivals; weddings; birthdays; pets; zoos; national parks;
islands; lakes; the Arctic; Antarctica; the Amazon river; the Sahara; the Himalayas; the Alps;
Australia; Japan; India; Brazil; Canada; Kenya; Mexico; Norway; Egypt""".replace("\n", " ").split("; ")

PASSAGE_ASKS = ["Write a short informative paragraph about {t}.", "Describe {t} in a paragraph.",
                "Write a paragraph explaining {t} to a general reader.", "Tell me about {t} in one paragraph.",
                "Write a brief encyclopedia-style paragraph on {t}.", "Write a short news report about {t}."]

SUMMARY_ASKS = ["Summarize this passage in one sentence:", "Sum up the text below in a single sentence:",
                "Please summarize the following paragraph.", "Give me a brief summary of the text below.",
                "Summarize the text below in three bullet points.", "What is this paragraph about? Be brief.",
                "Write a one-sentence summary of this:", "Condense this paragraph into two short sentences:",
                "Summarize this for a ten-year-old:", "Give a headline for this paragraph:",
                "What are the main points here?", "TL;DR this paragraph:", "Shorten this text to its key idea:",
                "Explain the gist of this passage briefly:", "Summarize the paragraph below in under 25 words:",
                "Read this and summarize it:"]

CHAT_FRAMES = ["What are some tips for {a}?", "How do I get better at {a}?", "Can you give me advice on {a}?",
               "What are the most common mistakes people make when {a}?", "How should a beginner start {a}?",
               "What do I need to know before {a}?", "Give me a simple plan for {a} this week.",
               "Why is {a} good for you?", "What are the pros and cons of {a}?", "How much time should I spend {a}?"]
ACTIVITIES = """learning to cook; saving money; running a marathon; planting tomatoes; learning the guitar;
writing a resume; studying for exams; speaking in public; traveling on a budget; learning to swim;
training a puppy; cleaning the house; decorating a small apartment; starting a blog; meal planning;
reading more books; waking up early; learning to draw; taking better photos; making new friends;
organizing a closet; preparing for a job interview; negotiating a salary; learning to code; riding a bike
in the city; keeping houseplants alive; baking bread; brewing coffee at home; hosting a dinner party;
planning a wedding; moving to a new city; working night shifts; managing a team; learning to meditate;
journaling; budgeting for a family; buying a used car; renting an apartment; caring for an elderly
parent; teaching kids to read; playing chess; writing short stories; learning to knit; camping alone;
hiking in winter; drinking less sugar; cutting down screen time; staying motivated at the gym""".replace(
    "\n", " ").split("; ")
CHAT_QUESTIONS = ["Tell me a fun fact about {t}.", "Can you explain {t} in simple words?",
                  "Why should people care about {t}?", "Write a short poem about {t}.",
                  "What is the most surprising thing about {t}?", "Give me three facts about {t}.",
                  "Write a haiku about {t}.", "How would you explain {t} to a child?",
                  "Tell me a short story that involves {t}.", "What questions do scientists still ask about {t}?"]
CHAT_MISC = """Suggest a name for my new cat; Plan a relaxing Sunday for me; What should I cook with
chicken, rice and broccoli; Help me write a thank-you note to my teacher; Give me ideas for a
first date; What games can I play with friends at a party; Write a birthday message for my
brother; How can I cheer up a friend who is sad; Recommend a hobby I can do at home; Write a
short motivational message for Monday morning; What can I do when I feel bored; Help me write an
email asking for a day off; Suggest a weekly workout schedule; What are good snacks for a road
trip; How do I apologize to a coworker; Give me ideas for a school science project; What should
I write in a get-well card; How can I make my mornings less stressful; Suggest some indoor
activities for kids; Write a short speech for a friend's farewell party""".replace("\n", " ").split("; ")

CODING_TASKS = """reverses a string; checks whether a number is prime; returns the factorial of n;
removes duplicates from a list while keeping the order; counts the vowels in a string; flattens a
nested list; finds the largest element of a list without using max; converts Celsius to
Fahrenheit; checks whether two strings are anagrams; returns the greatest common divisor of two
numbers; sorts a list of dictionaries by a key; reads a text file and counts its lines; computes
the sum of the digits of an integer; finds the most common element in a list; capitalizes the
first letter of every word; returns all even numbers from a list; converts a decimal number to
binary; checks whether a year is a leap year; merges two dictionaries; computes the average of a
list of numbers; finds the index of an item with binary search; generates the first n prime
numbers; transposes a matrix given as a list of lists; validates an email address with a regular
expression; splits a list into chunks of size n; returns the intersection of two lists; computes
compound interest; checks whether parentheses in a string are balanced; rotates a list by k
positions; counts words in a text file; implements bubble sort; implements a stack class with
push and pop; implements a queue with two stacks; returns the n-th triangular number; computes the
power set of a list; finds the longest word in a sentence; converts a Roman numeral to an integer;
converts an integer to a Roman numeral; checks whether a list is sorted; removes all whitespace
from a string; computes the median of a list; returns the unique characters of a string; zips two
lists into a dictionary; computes the area of a circle; simulates rolling two dice; shuffles a
list; finds all pairs in a list that sum to a target; returns a list of squares from 1 to n;
counts the frequency of each character; computes the Levenshtein distance of two strings;
implements a simple linked list; parses a CSV line into fields; returns the current date as a
string; measures how long another function takes; caches the results of a slow function;
retries a function call three times on failure""".replace("\n", " ").split("; ")
CODING_FRAMES = ["Write a Python function that {t}.", "In Python, how would I write code that {t}?",
                 "Show me a short Python program that {t}.", "Write a Python function that {t}, with a docstring.",
                 "Write a Python function that {t} and explain how it works."]
CONCEPTS = """list comprehensions; dictionaries; tuples; sets; generators; decorators; lambda functions;
classes and objects; inheritance; exceptions; the with statement; f-strings; slicing; recursion;
global and local variables; modules and imports; virtual environments; type hints; the map function;
the zip function; the enumerate function; iterators; default arguments; *args and **kwargs;
string methods; file handling; unit tests; the main guard; mutable and immutable types;
shallow and deep copies""".replace("\n", " ").split("; ")
CONCEPT_FRAMES = ["Explain {t} in Python with an example.", "What are {t} in Python and when should I use them?",
                  "Give a beginner-friendly explanation of {t} in Python.", "Show an example of {t} in Python."]

NAMES = ["Anna", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kofi", "Lena",
         "Maya", "Nina", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tariq", "Uma", "Victor", "Wen", "Yusuf", "Zoe"]
ITEMS = ["pens", "books", "apples", "oranges", "stickers", "cookies", "marbles", "cards", "shells", "stamps",
         "candies", "eggs", "balloons", "bottles", "toy cars", "cupcakes", "pencils", "flowers"]
MATH_TEMPLATES = [
    "{n} has {a} {x}. {n} buys {b} more and gives {c} to a friend. How many {x} does {n} have now?",
    "A pack holds {a} {x}. How many {x} are in {b} packs?",
    "{n} shares {p} {x} equally among {a} friends. How many does each friend get, and how many are left over?",
    "A store sells {x} at {a} for {c} dollars. How much do {b} {x} cost?",
    "What is {a} percent of {p}?", "Increase {p} by {a} percent. What is the result?",
    "A jacket costs {p} dollars and is discounted by {a} percent. What is the new price?",
    "A field is {a} meters long and {b} meters wide. What is its perimeter?",
    "A square has a side of {a} cm. What are its area and perimeter?",
    "A triangle has a base of {a} cm and a height of {b} cm. What is its area?",
    "A cyclist rides {p} kilometers in {c} hours. What is the average speed?",
    "A plane flies at {p} km per hour. How far does it go in {a} hours?",
    "How long does it take to drive {p} km at {a} km per hour?",
    "{n} is {a} years old. {n}'s father is {b} years older. How old will the father be in {c} years?",
    "The ages of two sisters add up to {p}. One is {c} years older than the other. How old are they?",
    "Find the mean of {a}, {b}, {c} and {d}.", "What is the median of {a}, {b}, {c}, {d} and {e}?",
    "Simplify the fraction {a}/{m}.", "What is {a}/{b} plus {c}/{b}?", "Convert {a}/{b} to a decimal.",
    "Solve the equation {a}x + {b} = {p}.", "Solve for y: {a}y - {c} = {b}y + {d}.",
    "What is {a} times {b} minus {c}?", "Compute {p} divided by {a}, rounded to two decimals.",
    "A jar has {a} green, {b} yellow and {c} white beads. What is the chance of drawing a yellow bead?",
    "Two dice are rolled. What is the probability that the total is {f}?",
    "How many seconds are in {a} minutes?", "Convert {p} grams to kilograms.", "How many hours are in {a} days?",
    "Convert {a} kilometers to meters.", "A movie starts at {g}:15 and lasts {p} minutes. When does it end?",
    "{n} saves {a} dollars every week. How many weeks until {n} has {p} dollars?",
    "A tank holds {p} liters and drains {a} liters per minute. How long until it is empty?",
    "If {a} machines make {p} parts in {c} hours, how many parts do {b} machines make in the same time?",
    "A class has {p} students and {a} percent of them walk to school. How many walk?",
    "Is {q} divisible by {h}? Explain.", "What is the least common multiple of {a} and {b}?",
    "What is the greatest common divisor of {p} and {a}?", "What is {a} squared plus {b} squared?",
    "A rope {p} cm long is cut into pieces of {a} cm. How many whole pieces are there?",
    "{n} scored {a}, {b} and {c} points in three games. What score is needed in the fourth game for an average of {d}?",
    "A recipe uses {a} eggs for {b} people. How many eggs for {p} people?",
    "The price of a ticket rose from {b} to {p} dollars. What was the percentage increase?",
    "A rectangle's length is {a} times its width, and its perimeter is {p} m. Find its dimensions.",
    "Write {p} as a product of prime factors.", "What is the next number in the sequence {a}, {s1}, {s2}, {s3}?",
]

WORDS = lambda text: len(text.split())  # noqa: E731


def stdlib_function_prompts(rng: random.Random) -> list[str]:
    found = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        if path.name.startswith(("_", "test")):
            continue
        try:
            tree = ast.parse(path.read_text(errors="replace"))
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                doc = (ast.get_docstring(node) or "").strip().split("\n\n")[0].replace("\n", " ")
                if 20 <= len(doc) <= 200:
                    found.append(f"Write a Python function {node.name}({', '.join(a.arg for a in node.args.args)}). {doc}")
    rng.shuffle(found)
    return found


def math_prompt(rng: random.Random) -> str:
    a, b, c, d, e = (rng.randint(2, 40) for _ in range(5))
    step = rng.randint(2, 9)
    return rng.choice(MATH_TEMPLATES).format(
        a=a, b=b, c=c, d=d, e=e, p=rng.randint(50, 900), q=rng.randint(100, 999), h=rng.choice([3, 4, 6, 7, 9, 11]),
        m=a * rng.randint(2, 6), f=rng.randint(2, 12), g=rng.randint(1, 11), n=rng.choice(NAMES), x=rng.choice(ITEMS),
        s1=a + step, s2=a + 2 * step, s3=a + 3 * step)


def category_prompts(rng: random.Random, magpie: list[str], count: int) -> dict[str, list[str]]:
    chat = [f.format(a=a) for f, a in itertools.product(CHAT_FRAMES, ACTIVITIES)]
    chat += [f.format(t=t) for f, t in itertools.product(CHAT_QUESTIONS, TOPICS)]
    chat += [m + ("." if m.startswith(("Suggest", "Plan", "Help", "Give", "Write", "Recommend")) else "?")
             for m in CHAT_MISC]
    chat = magpie[: count // 3] + chat  # a third Magpie: the target's own idea of a user
    rng.shuffle(chat)
    coding = [f.format(t=t) for f, t in itertools.product(CODING_FRAMES, CODING_TASKS)]
    coding += [f.format(t=t) for f, t in itertools.product(CONCEPT_FRAMES, CONCEPTS)]
    rng.shuffle(coding)
    stdlib = stdlib_function_prompts(rng)
    coding = [p for pair in zip(coding, stdlib) for p in pair] + stdlib[len(coding):]
    math = [math_prompt(rng) for _ in range(3 * count)]
    return {"chat": chat, "coding": coding, "math": math}


def passage_prompts(rng: random.Random) -> list[str]:
    prompts = [f.format(t=t) for f, t in itertools.product(PASSAGE_ASKS, TOPICS)]
    rng.shuffle(prompts)
    return prompts


def usable_passage(text: str) -> str | None:
    """The passage cut at its last full sentence, if 40-150 words of prose remain, not repeating
    its sentences."""
    text = " ".join(text.split())
    end = max(text.rfind(". "), text.rfind(".") if text.endswith(".") else -1)
    text = text[: end + 1] if end > 0 else ""
    sentences = [x.strip() for x in text.split(". ") if x.strip()]
    repetitive = len(set(sentences)) < 0.8 * len(sentences)  # a small model's loops
    return text if 40 <= WORDS(text) <= 150 and "#" not in text and "```" not in text and not repetitive else None


class Answers:
    """answers.npz: ``ids`` uint16 (every record's conversation, laid end to end), ``starts`` int64
    [R + 1], ``prompt_id`` int32, ``prompt_length`` int32, ``sampled`` bool, one per record."""

    def __init__(self, path: Path):
        self.path = path
        self.records: list[tuple[int, int, bool, np.ndarray]] = []
        if path.is_file():
            z = dict(np.load(path))  # each field decompressed once
            ids, starts = z["ids"], z["starts"]
            for i, (pid, plen, sampled) in enumerate(zip(z["prompt_id"], z["prompt_length"], z["sampled"])):
                self.records.append((int(pid), int(plen), bool(sampled), ids[starts[i] : starts[i + 1]]))
        self.done = {r[0] for r in self.records}

    def add(self, rows: list[tuple[int, int, bool, list[int]]]) -> None:
        for pid, plen, sampled, ids in rows:
            self.records.append((pid, plen, sampled, np.asarray(ids, dtype=np.uint16)))
            self.done.add(pid)
        ids = [r[3] for r in self.records]
        starts = np.concatenate([[0], np.cumsum([len(i) for i in ids])]).astype(np.int64)
        partial = self.path.with_name(self.path.stem + ".tmp.npz")
        np.savez_compressed(partial, ids=np.concatenate(ids), starts=starts,
                            prompt_id=np.array([r[0] for r in self.records], dtype=np.int32),
                            prompt_length=np.array([r[1] for r in self.records], dtype=np.int32),
                            sampled=np.array([r[2] for r in self.records], dtype=bool))
        partial.replace(self.path)  # a kill mid-write leaves the previous file

    def answer_text(self, tokenizer, pid: int) -> str:
        for p, plen, _, ids in self.records:
            if p == pid:
                return tokenizer.decode(ids[plen:].tolist(), skip_special_tokens=True)
        raise KeyError(pid)


def kept(prompts, heldout: HeldoutFilter, seen: set) -> list[str]:
    out = []
    for p in prompts:
        key = " ".join(words(p))
        if key not in seen and not heldout.overlaps(p):
            seen.add(key)
            out.append(p)
    return out


def answer(target, directory, answers: Answers, rows: list[dict], batch: int, max_new_tokens: int, seed: int,
           deadline: float | None, label: str, repetition_penalty: float = 1.0) -> bool:
    """Answers the rows not yet answered, ``batch`` at a time (similar lengths together), sampled
    where the row says so (else: an odd id sampled, an even one greedy, the rule of the rows written
    before the field). A row's conversation is its ``messages`` where it has them, else one user
    turn holding its ``prompt``. False when the deadline came first."""
    stops = stop_ids(directory)
    todo = [r for r in rows if r["id"] not in answers.done]
    for sampled in (False, True):
        mine = [r for r in todo if r.get("sampled", r["id"] % 2 == 1) == sampled]
        mine.sort(key=lambda r: (len(json.dumps(r.get("messages", r.get("prompt")))), r["id"]))
        conversations = [chat_ids(directory, r.get("messages") or [{"role": "user", "content": r["prompt"]}])
                         for r in mine]
        i = 0
        while i < len(mine):
            if deadline is not None and time.time() > deadline:
                return False
            # At most `batch` rows, and fewer where prompts are long: the prefill's attention scores
            # grow with rows x length^2.
            longest = max(map(len, conversations[i : i + batch]))
            size = min(batch, max(1, batch * LONG_PROMPT**2 // longest**2))
            chunk, ids = mine[i : i + size], conversations[i : i + size]
            i += size
            result = generate_plain(target, ids, max_new_tokens, eos_token_id=stops, seed=seed + chunk[0]["id"],
                                    repetition_penalty=repetition_penalty, **(SAMPLING if sampled else {}))
            answers.add([(r["id"], len(p), sampled, p + a) for r, p, a in zip(chunk, ids, result.tokens)])
            print(f"{label}: {len(answers.done)} records, {sum(len(r[3]) - r[1] for r in answers.records)} answer "
                  f"tokens ({result.stats.tokens_per_second:.0f} tokens/s)", file=sys.stderr, flush=True)
    return True

FOLLOW_UPS = ["Can you give me an example?", "Can you explain that more simply?", "Thanks! Can you make it shorter?",
              "What else should I know about this?", "Can you put that in a list?", "Why is that?",
              "Could you go into more detail on the first point?", "Is there another way to do it?",
              "Can you summarize your answer in one sentence?", "What would you recommend for a beginner?"]
LONG_ASKS = ["Summarize the following documentation.", "Summarize this text in a few sentences:",
             "What does this text describe? Give a short summary.", "Write a brief summary of the text below.",
             "Explain the main points of this documentation in plain words:", "Give me the key points of this text:"]
PENALTY = 1.1  # what `qspec demo` and `qspec chat` decode with


def long_texts(limit_words: int = 600) -> list[str]:
    """Prose the target did not write: the standard library's module docstrings of 120 words and more
    (cut at a paragraph end near ``limit_words``), without code examples."""
    found = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "test" in path.parts or path.name.startswith("test"):
            continue
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(errors="replace"))) or ""
        except (SyntaxError, ValueError):
            continue
        paragraphs = [" ".join(x.split()) for x in doc.split("\n\n") if x.strip() and ">>>" not in x]
        text, count = [], 0
        for paragraph in paragraphs:
            if count + WORDS(paragraph) > limit_words:
                break
            text.append(paragraph)
            count += WORDS(paragraph)
        if count >= 120:
            found.append("\n\n".join(text))
    return found


def penalized_rows(out: Path, tokenizer, rng: random.Random, heldout: HeldoutFilter) -> list[dict]:
    """The third data set's prompts (answered with repetition penalty 1.1, half greedy, half at the
    card's sampling), interleaved so a partial set stays balanced: the second set's prompts again
    (the other mode than their first answer), follow-up turns of its chat answers (the chat
    template's history), and summaries of long prose the target did not write."""
    base = [json.loads(line) for line in (out / "prompts.jsonl").read_text().splitlines()]
    first = Answers(out / "answers.npz")
    single = [dict(category=r["category"], prompt=r["prompt"], sampled=not r.get("sampled", r["id"] % 2 == 1))
              for r in base if r["category"] != "passage"]
    rng.shuffle(single)
    follow = []
    for r in (r for r in base if r["category"] == "chat" and r["id"] in first.done):
        reply = first.answer_text(tokenizer, r["id"]).strip()
        if reply:
            ask = rng.choice(FOLLOW_UPS)
            follow.append(dict(category="chat-multiturn", prompt=ask, sampled=rng.random() < 0.5,
                               messages=[{"role": "user", "content": r["prompt"]},
                                         {"role": "assistant", "content": reply}, {"role": "user", "content": ask}]))
    rng.shuffle(follow)
    texts = [t for t in long_texts() if not heldout.overlaps(t)]
    rng.shuffle(texts)
    summaries = [dict(category="summarization-long", prompt=f"{rng.choice(LONG_ASKS)}\n\n{t}", sampled=i % 2 == 1)
                 for i, t in enumerate(texts)]
    rows, pools = [], [single, follow, summaries]
    for i in range(max(map(len, pools))):
        for pool in pools:
            if i < len(pool) and not heldout.overlaps(pool[i]["prompt"]):
                rows.append(dict(id=len(rows), **pool[i]))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / "data" / "smollm2"))
    parser.add_argument("--per-category", type=int, default=1500, help="prompts per held-out category")
    parser.add_argument("--passages", type=int, default=900, help="passages the target writes (for summarization)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit-seconds", type=float, default=None, help="stop (resumable) after this long")
    parser.add_argument("--heldout", action="store_true", help="the held-out prompts' answers, for evaluation")
    parser.add_argument("--penalized", action="store_true",
                        help="the third set: answers at repetition penalty 1.1 (prompts-penalty.jsonl.gz, "
                             "answers-penalty.npz)")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="the target's dtype while answering")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = None if args.limit_seconds is None else time.time() + args.limit_seconds
    directory = target_dir("smollm2")
    tokenizer = load_tokenizer(directory)
    target = load_target("smollm2", dtype=torch.float32 if args.dtype == "fp32" else torch.bfloat16)
    if args.penalized:
        return answer_penalized(args, out, target, directory, tokenizer, deadline)
    if args.heldout:
        rows = [{"id": 2 * i + sampled, "prompt": r["prompt"]} for i, r in enumerate(heldout_prompts()) for sampled in (0, 1)]
        answer(target, directory, Answers(out / "heldout_answers.npz"), rows, args.batch, 128, args.seed, None, "heldout")
        return
    answers = Answers(out / "answers.npz")
    rng = random.Random(args.seed)
    heldout, seen = HeldoutFilter(), set()
    prompts_path = out / "prompts.jsonl"
    rows = [json.loads(line) for line in prompts_path.read_text().splitlines()] if prompts_path.is_file() else []
    if not rows:  # passages first: the summarization prompts are made of their answers
        rows = [{"id": i, "category": "passage", "prompt": p, "sampled": i % 2 == 1}
                for i, p in enumerate(kept(passage_prompts(rng), heldout, seen)[: args.passages])]
        prompts_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    passages = [r for r in rows if r["category"] == "passage"]
    if not answer(target, directory, answers, passages, args.batch, PASSAGE_TOKENS, args.seed, deadline, "passages"):
        return print("time limit reached: rerun to resume", file=sys.stderr)
    if len(rows) == len(passages):
        magpie_path = out / "magpie.jsonl"
        magpie = [json.loads(line)["prompt"] for line in magpie_path.read_text().splitlines()] if magpie_path.is_file() else []
        seen.update(" ".join(words(r["prompt"])) for r in rows)
        pools = {c: kept(p, heldout, seen) for c, p in category_prompts(rng, magpie, args.per_category).items()}
        texts = [t for t in (usable_passage(answers.answer_text(tokenizer, r["id"])) for r in passages) if t]
        asks = itertools.cycle(rng.sample(SUMMARY_ASKS, len(SUMMARY_ASKS)))
        count = max(args.per_category, len(texts))
        summaries = [f"{next(asks)}\n\n{text}" for text in itertools.islice(itertools.cycle(texts), count)]
        pools["summarization"] = kept(summaries, heldout, seen)
        order = ("coding", "math", "summarization", "chat")
        for i in range(args.per_category):  # interleaved: a partial data set stays balanced
            for category in order:
                if i < len(pools[category]):  # each category's answers half greedy, half sampled
                    rows.append({"id": len(rows), "category": category, "prompt": pools[category][i],
                                 "sampled": i % 2 == 1})
        prompts_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rest = [r for r in rows if r["category"] != "passage"]
    step = 4 * args.batch  # answered a slice at a time, in the interleaved order
    for i in range(0, len(rest), step):
        if not answer(target, directory, answers, rest[i : i + step], args.batch, args.max_new_tokens, args.seed,
                      deadline, "answers"):
            return print("time limit reached: rerun to resume", file=sys.stderr)
    print(f"done: {len(answers.records)} records", file=sys.stderr)


def answer_penalized(args, out: Path, target, directory, tokenizer, deadline: float | None) -> None:
    prompts_path = out / "prompts-penalty.jsonl.gz"  # compressed: the follow-ups carry whole conversations
    if prompts_path.is_file():
        rows = [json.loads(line) for line in gzip.decompress(prompts_path.read_bytes()).decode().splitlines()]
    else:
        rows = penalized_rows(out, tokenizer, random.Random(args.seed + 1), HeldoutFilter())
        prompts_path.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode(), mtime=0))
    answers = Answers(out / "answers-penalty.npz")
    step = 4 * args.batch
    for i in range(0, len(rows), step):
        if not answer(target, directory, answers, rows[i : i + step], args.batch, args.max_new_tokens, args.seed,
                      deadline, "penalized", repetition_penalty=PENALTY):
            return print("time limit reached: rerun to resume", file=sys.stderr)
    print(f"done: {len(answers.records)} records", file=sys.stderr)


if __name__ == "__main__":
    main()
