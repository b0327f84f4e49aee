"""Generate the small demo chat dataset embedded in ``dspark_precompute``.

This script writes ``dspark_precompute/assets/embedded_chat.jsonl``: 60 short
conversations in OpenAI ``messages`` form (one JSON object per line), used as
the project's built-in demo / smoke-test data. It covers single-turn and
multi-turn chats, system prompts, assistant ``reasoning_content``, tool use
(``tools`` + ``tool_calls`` + ``tool`` replies) and non-ASCII text, with reply
lengths spread from one sentence to a few thousand characters.

All text is original and assembled from the small hand-written building blocks
below; every number that appears in an answer is computed here, so the worked
arithmetic is correct. The output is deterministic: running the script twice
produces a byte-for-byte identical file.

Usage (from the repository root)::

    python scripts/make_embedded_data.py

Only the standard library is used.
"""

from __future__ import annotations

import json
import math
from fractions import Fraction
from pathlib import Path

OUTPUT_PATH = (
    Path(__file__).resolve().parents[1]
    / "dspark_precompute"
    / "assets"
    / "embedded_chat.jsonl"
)


# ---------------------------------------------------------------------------
# Message helpers
# ---------------------------------------------------------------------------


def system(content: str) -> dict:
    return {"role": "system", "content": content}


def user(content: str) -> dict:
    return {"role": "user", "content": content}


def assistant(content: str, reasoning: str | None = None, tool_calls: list | None = None) -> dict:
    msg: dict = {"role": "assistant", "content": content}
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    if tool_calls is not None:
        msg["tool_calls"] = tool_calls
    return msg


def tool_call(call_id: int, name: str, arguments: dict) -> dict:
    return {
        "id": f"call_{call_id}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def tool_result(call_id: int, result: dict) -> dict:
    return {
        "role": "tool",
        "tool_call_id": f"call_{call_id}",
        "content": json.dumps(result, ensure_ascii=False),
    }


def row(messages: list, tools: list | None = None) -> dict:
    out: dict = {"messages": messages}
    if tools is not None:
        out["tools"] = tools
    return out


def fmt_num(x: float, places: int = 2) -> str:
    """Format a number with thousands separators, dropping a trailing '.0'."""
    if float(x).is_integer():
        return f"{int(x):,}"
    return f"{x:,.{places}f}".rstrip("0").rstrip(".")


def fmt_frac(f: Fraction) -> str:
    """Render a fraction as a mixed number, e.g. 19/12 -> '1 7/12'."""
    if f.denominator == 1:
        return str(f.numerator)
    whole, rest = divmod(f.numerator, f.denominator)
    if whole == 0:
        return f"{rest}/{f.denominator}"
    return f"{whole} {rest}/{f.denominator}"


def paragraphs(*parts: str) -> str:
    return "\n\n".join(parts)


# ---------------------------------------------------------------------------
# 1. Single-turn rows (20): arithmetic, unit conversion, concepts, code
# ---------------------------------------------------------------------------


def arithmetic_multiplication(a: int, b: int) -> dict:
    tens, ones = b // 10 * 10, b % 10
    p1, p2 = a * tens, a * ones
    answer = paragraphs(
        f"Split {b} into {tens} + {ones} and multiply each part by {a}:",
        f"- {a} × {tens} = {p1:,}\n- {a} × {ones} = {p2:,}",
        f"Add the partial products: {p1:,} + {p2:,} = {a * b:,}.",
        f"So {a} × {b} = **{a * b:,}**.",
    )
    return row([user(f"What is {a} × {b}? Please show the steps."), assistant(answer)])


def arithmetic_long_division(n: int, d: int) -> dict:
    q, r = divmod(n, d)
    steps = []
    cur = 0
    started = False
    for ch in str(n):
        cur = cur * 10 + int(ch)
        if not started and cur < d:
            continue
        started = True
        digit = cur // d
        rem = cur - digit * d
        steps.append(f"- {cur} ÷ {d} = {digit} (since {d} × {digit} = {d * digit}), remainder {rem}")
        cur = rem
    tail = f"The remainder is {r}." if r else "There is no remainder."
    answer = paragraphs(
        f"Let's do {n:,} ÷ {d} by long division, one digit at a time:",
        "\n".join(steps),
        f"Reading the quotient digits top to bottom gives **{q}**. {tail}",
        f"Check: {d} × {q} + {r} = {d * q + r:,}.",
    )
    return row([user(f"Can you work out {n} divided by {d} using long division?"), assistant(answer)])


def arithmetic_discount(price: int, pct: int) -> dict:
    off = Fraction(price * pct, 100)
    final = price - off
    answer = (
        f"{pct}% of ${price} is {price} × {pct}/100 = ${fmt_num(float(off))}. "
        f"Subtracting that from the original price gives ${price} − ${fmt_num(float(off))} = "
        f"**${fmt_num(float(final))}**."
    )
    return row([
        user(f"A jacket costs ${price} and is on sale for {pct}% off. What is the sale price?"),
        assistant(answer),
    ])


def arithmetic_fractions(a: Fraction, b: Fraction) -> dict:
    lcd = math.lcm(a.denominator, b.denominator)
    na = a.numerator * (lcd // a.denominator)
    nb = b.numerator * (lcd // b.denominator)
    total = a + b
    answer = paragraphs(
        f"The denominators are {a.denominator} and {b.denominator}, and their least common "
        f"denominator is {lcd}.",
        f"Rewrite both fractions over {lcd}: {a} = {na}/{lcd} and {b} = {nb}/{lcd}.",
        f"Now add the numerators: {na}/{lcd} + {nb}/{lcd} = {na + nb}/{lcd}"
        + (f", which simplifies to {total}." if Fraction(na + nb, lcd).denominator != lcd else "."),
        f"As a mixed number that is **{fmt_frac(total)}**.",
    )
    return row([user(f"How do I add {a} and {b}?"), assistant(answer)])


def arithmetic_order_of_operations() -> dict:
    inner = 5 - 2
    square = inner**2
    product = 6 * square
    quotient = product // 3
    total = 8 + quotient
    assert total == 8 + 6 * (5 - 2) ** 2 / 3
    answer = paragraphs(
        "Follow the order of operations: parentheses, exponents, then multiplication and "
        "division from left to right, then addition.",
        f"1. Parentheses: 5 − 2 = {inner}\n"
        f"2. Exponent: {inner}² = {square}\n"
        f"3. Multiplication: 6 × {square} = {product}\n"
        f"4. Division: {product} ÷ 3 = {quotient}\n"
        f"5. Addition: 8 + {quotient} = {total}",
        f"The expression equals **{total}**.",
    )
    return row([user("Evaluate 8 + 6 × (5 − 2)² ÷ 3."), assistant(answer)])


def arithmetic_mean(scores: list[int]) -> dict:
    total = sum(scores)
    mean = total / len(scores)
    answer = (
        f"Add the scores: {' + '.join(map(str, scores))} = {total}. "
        f"There are {len(scores)} scores, so the mean is {total} ÷ {len(scores)} = **{fmt_num(mean)}**."
    )
    listing = ", ".join(map(str, scores))
    return row([user(f"My quiz scores were {listing}. What's my average?"), assistant(answer)])


def conversion_km_to_miles(km: float) -> dict:
    miles = km / 1.609344
    answer = (
        f"One mile is exactly 1.609344 km, so {km} km ÷ 1.609344 ≈ **{miles:.2f} miles**. "
        "That is the length of a standard marathon."
    )
    return row([user(f"How many miles is {km} km?"), assistant(answer)])


def conversion_f_to_c(f: int) -> dict:
    c = (f - 32) * 5 / 9
    answer = (
        f"Use °C = (°F − 32) × 5/9. Here ({f} − 32) × 5/9 = {f - 32} × 5/9 ≈ **{c:.1f} °C**. "
        f"Many European recipes round this to {round(c / 10) * 10} °C."
    )
    return row([user(f"My recipe says to bake at {f}°F. What is that in Celsius?"), assistant(answer)])


def conversion_kg_to_lb(kg: int) -> dict:
    lb = kg * 2.20462262
    answer = f"Multiply by 2.20462: {kg} kg × 2.20462 ≈ **{lb:.1f} lb**."
    return row([user(f"Convert {kg} kg to pounds."), assistant(answer)])


def conversion_litres_to_gallons(litres: float) -> dict:
    gal = litres / 3.785411784
    imp = litres / 4.54609
    answer = (
        f"A US gallon is 3.785 L, so {litres} L ≈ **{gal:.2f} US gallons**. "
        f"If you mean imperial gallons (4.546 L), it is about {imp:.2f} gallons."
    )
    return row([user(f"How many gallons are in {litres} liters?"), assistant(answer)])


def conversion_seconds(total: int) -> dict:
    h, rem = divmod(total, 3600)
    m, s = divmod(rem, 60)
    answer = (
        f"There are 3,600 seconds in an hour: {total:,} ÷ 3,600 = {h} with {rem:,} seconds left over. "
        f"Then {rem:,} ÷ 60 = {m} minutes and {s} seconds. "
        f"So {total:,} seconds is **{h} h {m} min {s} s**."
    )
    return row([user(f"How long is {total:,} seconds in hours, minutes and seconds?"), assistant(answer)])


BIG_O_LONG = paragraphs(
    "Big-O notation describes how the cost of an algorithm, usually its running time and "
    "sometimes its memory use, grows as the size of its input grows. If n is the input size, "
    "saying an algorithm is O(f(n)) means that for large enough n its cost is at most some "
    "constant multiple of f(n). It deliberately ignores constant factors and small terms, "
    "because those depend on the machine and the language, and focuses on the shape of the growth.",
    "**Common classes, from fastest to slowest growing:**",
    "- **O(1), constant:** the cost doesn't depend on n. Reading `items[5]` from a Python list "
    "or looking up a key in a dict (on average) are examples.\n"
    "- **O(log n), logarithmic:** each step cuts the problem down by a constant fraction. Binary "
    "search on a sorted list of a million elements needs only about 20 comparisons.\n"
    "- **O(n), linear:** you touch each element a constant number of times, as in summing a "
    "list or finding its maximum.\n"
    "- **O(n log n):** typical of efficient comparison sorts such as merge sort and Timsort.\n"
    "- **O(n²), quadratic:** usually a loop inside a loop over the same data, like comparing "
    "every pair of elements or running bubble sort.\n"
    "- **O(2ⁿ), exponential:** the cost doubles with each extra element, as in checking every "
    "subset of a set. These become impractical very quickly.",
    "**Why constants are dropped.** An algorithm that does 3n + 20 steps and one that does "
    "n/2 steps are both O(n): if you double the input, both roughly double their work. An O(n²) "
    "algorithm, by contrast, does four times the work when n doubles. For small inputs the "
    "constants can matter more than the class, but as n grows, the class always wins.",
    "**A worked comparison.** Suppose one step takes a microsecond and n = 100,000. An O(n) "
    "algorithm takes about 0.1 seconds. An O(n log n) algorithm takes roughly 1.7 seconds. An "
    "O(n²) algorithm needs 10 billion steps, which is nearly three hours. That gap is why "
    "choosing the right algorithm often matters more than micro-optimising code.",
    "**Best, average and worst case.** Big-O is most often quoted for the worst case, but it's "
    "worth knowing which case someone means. Quicksort is O(n log n) on average but O(n²) in "
    "its worst case, and insertion sort is O(n²) in general but O(n) on input that is already "
    "nearly sorted.",
    "**Related notation.** Big-Ω (omega) gives a lower bound and Big-Θ (theta) a tight bound "
    "from both sides. In everyday conversation people often say \"O(n)\" when they strictly "
    "mean Θ(n).",
)

CONCEPTS = [
    (
        "Why is the sky blue?",
        "Sunlight contains all visible colours, and as it passes through the atmosphere it "
        "scatters off nitrogen and oxygen molecules. This Rayleigh scattering is much stronger "
        "for short wavelengths, so blue light gets bounced around the sky far more than red. "
        "When you look anywhere away from the Sun, you see that scattered blue light. At sunset "
        "the light travels through more air, most of the blue is scattered away before it reaches "
        "you, and the remaining reds and oranges dominate.",
    ),
    (
        "What is recursion in programming?",
        "Recursion is when a function solves a problem by calling itself on a smaller version of "
        "the same problem. Every recursive function needs a base case that stops the calls, such "
        "as 'the factorial of 0 is 1', and a recursive case that moves toward it, such as "
        "'n! = n × (n − 1)!'. Without a base case the calls never end and the program eventually "
        "runs out of stack space.",
    ),
    (
        "Explain photosynthesis in a couple of sentences.",
        "Photosynthesis is the process plants, algae and some bacteria use to turn light energy "
        "into chemical energy. Using chlorophyll, they combine carbon dioxide and water into "
        "glucose and release oxygen as a by-product: 6 CO₂ + 6 H₂O → C₆H₁₂O₆ + 6 O₂.",
    ),
    ("What does Big-O notation mean? I'd like a thorough explanation with examples.", BIG_O_LONG),
]

HASH_TABLE_LONG = paragraphs(
    "A hash table is a data structure that stores key–value pairs and lets you look up a value "
    "by its key in (on average) constant time. Python's `dict`, JavaScript objects and Java's "
    "`HashMap` are all built on this idea.",
    "**1. The array of buckets.** Underneath, a hash table is just an array. Each slot in the "
    "array is called a bucket. If the array has 8 slots, every key must be assigned to one of "
    "the indices 0 through 7.",
    "**2. The hash function.** To decide which bucket a key belongs in, the table runs the key "
    "through a hash function, which turns it into a large integer. The table then reduces that "
    "integer to a valid index, typically with `index = hash(key) % capacity`. A good hash "
    "function spreads keys evenly so that buckets fill up at about the same rate, and it must "
    "always return the same value for the same key.",
    "**3. Collisions.** Two different keys can land in the same bucket. There are two classic "
    "ways to handle that. With *separate chaining*, each bucket holds a small list, and "
    "colliding entries are appended to it. With *open addressing*, the table probes for the "
    "next free slot according to a fixed rule, such as checking index + 1, index + 2 and so on. "
    "Lookups follow the same rule until they find the key or hit an empty slot.",
    "**4. Load factor and resizing.** The load factor is the number of stored items divided by "
    "the number of buckets. As it rises, collisions become more common and lookups slow down. "
    "Most implementations resize when the load factor passes a threshold (often around 0.66 "
    "to 0.75): they allocate a bigger array, usually double the size, and re-insert every "
    "entry. A single resize costs O(n), but because it happens rarely, the cost averaged over "
    "many insertions is still O(1).",
    "**5. Why keys must be immutable.** If a key could change after being inserted, its hash "
    "would change too, and the table would look for it in the wrong bucket. That is why Python "
    "allows tuples and strings as dictionary keys but not lists.",
    "**Performance summary:** average-case insert, lookup and delete are O(1); the worst case, "
    "when many keys collide, degrades to O(n). In practice, with a decent hash function and "
    "sensible resizing, hash tables are among the fastest general-purpose lookup structures "
    "available.",
)

CODE_SNIPPETS = [
    (
        "How do I reverse a string in Python?",
        paragraphs(
            "The most common way is slicing with a step of −1:",
            "```python\ntext = \"hello world\"\nreversed_text = text[::-1]\nprint(reversed_text)  # dlrow olleh\n```",
            "`text[::-1]` walks the string from the end to the beginning. If you prefer something "
            "more explicit, `''.join(reversed(text))` gives the same result.",
        ),
    ),
    (
        "Write a Python function that returns the squares of the even numbers in a list.",
        paragraphs(
            "A list comprehension keeps this short:",
            "```python\ndef even_squares(numbers):\n    return [n * n for n in numbers if n % 2 == 0]\n\n\n"
            "print(even_squares([1, 2, 3, 4, 5, 6]))  # [4, 16, 36]\n```",
            "The `if` clause filters out odd numbers before `n * n` is computed.",
        ),
    ),
    (
        "Show me how to read a text file line by line in Python.",
        paragraphs(
            "Open the file with a `with` block so it is closed automatically, then iterate over it:",
            "```python\nwith open(\"notes.txt\", encoding=\"utf-8\") as f:\n    for line_number, line in "
            "enumerate(f, start=1):\n        print(line_number, line.rstrip(\"\\n\"))\n```",
            "Iterating over the file object reads one line at a time, so this works even for files "
            "that are too large to fit in memory.",
        ),
    ),
]

WORD_COUNT_LONG = paragraphs(
    "Here is a small, complete script that counts word frequencies in a text file and prints the "
    "most common words. It uses only the standard library.",
    "```python\nimport re\nimport sys\nfrom collections import Counter\nfrom pathlib import Path\n\n"
    "WORD_RE = re.compile(r\"[a-z']+\")\n\n\n"
    "def count_words(path: Path) -> Counter:\n"
    "    \"\"\"Return a Counter mapping each lower-cased word to its frequency.\"\"\"\n"
    "    counts = Counter()\n"
    "    with path.open(encoding=\"utf-8\") as f:\n"
    "        for line in f:\n"
    "            counts.update(WORD_RE.findall(line.lower()))\n"
    "    return counts\n\n\n"
    "def main() -> None:\n"
    "    if len(sys.argv) != 2:\n"
    "        sys.exit(\"usage: python wordfreq.py FILE\")\n"
    "    counts = count_words(Path(sys.argv[1]))\n"
    "    total = sum(counts.values())\n"
    "    print(f\"{total} words, {len(counts)} distinct\")\n"
    "    for word, n in counts.most_common(10):\n"
    "        print(f\"{word:>15}  {n:6d}  {n / total:6.2%}\")\n\n\n"
    "if __name__ == \"__main__\":\n"
    "    main()\n```",
    "**How it works:**",
    "- `WORD_RE` matches runs of lowercase letters and apostrophes, so \"don't\" counts as one "
    "word while punctuation and digits are ignored.\n"
    "- The file is read line by line, which keeps memory use small even for large files.\n"
    "- `Counter.update` adds one to the count of every word in the list it is given.\n"
    "- `most_common(10)` returns the ten highest counts, already sorted.\n"
    "- The format spec `{n / total:6.2%}` prints each word's share of the total as a percentage.",
    "Run it with `python wordfreq.py book.txt`. If you want to skip very common words such as "
    "\"the\" and \"and\", define a set of stop words and filter them out before updating the "
    "counter: `counts.update(w for w in WORD_RE.findall(line.lower()) if w not in STOP_WORDS)`.",
)


def single_turn_rows() -> list[dict]:
    rows = [
        arithmetic_multiplication(347, 28),
        arithmetic_long_division(7854, 17),
        arithmetic_discount(240, 15),
        arithmetic_fractions(Fraction(3, 4), Fraction(5, 6)),
        arithmetic_order_of_operations(),
        arithmetic_mean([82, 91, 77, 88, 95]),
        conversion_km_to_miles(42.195),
        conversion_f_to_c(350),
        conversion_kg_to_lb(68),
        conversion_litres_to_gallons(3.5),
        conversion_seconds(10000),
    ]
    rows += [row([user(q), assistant(a)]) for q, a in CONCEPTS]
    rows.append(row([user("How does a hash table work? Please go into some detail."), assistant(HASH_TABLE_LONG)]))
    rows += [row([user(q), assistant(a)]) for q, a in CODE_SNIPPETS]
    rows.append(row([user("Can you write a Python script that counts word frequencies in a file?"),
                     assistant(WORD_COUNT_LONG)]))
    assert len(rows) == 20, len(rows)
    return rows


# ---------------------------------------------------------------------------
# 2. Single-turn rows with a system prompt (6)
# ---------------------------------------------------------------------------

SYSTEM_ROWS = [
    (
        "You are a concise assistant. Answer in a single sentence.",
        "What is the difference between weather and climate?",
        "Weather is the short-term state of the atmosphere at a given place and time, while "
        "climate is the average pattern of weather in a region over decades.",
    ),
    (
        "You are a friendly high-school chemistry tutor. Explain ideas simply and end with a "
        "short check-your-understanding question.",
        "What is a mole?",
        "A mole is just a counting unit, like a dozen, but much bigger: one mole is "
        "6.022 × 10²³ particles. Chemists use it because atoms are so tiny that any amount you "
        "can weigh contains an enormous number of them. One mole of carbon-12 atoms has a mass "
        "of exactly 12 grams.\n\nQuick check: how many molecules are in 2 moles of water?",
    ),
    (
        "You reply only with valid JSON objects and no extra text.",
        "Give me the name, capital and continent of three countries.",
        json.dumps(
            {
                "countries": [
                    {"name": "Kenya", "capital": "Nairobi", "continent": "Africa"},
                    {"name": "Peru", "capital": "Lima", "continent": "South America"},
                    {"name": "Norway", "capital": "Oslo", "continent": "Europe"},
                ]
            },
            ensure_ascii=False,
        ),
    ),
    (
        "You are a careful code reviewer. Point out bugs first, then style issues.",
        "Review this:\n\n```python\ndef average(xs):\n    return sum(xs) / len(xs)\n```",
        "**Bug:** calling `average([])` raises `ZeroDivisionError`, because `len(xs)` is 0. "
        "Decide what an empty input should mean and handle it explicitly, for example by raising "
        "a `ValueError` with a clear message or returning `None`.\n\n**Style:** a more "
        "descriptive parameter name such as `values`, a type hint (`list[float]`) and a one-line "
        "docstring would make the intent clearer.",
    ),
    (
        "Tu es un assistant qui répond toujours en français, de façon claire et polie.",
        "What is the tallest mountain in the world?",
        "La plus haute montagne du monde est l'Everest, dans l'Himalaya, à la frontière entre le "
        "Népal et la Chine. Son sommet culmine à environ 8 849 mètres au-dessus du niveau de la mer.",
    ),
    (
        "You are a cheerful cooking assistant who gives practical tips.",
        "My rice always turns out mushy. What am I doing wrong?",
        "Mushy rice usually means too much water or too much stirring. Rinse the rice until the "
        "water runs clear to remove surface starch, use about 1 part rice to 1.5 parts water for "
        "long-grain white rice, and don't lift the lid while it simmers. Once it's done, let it "
        "rest off the heat for 10 minutes, then fluff it with a fork. 🍚",
    ),
]


def system_rows() -> list[dict]:
    return [row([system(s), user(u), assistant(a)]) for s, u, a in SYSTEM_ROWS]


# ---------------------------------------------------------------------------
# 3. Single-turn word problems with reasoning_content (4)
# ---------------------------------------------------------------------------


def reasoning_trains(dist: int, va: int, vb: int) -> dict:
    closing = va + vb
    t = Fraction(dist, closing)
    hours = int(t)
    minutes = int((t - hours) * 60)
    from_a = va * t
    reasoning = (
        f"The trains move toward each other, so the gap closes at {va} + {vb} = {closing} km/h. "
        f"Time to meet = {dist} / {closing} = {float(t)} h, i.e. {hours} h {minutes} min. "
        f"Train A covers {va} × {float(t)} = {fmt_num(float(from_a))} km in that time; "
        f"train B covers {fmt_num(float(dist - from_a))} km. Those sum to {dist}, good."
    )
    answer = (
        f"They meet after **{hours} hours {minutes} minutes**, about "
        f"**{fmt_num(float(from_a))} km** from the first train's station. "
        f"The gap shrinks by {closing} km every hour, and {dist} ÷ {closing} = {float(t)} hours."
    )
    q = (
        f"Two trains are {dist} km apart and head toward each other, one at {va} km/h and the "
        f"other at {vb} km/h. When and where do they meet?"
    )
    return row([user(q), assistant(answer, reasoning=reasoning)])


def reasoning_ages(ratio_now: int, years: int, ratio_later: int) -> dict:
    # ratio_now * b + years = ratio_later * (b + years)
    b = Fraction(ratio_later * years - years, ratio_now - ratio_later)
    assert b.denominator == 1
    b = int(b)
    m = ratio_now * b
    assert m + years == ratio_later * (b + years)
    coeff = ratio_now - ratio_later
    reasoning = (
        f"Let the brother's age be b. Maya is {ratio_now}b. In {years} years: "
        f"{ratio_now}b + {years} = {ratio_later}(b + {years}) = {ratio_later}b + {ratio_later * years}. "
        + (f"So b = {b}. " if coeff == 1 else f"So {coeff}b = {coeff * b}, b = {b}. ")
        + f"Maya = {m}. Check: in {years} years she is {m + years} and he is {b + years}; "
        f"{m + years} = {ratio_later} × {b + years}. Correct."
    )
    answer = (
        f"Maya is **{m}** and her brother is **{b}**. In {years} years they will be "
        f"{m + years} and {b + years}, and {m + years} is exactly {ratio_later} times {b + years}."
    )
    q = (
        f"Maya is {ratio_now} times as old as her brother. In {years} years she will be twice as "
        "old as him. How old are they now?"
    )
    return row([user(q), assistant(answer, reasoning=reasoning)])


def reasoning_compound_interest(principal: int, rate_pct: int, years: int) -> dict:
    # Work in whole cents and round each year's interest half-up, as a bank would.
    balance = principal * 100
    lines = []
    for year in range(1, years + 1):
        interest = (balance * rate_pct + 50) // 100
        balance += interest
        lines.append(f"Year {year}: interest ${interest / 100:,.2f}, balance ${balance / 100:,.2f}")
    final = balance / 100
    reasoning = (
        f"Compound annually: B = {principal} × (1 + {rate_pct}/100)^{years}. "
        "Doing it year by year, rounding interest to the cent: " + "; ".join(lines) + ". "
        f"Total interest = {final - principal:.2f}."
    )
    table = "\n".join(f"- {line}" for line in lines)
    answer = paragraphs(
        "With interest compounded once a year, the balance grows like this:",
        table,
        f"After {years} years you would have **${final:,.2f}**, which is "
        f"${final - principal:,.2f} in interest. That's more than the "
        f"${principal * rate_pct * years // 100:,} you would get from simple interest, because "
        "each year's interest also earns interest.",
    )
    q = f"If I put ${principal:,} in a savings account at {rate_pct}% annual interest, how much will I have after {years} years?"
    return row([user(q), assistant(answer, reasoning=reasoning)])


def reasoning_rectangle(perimeter: int, extra: int) -> dict:
    w = Fraction(perimeter // 2 - extra, 2)
    assert w.denominator == 1
    w = int(w)
    length = w + extra
    area = w * length
    assert 2 * (w + length) == perimeter
    reasoning = (
        f"Width w, length w + {extra}. Perimeter 2(w + w + {extra}) = {perimeter} → "
        f"2w + {extra} = {perimeter // 2} → w = {w}. Length {length}. Area {w} × {length} = {area}."
    )
    answer = (
        f"The garden is **{w} m wide** and **{length} m long**, so its area is "
        f"{w} × {length} = **{area} m²**. (Check: 2 × ({w} + {length}) = {perimeter} m of fence.)"
    )
    q = (
        f"I have {perimeter} m of fencing for a rectangular garden, and I want it to be {extra} m "
        "longer than it is wide. What are the dimensions and the area?"
    )
    return row([user(q), assistant(answer, reasoning=reasoning)])


def reasoning_single_rows() -> list[dict]:
    return [
        reasoning_trains(375, 60, 90),
        reasoning_ages(3, 6, 2),
        reasoning_compound_interest(1000, 5, 3),
        reasoning_rectangle(56, 4),
    ]


# ---------------------------------------------------------------------------
# 4. Non-ASCII single-turn rows (7)
# ---------------------------------------------------------------------------


def sum_formula_row(n: int) -> dict:
    total = sum(range(1, n + 1))
    assert total == n * (n + 1) // 2
    answer = paragraphs(
        "The formula ∑ₖ₌₁ⁿ k = n(n + 1)/2 says that adding the integers 1, 2, …, n gives "
        "n(n + 1)/2.",
        "A quick way to see why: write the sum forwards and backwards, 1 + 2 + … + n and "
        "n + (n − 1) + … + 1. Each of the n column pairs adds up to n + 1, so twice the sum is "
        "n(n + 1).",
        f"For n = {n}: {n} × {n + 1} / 2 = **{total:,}**. Note also that for every n ≥ 1 the "
        "sum is ≤ n², since each of the n terms is ≤ n.",
    )
    return row([user(f"Explain why ∑ₖ₌₁ⁿ k = n(n+1)/2 and use it for n = {n}."), assistant(answer)])


NON_ASCII_ROWS = [
    (
        "Peux-tu m'expliquer la différence entre « savoir » et « connaître » ?",
        "Bien sûr ! Les deux verbes se traduisent par « to know », mais ils ne s'emploient pas de "
        "la même façon.\n\n- **Savoir** s'utilise pour une information ou une compétence : "
        "« Je sais nager », « Elle sait où tu habites ».\n- **Connaître** s'utilise pour une "
        "personne, un lieu ou une chose avec laquelle on est familier : « Je connais Marie », "
        "« Tu connais ce café ? ».\n\nAstuce : si le verbe est suivi d'un autre verbe ou d'une "
        "proposition (que, où, si…), c'est presque toujours « savoir ».",
    ),
    (
        "Was ist der Unterschied zwischen „seit“ und „seid“?",
        "„Seit“ ist eine Präposition oder Konjunktion und bezieht sich auf die Zeit: „Ich wohne "
        "seit drei Jahren in Köln.“ „Seid“ ist eine Form des Verbs „sein“ (ihr seid) oder der "
        "Imperativ Plural: „Ihr seid müde“, „Seid bitte leise!“. Eine Eselsbrücke: seit mit t "
        "wie Zeit.",
    ),
    (
        "日本の四季について簡単に教えてください。",
        "日本には春・夏・秋・冬の四つの季節があります。春は桜が咲き、お花見を楽しむ人が多いです。"
        "夏は蒸し暑く、各地で花火大会や夏祭りが開かれます。秋は紅葉が美しく、食べ物もおいしい季節です。"
        "冬は北の地方や山で雪が多く降り、スキーや温泉が人気です。",
    ),
    (
        "请用简单的话解释什么是机器学习。",
        "机器学习是让计算机从数据中自动找出规律的方法，而不是由人把每一条规则都写出来。"
        "比如，给程序看成千上万张标好“猫”和“狗”的照片，它就能学会分辨新照片里是猫还是狗。"
        "数据越多、越有代表性，模型通常就学得越好。",
    ),
    (
        "What do the Greek letters α, β, λ, μ, π, σ and Ω usually stand for in science?",
        "They are reused a lot, but common meanings are:\n\n- **α (alpha):** an angle, a "
        "significance level in statistics, or an alpha particle.\n- **β (beta):** another angle, "
        "a regression coefficient, or beta decay.\n- **λ (lambda):** wavelength in physics, or an "
        "eigenvalue in linear algebra.\n- **μ (mu):** the mean of a distribution, or the prefix "
        "micro- (1 μm = 10⁻⁶ m).\n- **π (pi):** the ratio of a circle's "
        "circumference to its diameter, π ≈ 3.14159.\n- **σ (sigma):** standard deviation; the capital Σ means "
        "summation.\n- **Ω (omega):** the unit ohm for electrical resistance.",
    ),
    (
        "Can you suggest a few emoji to spice up a birthday message for my sister?",
        "Sure! A few that work well together: 🎉 🎂 🎁 🥳 🎈 💐 ✨. For example: "
        "\"Happy birthday, sis! 🥳🎂 Wishing you a year full of laughter, adventures and cake. "
        "Love you! 💖\"",
    ),
]


def non_ascii_rows() -> list[dict]:
    rows = [row([user(q), assistant(a)]) for q, a in NON_ASCII_ROWS]
    rows.append(sum_formula_row(100))
    return rows


# ---------------------------------------------------------------------------
# 5. Multi-turn rows (15): 5 with reasoning on every assistant turn, 2 with a system prompt
# ---------------------------------------------------------------------------


def mt_recipe_scaling() -> list[dict]:
    # (ingredient, quantity, unit); an empty unit means the ingredient is counted.
    base = [("flour", Fraction(3, 2), "cups"), ("milk", Fraction(5, 4), "cups"),
            ("egg", Fraction(1), ""), ("sugar", Fraction(2), "tbsp")]
    serves = 4

    def amount(name: str, qty: Fraction, unit: str) -> str:
        if unit:
            return f"{fmt_frac(qty)} {unit} {name}"
        return f"{fmt_frac(qty)} {name}" + ("" if qty <= 1 else "s")

    def scaled(target: int) -> tuple[Fraction, str]:
        factor = Fraction(target, serves)
        return factor, "\n".join(f"- {amount(n, q * factor, u)}" for n, q, u in base)

    f6, list6 = scaled(6)
    f10, list10 = scaled(10)
    eggs10 = base[2][1] * f10
    base_list = ", ".join(amount(n, q, u) for n, q, u in base)
    return [
        user(f"My pancake recipe serves {serves}: {base_list}. How much of each do I need for 6 people?"),
        assistant(
            paragraphs(f"Multiply everything by 6/{serves} = {fmt_frac(f6)}:", list6),
            reasoning=f"Scale factor 6/{serves} = {f6} = {fmt_frac(f6)}. Multiply each ingredient: "
            + "; ".join(f"{n}: {fmt_frac(q)} × {f6} = {fmt_frac(q * f6)}" for n, q, _ in base) + ".",
        ),
        user("And for 10 people?"),
        assistant(
            paragraphs(
                f"Now the factor is 10/{serves} = {fmt_frac(f10)}:",
                list10,
                f"Since {fmt_frac(eggs10)} eggs is awkward, use 2 large eggs plus one small one, "
                "or beat 3 eggs and leave out a little.",
            ),
            reasoning=f"New factor from the original recipe, not from the 6-person version: 10/{serves} = "
            f"{f10}. Eggs become {fmt_frac(eggs10)}, which isn't a whole number, so suggest a practical rounding.",
        ),
    ]


def is_prime(n: int) -> bool:
    if n < 2:
        return False
    return all(n % p for p in range(2, math.isqrt(n) + 1))


def smallest_factor(n: int) -> int:
    for p in range(2, math.isqrt(n) + 1):
        if n % p == 0:
            return p
    return n


def mt_primes() -> list[dict]:
    a, b = 91, 97
    fa = smallest_factor(a)
    nxt = next(k for k in range(b + 1, 2 * b) if is_prime(k))
    limit_b = math.isqrt(b)
    primes_to_check = [p for p in range(2, limit_b + 1) if is_prime(p)]
    assert not is_prime(a) and is_prime(b)
    return [
        user(f"Is {a} prime?"),
        assistant(
            f"No. {a} = {fa} × {a // fa}, so it has divisors other than 1 and itself. It's a "
            "classic trick question because it looks prime.",
            reasoning=f"Check small primes: {a} is odd, digit sum {sum(map(int, str(a)))} is not a multiple "
            f"of 3, doesn't end in 0 or 5. Try {fa}: {fa} × {a // fa} = {a}. Composite.",
        ),
        user(f"What about {b}?"),
        assistant(
            f"Yes, {b} is prime. It's enough to test divisibility by primes up to √{b} ≈ "
            f"{math.sqrt(b):.2f}, which are {', '.join(map(str, primes_to_check))}, and none of them "
            f"divides {b}.",
            reasoning=f"√{b} ≈ {math.sqrt(b):.2f}, so test primes ≤ {limit_b}: "
            + ", ".join(f"{b} mod {p} = {b % p}" for p in primes_to_check)
            + ". No zero remainders, so prime.",
        ),
        user("What's the next prime after that?"),
        assistant(
            f"The next prime after {b} is **{nxt}**.",
            reasoning="Check candidates in order: "
            + "; ".join(
                f"{k} = {smallest_factor(k)} × {k // smallest_factor(k)}" if not is_prime(k) else f"{k} is prime"
                for k in range(b + 1, nxt + 1)
            )
            + ".",
        ),
    ]


def mt_budget(income: int) -> list[dict]:
    needs, wants, savings = income * 50 // 100, income * 30 // 100, income * 20 // 100
    rent = 1150
    left = needs - rent
    yearly = savings * 12
    return [
        user(f"I take home ${income:,} a month. How would the 50/30/20 rule split that?"),
        assistant(
            "The 50/30/20 rule puts 50% toward needs, 30% toward wants and 20% toward savings:\n\n"
            f"- Needs: ${needs:,}\n- Wants: ${wants:,}\n- Savings: ${savings:,}",
            reasoning=f"{income} × 0.5 = {needs}; × 0.3 = {wants}; × 0.2 = {savings}. "
            f"Check: {needs} + {wants} + {savings} = {needs + wants + savings}.",
        ),
        user(f"My rent is ${rent:,}. How much is left in the needs bucket for everything else?"),
        assistant(
            f"After rent you'd have ${needs:,} − ${rent:,} = **${left:,}** for groceries, utilities, "
            "transport and insurance. That's tight, so it may be worth tracking those costs for a month.",
            reasoning=f"Needs budget {needs} minus rent {rent} = {left}.",
        ),
        user("If I stick to the savings part, how much will I have saved after a year?"),
        assistant(
            f"${savings:,} × 12 months = **${yearly:,}**, not counting any interest.",
            reasoning=f"{savings} × 12 = {yearly}.",
        ),
    ]


def mt_road_trip(km: int, speed: int, start_h: int, start_m: int, break_min: int, l_per_100: float) -> list[dict]:
    drive = Fraction(km, speed)
    drive_min = int(drive * 60)
    total_min = start_h * 60 + start_m + drive_min + break_min
    arr_h, arr_m = divmod(total_min, 60)
    fuel = km * l_per_100 / 100
    dh, dm = divmod(drive_min, 60)
    return [
        user(f"I'm driving {km} km at an average of {speed} km/h. How long will it take?"),
        assistant(
            f"{km} ÷ {speed} = {float(drive)} hours, which is **{dh} h {dm} min** of driving.",
            reasoning=f"time = distance / speed = {km}/{speed} = {float(drive)} h = {drive_min} min = {dh} h {dm} min.",
        ),
        user(f"If I leave at {start_h}:{start_m:02d} and take one {break_min}-minute break, when do I arrive?"),
        assistant(
            f"Driving time {dh} h {dm} min plus the {break_min}-minute break is "
            f"{(drive_min + break_min) // 60} h {(drive_min + break_min) % 60} min, so you'd arrive "
            f"around **{arr_h}:{arr_m:02d}**.",
            reasoning=f"Start {start_h}:{start_m:02d} = {start_h * 60 + start_m} min after midnight. "
            f"Add {drive_min} + {break_min} = {drive_min + break_min} → {total_min} min = {arr_h}:{arr_m:02d}.",
        ),
        user(f"My car uses {l_per_100} L per 100 km. How much fuel will I need?"),
        assistant(
            f"{km} km × {l_per_100} L / 100 km = **{fuel:.1f} L**. It's sensible to budget a bit "
            "extra for traffic and detours.",
            reasoning=f"{km}/100 = {km / 100}; × {l_per_100} = {fuel:.1f} L.",
        ),
    ]


def mt_debugging() -> list[dict]:
    return [
        user(
            "Why does this print only 4 numbers?\n\n```python\nfor i in range(1, 5):\n    print(i)\n```"
        ),
        assistant(
            "`range(1, 5)` stops *before* 5, so it yields 1, 2, 3 and 4. The end value of a range "
            "is exclusive. Use `range(1, 6)` if you want 1 through 5.",
            reasoning="range(start, stop) excludes stop. 1..4 is four numbers. Classic off-by-one.",
        ),
        user(
            "Okay. Now this one crashes with IndexError:\n\n```python\nitems = ['a', 'b', 'c']\n"
            "for i in range(len(items) + 1):\n    print(items[i])\n```"
        ),
        assistant(
            paragraphs(
                "`len(items)` is 3, so `range(4)` yields 0, 1, 2, 3, but the last valid index is 2. "
                "On `i = 3` the lookup fails. Drop the `+ 1`, or better, loop over the items directly:",
                "```python\nfor item in items:\n    print(item)\n```",
                "If you also need the index, use `for i, item in enumerate(items):`.",
            ),
            reasoning="len = 3, range(4) → 0..3, items[3] out of range. Same off-by-one family as before, "
            "but in the other direction. Recommend direct iteration / enumerate.",
        ),
    ]


def mt_planets() -> list[dict]:
    return [
        user("Which planet is the largest in our solar system?"),
        assistant("Jupiter. Its diameter is about 11 times Earth's, and it has more than twice the mass of all the other planets combined."),
        user("Is it solid?"),
        assistant(
            "Not in the way Earth is. Jupiter is a gas giant made mostly of hydrogen and helium. "
            "Deeper down, the pressure turns hydrogen into a liquid and then into a metallic state, "
            "and there may be a dense, fuzzy core, but there is no surface you could stand on."
        ),
        user("What's the Great Red Spot?"),
        assistant(
            "It's a giant storm, an anticyclone, in Jupiter's southern hemisphere that is wider than "
            "Earth. It has been observed for at least 190 years, though it has been shrinking in "
            "recent decades."
        ),
    ]


def mt_haiku() -> list[dict]:
    return [
        user("Write a haiku about autumn rain."),
        assistant("Cold rain on the roof\nmaple leaves slide down the glass\nthe kettle begins"),
        user("Nice. Can you make it a bit more cheerful?"),
        assistant("Warm rain, tapping roof\nred leaves dance across the glass\ncocoa, two spoons full"),
    ]


def mt_list_tuple() -> list[dict]:
    return [
        user("What's the difference between a list and a tuple in Python?"),
        assistant(
            "A list is mutable: you can append, remove or change elements after creating it. A tuple "
            "is immutable: once created, its contents can't change. Tuples are also hashable (if "
            "their elements are), so they can be dictionary keys."
        ),
        user("When should I use a tuple, then?"),
        assistant(
            "Use a tuple for a fixed group of values that belong together, like a coordinate "
            "`(x, y)` or a database row, and a list for a collection you'll grow or modify."
        ),
        user("Can you show an example of a tuple as a dict key?"),
        assistant(
            "```python\ndistances = {\n    (\"Paris\", \"Lyon\"): 465,\n    (\"Paris\", \"Lille\"): 225,\n}\n"
            "print(distances[(\"Paris\", \"Lyon\")])  # 465\n```\n\nA list like `[\"Paris\", \"Lyon\"]` "
            "would raise `TypeError: unhashable type: 'list'` here."
        ),
    ]


def mt_tomatoes() -> list[dict]:
    return [
        user("I want to grow tomatoes on my balcony. Where do I start?"),
        assistant(
            "Pick a compact or cherry variety, a pot of at least 20 litres with drainage holes, and "
            "a spot with six or more hours of direct sun. Use good potting mix rather than garden "
            "soil, and add a stake or cage when you plant."
        ),
        user("How often should I water them?"),
        assistant(
            "Water deeply whenever the top few centimetres of soil feel dry, which in summer can mean "
            "every day for pots. Consistency matters more than volume: letting the soil swing between "
            "bone-dry and soaked causes split fruit and blossom-end rot."
        ),
    ]


STUDY_PLAN_LONG = paragraphs(
    "Here's a six-week plan that assumes about an hour a day on weekdays and a longer session on "
    "Saturdays. Adjust the pace if a topic clicks faster or takes longer.",
    "**Week 1: Foundations.** Install Python and an editor, then work through variables, numbers, "
    "strings and basic input/output. Write tiny programs every day: a tip calculator, a "
    "temperature converter, a program that greets you by name. Saturday: redo two of them without "
    "looking at your notes.",
    "**Week 2: Control flow.** Learn `if`/`elif`/`else`, `for` and `while` loops, and `range`. "
    "Practice with FizzBuzz, a number-guessing game and a program that prints a multiplication "
    "table. Saturday: combine them into a small text menu that lets you pick which one to run.",
    "**Week 3: Data structures.** Lists, tuples, dictionaries and sets, plus list comprehensions. "
    "Build a to-do list that can add, remove and show items, and a word counter that uses a "
    "dictionary. Saturday: read a short text file and report its ten most common words.",
    "**Week 4: Functions and modules.** Define functions with parameters and return values, learn "
    "about default arguments and scope, and split code into modules you import. Refactor your "
    "earlier programs so each piece of logic lives in a named function. Saturday: write a few "
    "`assert` checks for your functions.",
    "**Week 5: Files, errors and the standard library.** Read and write files with `with open(...)`, "
    "handle errors with `try`/`except`, and explore `pathlib`, `json`, `random` and `datetime`. "
    "Project: a journal program that saves dated entries to a JSON file.",
    "**Week 6: A real project.** Choose something you care about, such as a budget tracker, a quiz "
    "game or a script that renames your photos by date, and build it end to end. Keep it small "
    "enough to finish, then add one improvement at a time.",
    "**Habits that help throughout:** type code yourself instead of copying it, read error "
    "messages from the bottom up, keep a notes file of things that confused you, and once a week "
    "explain a concept out loud as if teaching a friend. If you get stuck for more than 20 "
    "minutes, take a break or ask for help. Being stuck is part of learning, not a sign you "
    "can't do it.",
)


def mt_study_plan() -> list[dict]:
    return [
        system("You are an encouraging study coach for adult beginners learning to program."),
        user("I want to learn Python in my spare time. Can you give me a study plan for about six weeks?"),
        assistant(STUDY_PLAN_LONG),
        user("That looks great. What should I do if I fall behind?"),
        assistant(
            "Don't try to catch up by cramming. Just push the remaining weeks back. Falling behind "
            "usually means a topic needed more practice, and that time is well spent. If you miss "
            "several days in a row, restart with a short review session before moving on."
        ),
    ]


BUBBLE_SORT_CODE = (
    "```python\ndef bubble_sort(items):\n    \"\"\"Sort a list in place using bubble sort and return it.\"\"\"\n"
    "    n = len(items)\n    for end in range(n - 1, 0, -1):\n        swapped = False\n"
    "        for i in range(end):\n            if items[i] > items[i + 1]:\n"
    "                items[i], items[i + 1] = items[i + 1], items[i]\n                swapped = True\n"
    "        if not swapped:\n            break  # already sorted, stop early\n    return items\n\n\n"
    "print(bubble_sort([5, 1, 4, 2, 8]))  # [1, 2, 4, 5, 8]\n```"
)


def mt_bubble_sort() -> list[dict]:
    data = [5, 1, 4, 2, 8]
    passes = []
    arr = list(data)
    for end in range(len(arr) - 1, 0, -1):
        swapped = False
        for i in range(end):
            if arr[i] > arr[i + 1]:
                arr[i], arr[i + 1] = arr[i + 1], arr[i]
                swapped = True
        passes.append(list(arr))
        if not swapped:
            break
    trace = "\n".join(f"- After pass {k}: {p}" for k, p in enumerate(passes, start=1))
    return [
        user("How does bubble sort work?"),
        assistant(
            paragraphs(
                "Bubble sort repeatedly walks through the list, compares each pair of neighbours, "
                "and swaps them if they are in the wrong order. After each full pass, the largest "
                "remaining element has \"bubbled\" to the end, so the next pass can stop one "
                "position earlier.",
                f"For example, sorting {data}:",
                trace,
                "The last pass makes no swaps, which tells us the list is sorted and we can stop early.",
            )
        ),
        user("Can you show me the code?"),
        assistant(
            paragraphs(
                BUBBLE_SORT_CODE,
                "The outer loop shrinks the unsorted region from the right; the inner loop does the "
                "neighbour comparisons. The `swapped` flag lets the function return early when a "
                "pass changes nothing, which makes it fast on input that is already sorted.",
            )
        ),
        user("Is it efficient?"),
        assistant(
            "Not for large inputs. In the worst and average cases it makes about n²/2 comparisons, "
            "so it is O(n²). With the early-exit flag the best case, already sorted input, is O(n). "
            "Python's built-in `sorted()` uses Timsort, which is O(n log n) and much faster in "
            "practice, so bubble sort is mainly useful for teaching."
        ),
    ]


def mt_times_tables() -> list[dict]:
    pairs = [(7, 8), (7, 9), (12, 12), (13, 7)]
    msgs = [user(f"Quick quiz for my kid: what is {pairs[0][0]} × {pairs[0][1]}?")]
    msgs.append(assistant(f"{pairs[0][0]} × {pairs[0][1]} = {pairs[0][0] * pairs[0][1]}."))
    follow_ups = ["And {a} × {b}?", "What about {a} × {b}?", "Last one: {a} × {b}?"]
    for (a, b), text in zip(pairs[1:], follow_ups):
        msgs.append(user(text.format(a=a, b=b)))
        if (a, b) == (13, 7):
            reply = f"{a} × {b} = {a * b}. A handy trick: 10 × {b} = {10 * b}, plus 3 × {b} = {3 * b}, gives {a * b}."
        else:
            reply = f"{a} × {b} = {a * b}."
        msgs.append(assistant(reply))
    return msgs


def mt_cups() -> list[dict]:
    cup_ml = 236.5882365
    litre_cups = 1000 / cup_ml
    half = 500 / cup_ml
    return [
        user("How many US cups are in a liter?"),
        assistant(f"A US cup is about 236.6 mL, so 1 liter ≈ **{litre_cups:.2f} cups**."),
        user("So roughly how many cups is 500 mL of stock?"),
        assistant(f"About {half:.2f} cups, so a little over 2 cups. Measuring 2 cups plus 2 tablespoons gets you very close."),
    ]


def mt_japanese() -> list[dict]:
    return [
        system("You are a patient Japanese tutor. Give the Japanese, the reading in romaji, and a short note."),
        user("How do I say \"thank you\" in Japanese?"),
        assistant(
            "**ありがとうございます** (arigatō gozaimasu) is the polite form. Among friends you can "
            "just say ありがとう (arigatō)."
        ),
        user("And \"excuse me\"?"),
        assistant(
            "**すみません** (sumimasen). It's used to get someone's attention, to apologise for a "
            "small inconvenience, and sometimes even to say thanks when someone has gone out of "
            "their way for you."
        ),
        user("How about \"good morning\"?"),
        assistant(
            "**おはようございます** (ohayō gozaimasu), or casually おはよう (ohayō). It's used until "
            "roughly late morning; after that you switch to こんにちは (konnichiwa)."
        ),
    ]


def mt_git() -> list[dict]:
    return [
        user("What does `git status` show?"),
        assistant(
            "It shows the state of your working tree: which branch you're on, which files are "
            "staged for the next commit, which tracked files have unstaged changes, and which files "
            "are untracked."
        ),
        user("And what's the difference between `git fetch` and `git pull`?"),
        assistant(
            "`git fetch` downloads new commits from the remote but doesn't change your local "
            "branches or files. `git pull` is a fetch followed by a merge (or rebase) into your "
            "current branch, so it updates your working tree too."
        ),
    ]


def multi_turn_rows() -> list[dict]:
    rows = [
        # With reasoning_content on every assistant turn (5).
        row(mt_recipe_scaling()),
        row(mt_primes()),
        row(mt_budget(3200)),
        row(mt_road_trip(280, 80, 9, 15, 20, 6.5)),
        row(mt_debugging()),
        # Plain multi-turn (10), two of them with a system prompt.
        row(mt_planets()),
        row(mt_haiku()),
        row(mt_list_tuple()),
        row(mt_tomatoes()),
        row(mt_study_plan()),
        row(mt_bubble_sort()),
        row(mt_times_tables()),
        row(mt_cups()),
        row(mt_japanese()),
        row(mt_git()),
    ]
    assert len(rows) == 15
    return rows


# ---------------------------------------------------------------------------
# 6. Tool-use rows (8): 4 with a system prompt, 3 with reasoning_content
# ---------------------------------------------------------------------------


def fn_schema(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


TOOL_WEATHER = fn_schema(
    "get_weather",
    "Get the current weather for a city.",
    {
        "city": {"type": "string", "description": "City name, e.g. 'Lisbon'."},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit."},
    },
    ["city"],
)
TOOL_CURRENCY = fn_schema(
    "convert_currency",
    "Convert an amount of money from one currency to another using the latest exchange rate.",
    {
        "amount": {"type": "number", "description": "Amount to convert."},
        "from_currency": {"type": "string", "description": "ISO 4217 code of the source currency."},
        "to_currency": {"type": "string", "description": "ISO 4217 code of the target currency."},
    },
    ["amount", "from_currency", "to_currency"],
)
TOOL_CALC = fn_schema(
    "calculate",
    "Evaluate an arithmetic expression and return the numeric result.",
    {"expression": {"type": "string", "description": "Expression using + - * / and parentheses."}},
    ["expression"],
)
TOOL_TIME = fn_schema(
    "get_local_time",
    "Get the current local time in an IANA time zone.",
    {"timezone": {"type": "string", "description": "IANA time zone name, e.g. 'Asia/Tokyo'."}},
    ["timezone"],
)
TOOL_RECIPES = fn_schema(
    "search_recipes",
    "Find recipes that use the given ingredients.",
    {
        "ingredients": {"type": "array", "items": {"type": "string"}, "description": "Ingredients to include."},
        "max_results": {"type": "integer", "minimum": 1, "maximum": 10, "description": "How many recipes to return."},
    },
    ["ingredients"],
)
TOOL_CALENDAR = fn_schema(
    "create_calendar_event",
    "Create an event in the user's calendar.",
    {
        "title": {"type": "string"},
        "date": {"type": "string", "description": "Date in YYYY-MM-DD format."},
        "start_time": {"type": "string", "description": "Start time in HH:MM, 24-hour clock."},
        "duration_minutes": {"type": "integer", "minimum": 5},
    },
    ["title", "date", "start_time"],
)
TOOL_DISTANCE = fn_schema(
    "get_distance",
    "Get the travel distance and estimated duration between two places.",
    {
        "origin": {"type": "string"},
        "destination": {"type": "string"},
        "mode": {"type": "string", "enum": ["driving", "train", "walking", "cycling"]},
    },
    ["origin", "destination"],
)


def tool_weather_munich() -> dict:
    result = {"city": "München", "temperature": 4, "unit": "celsius", "condition": "light snow", "humidity": 87}
    return row(
        [
            system("You are a helpful travel assistant. Use tools when you need live information."),
            user("Wie ist das Wetter gerade in München? Please answer in English."),
            assistant(
                "",
                reasoning="The user wants current weather in Munich; call get_weather with celsius.",
                tool_calls=[tool_call(1, "get_weather", {"city": "München", "unit": "celsius"})],
            ),
            tool_result(1, result),
            assistant(
                "It's currently 4 °C in München with light snow and 87% humidity. Wear a warm coat "
                "and waterproof shoes if you're heading out. ❄️",
                reasoning="Tool says 4 °C, light snow, 87% humidity. Summarise with a practical tip.",
            ),
        ],
        tools=[TOOL_WEATHER],
    )


def tool_currency(amount: int, rate: float) -> dict:
    converted = round(amount * rate, 2)
    result = {"amount": amount, "from": "USD", "to": "EUR", "rate": rate, "converted": converted}
    return row(
        [
            user(f"How much is {amount} US dollars in euros right now?"),
            assistant("", tool_calls=[tool_call(1, "convert_currency", {"amount": amount, "from_currency": "USD", "to_currency": "EUR"})]),
            tool_result(1, result),
            assistant(f"At the current rate of {rate} EUR per USD, ${amount} is about **€{converted:.2f}**."),
        ],
        tools=[TOOL_CURRENCY, TOOL_CALC],
    )


def tool_calculator(principal: int, tax_pct: int) -> dict:
    expr = f"{principal} * {tax_pct} / 100 + {principal}"
    value = principal * tax_pct / 100 + principal
    tax = principal * tax_pct / 100
    return row(
        [
            user(f"I'm buying a laptop for ${principal:,} and the sales tax is {tax_pct}%. What's the total?"),
            assistant(
                "",
                reasoning=f"Total = price + price × {tax_pct}%. Use the calculator to avoid slips: {expr}.",
                tool_calls=[tool_call(1, "calculate", {"expression": expr})],
            ),
            tool_result(1, {"expression": expr, "result": value}),
            assistant(
                f"The tax is ${tax:,.2f}, so the total comes to **${value:,.2f}**.",
                reasoning=f"Calculator returned {value}; tax part is {tax}.",
            ),
        ],
        tools=[TOOL_CALC],
    )


def tool_time_tokyo() -> dict:
    result = {"timezone": "Asia/Tokyo", "local_time": "2024-03-14T21:30:00+09:00", "utc_offset": "+09:00"}
    return row(
        [
            system("You are an assistant for a distributed team. Be brief."),
            user("What time is it in Tokyo? I want to know if it's too late to message a colleague."),
            assistant("", tool_calls=[tool_call(1, "get_local_time", {"timezone": "Asia/Tokyo"})]),
            tool_result(1, result),
            assistant(
                "It's 21:30 in Tokyo (UTC+9). That's evening, so a quick message is probably fine, "
                "but don't expect a reply until tomorrow morning."
            ),
        ],
        tools=[TOOL_TIME, TOOL_WEATHER],
    )


def tool_recipes() -> dict:
    result = {
        "recipes": [
            {"title": "Spinach and chickpea curry", "minutes": 30},
            {"title": "Chickpea, spinach and feta salad", "minutes": 15},
        ]
    }
    return row(
        [
            user("I have chickpeas, spinach and some feta. Any ideas for dinner?"),
            assistant(
                "",
                tool_calls=[
                    tool_call(1, "search_recipes", {"ingredients": ["chickpeas", "spinach", "feta"], "max_results": 2})
                ],
            ),
            tool_result(1, result),
            assistant(
                "Two good options:\n\n1. **Spinach and chickpea curry** (about 30 minutes). Crumble "
                "the feta on top at the end for a salty finish.\n2. **Chickpea, spinach and feta "
                "salad** (about 15 minutes). Great if you want something quick and light."
            ),
        ],
        tools=[TOOL_RECIPES],
    )


def tool_calendar() -> dict:
    args = {"title": "Dentist appointment", "date": "2024-05-21", "start_time": "14:30", "duration_minutes": 45}
    result = {"status": "created", "event_id": "evt_0042", **args}
    return row(
        [
            system("You manage the user's calendar. Confirm details back to the user after creating events."),
            user("Add my dentist appointment on 21 May 2024 at 2:30 pm, it takes about 45 minutes."),
            assistant(
                "",
                reasoning="Convert 2:30 pm to 24-hour: 14:30. Date 2024-05-21. Duration 45.",
                tool_calls=[tool_call(1, "create_calendar_event", args)],
            ),
            tool_result(1, result),
            assistant(
                "Done! \"Dentist appointment\" is in your calendar for Tuesday, 21 May 2024, from "
                "14:30 to 15:15.",
                reasoning="Created. 14:30 + 45 min = 15:15. 2024-05-21 is a Tuesday.",
            ),
        ],
        tools=[TOOL_CALENDAR, TOOL_TIME],
    )


def tool_distance() -> dict:
    args = {"origin": "Paris", "destination": "Lyon", "mode": "train"}
    result = {"origin": "Paris", "destination": "Lyon", "mode": "train", "distance_km": 465, "duration_minutes": 118}
    h, m = divmod(result["duration_minutes"], 60)
    return row(
        [
            system("Tu es un assistant de voyage. Réponds en français."),
            user("Combien de temps faut-il pour aller de Paris à Lyon en train ?"),
            assistant("", tool_calls=[tool_call(1, "get_distance", args)]),
            tool_result(1, result),
            assistant(
                f"En TGV, le trajet Paris–Lyon fait environ {result['distance_km']} km et dure à peu "
                f"près {h} h {m:02d}. Pensez à réserver à l'avance pour obtenir un meilleur prix."
            ),
        ],
        tools=[TOOL_DISTANCE, TOOL_WEATHER],
    )


def tool_two_cities() -> dict:
    lisbon = {"city": "Lisbon", "temperature": 19, "unit": "celsius", "condition": "sunny"}
    dublin = {"city": "Dublin", "temperature": 9, "unit": "celsius", "condition": "overcast with drizzle"}
    diff = lisbon["temperature"] - dublin["temperature"]
    return row(
        [
            user("I can't decide between Lisbon and Dublin for a weekend away. What's the weather like in each?"),
            assistant(
                "",
                tool_calls=[
                    tool_call(1, "get_weather", {"city": "Lisbon", "unit": "celsius"}),
                    tool_call(2, "get_weather", {"city": "Dublin", "unit": "celsius"}),
                ],
            ),
            tool_result(1, lisbon),
            tool_result(2, dublin),
            assistant(
                f"Right now Lisbon is {lisbon['temperature']} °C and sunny, while Dublin is "
                f"{dublin['temperature']} °C and {dublin['condition']}, a {diff}-degree difference. "
                "If sunshine matters most, Lisbon is the clear pick; Dublin is better if you're "
                "planning pubs and museums anyway."
            ),
        ],
        tools=[TOOL_WEATHER],
    )


def tool_rows() -> list[dict]:
    rows = [
        tool_weather_munich(),
        tool_currency(250, 0.92),
        tool_calculator(1250, 7),
        tool_time_tokyo(),
        tool_recipes(),
        tool_calendar(),
        tool_distance(),
        tool_two_cities(),
    ]
    assert len(rows) == 8
    return rows


# ---------------------------------------------------------------------------
# Assembly
# ---------------------------------------------------------------------------


def build_rows() -> list[dict]:
    groups = [
        single_turn_rows(),       # 20
        system_rows(),            # 6
        reasoning_single_rows(),  # 4
        non_ascii_rows(),         # 7
        multi_turn_rows(),        # 15
        tool_rows(),              # 8
    ]
    # Interleave the groups round-robin so that neighbouring rows differ in shape.
    rows: list[dict] = []
    longest = max(len(g) for g in groups)
    for i in range(longest):
        for g in groups:
            if i < len(g):
                rows.append(g[i])
    return rows


def main() -> None:
    rows = build_rows()
    assert len(rows) == 60, len(rows)
    OUTPUT_PATH.parent.mkdir(parents=True, exist_ok=True)
    with OUTPUT_PATH.open("w", encoding="utf-8", newline="\n") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"wrote {len(rows)} rows to {OUTPUT_PATH}")


if __name__ == "__main__":
    main()
