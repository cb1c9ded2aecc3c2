"""Generate the search_r1 corpus and questions from a seed: `python make_data.py SEED OUTDIR`.

Invented entities (countries, cities, rivers, companies, people) get facts (capital, founding year, flag
color, river, founder, headquarters, product, birthplace, invention, profession). Every fact is one short
document in `corpus.jsonl` (`{"id", "title", "text"}`), so a question can only be answered by finding it.
Questions have one checkable answer each; about a fifth are 2-hop (the country a person was born in, the
country of a company's headquarters, the birthplace of a company's founder). `train.jsonl` and `test.jsonl`
hold `{"input", "metadata": {"answer", "question", "hops", "id"}}` rows, disjoint.

The output depends only on SEED (Python's `random.Random`): the committed `data/` is
`python make_data.py 0 data`, and a unit test regenerates it byte for byte.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

SYLLABLES = ("ka", "vel", "tor", "mi", "ras", "lo", "den", "quo", "sen", "bar", "ti", "nor", "ul", "fen", "gri",
             "zan", "pe", "mok", "ith", "ar", "sol", "vin", "dra", "hu", "bel", "cor", "yst", "om", "lun", "ek")
COLORS = ("red", "blue", "green", "yellow", "purple", "orange", "white", "black", "silver", "teal")
NOUNS = ("engine", "lamp", "clock", "loom", "pump", "compass", "telescope", "kettle", "bridge", "press")
ADJECTIVES = ("glass", "steam", "copper", "folding", "silent", "floating", "mirror", "spiral", "solar", "paper")
PRODUCTS = ("bicycles", "umbrellas", "pianos", "tea", "ropes", "maps", "candles", "boats", "shoes", "radios")
JOBS = ("painter", "sailor", "chemist", "architect", "baker", "judge", "poet", "surgeon", "weaver", "pilot")
SIZES = {"countries": 12, "cities_per_country": 4, "companies": 50, "people": 70}
SPLITS = {"train": 200, "test": 50}
INSTRUCTION = ("Answer the question. Use the search tool to look facts up. Give only the final answer, inside "
               "<answer> and </answer>.\nQuestion: {question}")


class Names:
    """Unique invented names drawn from `rng`."""

    def __init__(self, rng: random.Random) -> None:
        self.rng, self.used = rng, set()

    def word(self) -> str:
        while True:
            name = "".join(self.rng.choice(SYLLABLES) for _ in range(self.rng.choice((2, 3)))).capitalize()
            if name not in self.used:
                self.used.add(name)
                return name

    def person(self) -> str:
        return f"{self.word()} {self.word()}"


def world(rng: random.Random) -> dict[str, list[dict]]:
    """Entities and their facts."""
    names = Names(rng)
    year = lambda: rng.randint(1500, 1990)  # noqa: E731
    countries = [{"name": names.word(), "founded": year(), "color": rng.choice(COLORS)}
                 for _ in range(SIZES["countries"])]
    cities = [{"name": names.word(), "country": c["name"], "river": names.word(), "founded": year()}
              for c in countries for _ in range(SIZES["cities_per_country"])]
    for country in countries:
        country["capital"] = rng.choice([c["name"] for c in cities if c["country"] == country["name"]])
    inventions = rng.sample([f"{a} {n}" for a in ADJECTIVES for n in NOUNS], SIZES["people"])
    people = [{"name": names.person(), "born": rng.choice(cities)["name"], "invention": inventions[i],
               "job": rng.choice(JOBS)} for i in range(SIZES["people"])]
    companies = [{"name": names.word(), "founder": rng.choice(people)["name"], "hq": rng.choice(cities)["name"],
                  "founded": year(), "product": rng.choice(PRODUCTS)} for _ in range(SIZES["companies"])]
    return {"countries": countries, "cities": cities, "people": people, "companies": companies}


def facts(w: dict[str, list[dict]]) -> list[tuple[str, str, str, str]]:
    """(title, document text, question, answer), one per fact."""
    out = []
    for c in w["countries"]:
        n = c["name"]
        out += [(n, f"{n} is a country. Its capital is {c['capital']}.", f"What is the capital of {n}?", c["capital"]),
                (n, f"The country {n} was founded in {c['founded']}.", f"In what year was the country {n} founded?",
                 str(c["founded"])),
                (n, f"The flag of {n} is {c['color']}.", f"What color is the flag of {n}?", c["color"])]
    for c in w["cities"]:
        n = c["name"]
        out += [(n, f"{n} is a city in {c['country']}.", f"In which country is the city of {n}?", c["country"]),
                (n, f"The river {c['river']} flows through {n}.", f"Which river flows through {n}?", c["river"]),
                (n, f"The city of {n} was founded in {c['founded']}.", f"In what year was the city of {n} founded?",
                 str(c["founded"]))]
    for p in w["people"]:
        n = p["name"]
        out += [(n, f"{n} was born in {p['born']}.", f"In which city was {n} born?", p["born"]),
                (n, f"{n} invented the {p['invention']}.", f"What did {n} invent?", f"the {p['invention']}"),
                (n, f"{n} works as a {p['job']}.", f"What is the profession of {n}?", p["job"])]
    for c in w["companies"]:
        n = c["name"]
        out += [(n, f"The company {n} was founded by {c['founder']}.", f"Who founded the company {n}?", c["founder"]),
                (n, f"The company {n} has its headquarters in {c['hq']}.", f"In which city is the headquarters of "
                 f"{n}?", c["hq"]),
                (n, f"The company {n} was founded in {c['founded']}.", f"In what year was the company {n} founded?",
                 str(c["founded"])),
                (n, f"The company {n} makes {c['product']}.", f"What does the company {n} make?", c["product"])]
    return out


def two_hop(w: dict[str, list[dict]]) -> list[tuple[str, str]]:
    """(question, answer) pairs that need two documents."""
    country_of = {c["name"]: c["country"] for c in w["cities"]}
    born = {p["name"]: p["born"] for p in w["people"]}
    out = [(f"In which country was {p['name']} born?", country_of[p["born"]]) for p in w["people"]]
    out += [(f"In which country is the headquarters of the company {c['name']}?", country_of[c["hq"]])
            for c in w["companies"]]
    out += [(f"In which city was the founder of the company {c['name']} born?", born[c["founder"]])
            for c in w["companies"]]
    return out


def generate(seed: int) -> dict[str, list[dict]]:
    """The corpus and the question splits for `seed`."""
    rng = random.Random(seed)
    w = world(rng)
    fact_rows = facts(w)
    corpus = [{"id": f"d{i:04d}", "title": t, "text": text} for i, (t, text, _, _) in enumerate(fact_rows)]
    one = [(q, a, 1) for _, _, q, a in fact_rows]
    two = [(q, a, 2) for q, a in two_hop(w)]
    total = sum(SPLITS.values())
    picked = rng.sample(one, total - total // 5) + rng.sample(two, total // 5)
    rng.shuffle(picked)
    out: dict[str, list[dict]] = {"corpus": corpus}
    start = 0
    for split, size in SPLITS.items():
        out[split] = [{"input": INSTRUCTION.format(question=q),
                       "metadata": {"answer": a, "question": q, "hops": hops, "id": f"{split}-{i:03d}"}}
                      for i, (q, a, hops) in enumerate(picked[start:start + size])]
        start += size
    return out


def write(seed: int, outdir: Path) -> list[Path]:
    """Write corpus.jsonl, train.jsonl and test.jsonl into `outdir`; returns their paths."""
    outdir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, rows in generate(seed).items():
        path = outdir / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        paths.append(path)
    return paths


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python make_data.py SEED OUTDIR   (the committed data: python make_data.py 0 data)")
    for written in write(int(sys.argv[1]), Path(sys.argv[2])):
        print(f"wrote {written} ({len(written.read_text(encoding='utf-8').splitlines())} rows)")
