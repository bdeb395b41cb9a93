"""Programmatic instruction prompts for training the default draft model.

Builds a few thousand varied user instructions (templates x topics, with random
numbers for math problems and composed paragraphs for summarisation). Nothing here
comes from Spec-Bench or from ``sample_data``: every prompt is produced by the code
below from a fixed seed, so a rerun yields the same list.
"""

from __future__ import annotations

import random

TOPICS = [
    "photosynthesis", "black holes", "the water cycle", "climate change", "the French Revolution",
    "machine learning", "the human heart", "volcanoes", "the stock market", "vaccines",
    "the internet", "renewable energy", "plate tectonics", "the Roman Empire", "democracy",
    "inflation", "DNA", "the immune system", "gravity", "electricity", "magnetism",
    "the solar system", "quantum computing", "blockchain", "the Renaissance", "evolution",
    "the printing press", "antibiotics", "coral reefs", "rainforests", "deserts", "glaciers",
    "the moon landing", "artificial intelligence", "cloud computing", "recycling",
    "the Great Wall of China", "the Industrial Revolution", "sleep", "nutrition", "meditation",
    "social media", "cryptography", "earthquakes", "hurricanes", "bees", "honey", "coffee",
    "tea", "chocolate", "the Olympic Games", "jazz music", "classical music", "impressionism",
    "the theory of relativity", "supply and demand", "compound interest", "the periodic table",
    "batteries", "solar panels", "wind turbines", "electric cars", "airplanes", "submarines",
    "satellites", "the Silk Road", "ancient Egypt", "the pyramids", "Shakespeare",
    "the human brain", "memory", "language learning", "photography", "gardening", "composting",
    "bread baking", "fermentation", "the ocean tides", "rainbows", "thunderstorms", "snowflakes",
    "the speed of light", "sound waves", "microplastics", "urban planning", "public transport",
    "libraries", "the scientific method", "statistics", "probability", "prime numbers",
    "the Pythagorean theorem", "calculus", "operating systems", "databases", "compilers",
    "version control", "open source software", "password security", "email etiquette",
    "time management", "remote work", "teamwork", "leadership", "negotiation", "public speaking",
    "budgeting", "saving for retirement", "healthy habits", "running", "yoga", "chess",
    "board games", "video games", "film making", "novels", "poetry", "mythology",
    "the Vikings", "the Aztecs", "the Cold War", "the United Nations", "human rights",
    "volunteering", "pets", "dogs", "cats", "horses", "dinosaurs", "fossils", "mushrooms",
    "trees", "wetlands", "mountains", "rivers", "islands", "maps", "compasses", "clocks",
    "the calendar", "money", "banks", "taxes", "elections", "newspapers", "radio", "television",
    "smartphones", "3D printing", "robots", "self-driving cars", "space stations", "Mars",
    "Jupiter", "comets", "telescopes", "microscopes", "cells", "viruses", "bacteria",
]

PAIRS = [
    ("cats", "dogs"), ("tea", "coffee"), ("Python", "JavaScript"), ("solar power", "wind power"),
    ("trains", "planes"), ("books", "movies"), ("city life", "country life"), ("renting", "buying a home"),
    ("stocks", "bonds"), ("weather", "climate"), ("viruses", "bacteria"), ("mitosis", "meiosis"),
    ("democracy", "monarchy"), ("RAM", "storage"), ("TCP", "UDP"), ("lists", "tuples in Python"),
    ("running", "swimming"), ("summer", "winter"), ("the Sun", "the Moon"), ("oceans", "lakes"),
    ("email", "instant messaging"), ("paper books", "e-readers"), ("baking", "frying"),
    ("electric cars", "gasoline cars"), ("classical music", "rock music"), ("Mars", "Venus"),
    ("speed", "velocity"), ("weight", "mass"), ("a virus", "a worm in computing"),
    ("learning alone", "learning in a group"), ("SQL", "NoSQL databases"), ("frogs", "toads"),
]

ACTIVITIES = [
    "learning a new language", "studying for exams", "cooking at home", "staying focused",
    "writing clean code", "running a marathon", "sleeping better", "saving money",
    "starting a small business", "making friends in a new city", "reducing stress",
    "keeping houseplants alive", "preparing for a job interview", "travelling on a budget",
    "organising a closet", "learning to draw", "improving handwriting", "eating healthier",
    "reading more books", "giving a presentation", "planning a birthday party",
    "working from home", "training a puppy", "learning to swim", "camping in the mountains",
]

CHARACTERS = [
    "a curious robot", "a young wizard", "an old fisherman", "a brave mouse", "a lonely astronaut",
    "a clever detective", "a shy dragon", "a little girl named Mia", "a retired teacher",
    "a talking tree", "a lost puppy", "a pirate captain", "a baker named Sam", "two best friends",
    "a time traveller", "a knight without a horse", "a musician in Paris", "a penguin",
]

EVENTS = [
    "finds a mysterious map", "learns to fly", "discovers a hidden door", "loses their way home",
    "meets a stranger at the train station", "wins an unexpected prize", "builds a machine",
    "has to save the village", "wakes up in the future", "opens a small shop",
    "finds a message in a bottle", "tries to make a new friend", "enters a baking contest",
    "gets stuck in an elevator", "plants a magic seed",
]

RECIPIENTS = [
    "my manager", "a colleague", "a customer", "my landlord", "a professor", "my team",
    "a hotel", "a friend", "a job recruiter", "the school principal", "a neighbour",
]

EMAIL_SUBJECTS = [
    "asking for a day off", "a delayed project", "a broken heater", "rescheduling a meeting",
    "thanking them for their help", "a job application", "a refund request", "a team lunch",
    "a new product launch", "a noisy party", "requesting feedback", "an upcoming deadline",
]

CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "computes the factorial of n",
    "returns the n-th Fibonacci number", "counts the vowels in a sentence",
    "finds the largest element in a list", "removes duplicates from a list while keeping order",
    "checks whether a word is a palindrome", "sorts a list of dictionaries by a key",
    "reads a CSV file and prints the number of rows", "converts Celsius to Fahrenheit",
    "merges two sorted lists", "computes the average of a list of numbers",
    "counts word frequencies in a text", "flattens a nested list", "implements binary search",
    "validates an email address with a regular expression", "returns the greatest common divisor",
    "generates all subsets of a set", "transposes a matrix", "checks if two strings are anagrams",
    "finds the second smallest number in a list", "implements a simple stack class",
    "converts a Roman numeral to an integer", "computes the sum of digits of a number",
]

SENTENCES = [
    "The weather is beautiful today.", "I would like a cup of coffee, please.",
    "Where is the nearest train station?", "My brother works in a hospital.",
    "We are going to the beach this weekend.", "This book is very interesting.",
    "Can you help me find my keys?", "The meeting starts at nine o'clock.",
    "I have been learning to play the guitar.", "The children are playing in the garden.",
    "Thank you very much for the lovely dinner.", "How much does this jacket cost?",
    "The museum is closed on Mondays.", "She reads a newspaper every morning.",
]

LANGUAGES = ["French", "Spanish", "German", "Italian", "Portuguese"]

FACT_SENTENCES = [
    "{t} has been studied by scientists for many decades.",
    "Many people first learn about {t} at school.",
    "Recent research suggests that {t} is more complex than once believed.",
    "Experts often disagree about the best way to explain {t}.",
    "{t} affects daily life in ways that most people rarely notice.",
    "Public interest in {t} has grown rapidly in the last few years.",
    "Some museums now have whole exhibitions dedicated to {t}.",
    "Teachers say that simple examples make {t} much easier to understand.",
    "Critics argue that the importance of {t} is sometimes exaggerated.",
    "A growing number of online courses now cover {t}.",
]

QUESTIONS = [
    "What is the capital of {c}?", "What language is spoken in {c}?",
    "What is {c} famous for?", "Describe the climate of {c}.",
]

COUNTRIES = [
    "France", "Japan", "Brazil", "Canada", "Egypt", "India", "Kenya", "Mexico", "Norway",
    "Australia", "Italy", "Germany", "Spain", "Chile", "Thailand", "Peru", "Greece", "Vietnam",
]


def _math_problem(rng: random.Random) -> str:
    a, b, c = rng.randint(3, 60), rng.randint(2, 40), rng.randint(2, 9)
    price = rng.randint(2, 25)
    name = rng.choice(["Tom", "Anna", "Luis", "Priya", "Kenji", "Sara", "Omar", "Lena"])
    item = rng.choice(["apples", "pencils", "books", "stickers", "marbles", "cookies", "cards"])
    forms = [
        f"{name} has {a} {item} and buys {b} more. Then {name} gives away {c}. How many {item} does {name} have now?",
        f"A shop sells {item} for ${price} each. {name} buys {c} of them and pays with a ${price * c + b} bill. How much change does {name} get?",
        f"A train travels {a * 10} km in {c} hours. What is its average speed?",
        f"{name} saves ${b} every week. How many weeks will it take to save ${b * a}?",
        f"A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
        f"There are {a + b} students in a class and {a} of them are girls. What percentage of the class are boys?",
        f"If {c} workers can build a wall in {a} days, how long would it take {c * 2} workers?",
        f"Solve for x: {c}x + {b} = {c * a + b}.",
        f"What is {a} multiplied by {b}, plus {price}?",
        f"A recipe needs {c} eggs for {b} cookies. How many eggs are needed for {b * c} cookies?",
    ]
    return rng.choice(forms) + rng.choice(["", " Explain your reasoning step by step.", " Show your work."])


def _draw(rng: random.Random) -> str:
    """One instruction: a kind (16 equally likely), then its template and fillers."""
    n_words = ["three", "four", "five"]
    kind = rng.randrange(16)
    t = rng.choice(TOPICS)
    if kind == 0:
        return rng.choice([
            f"Explain {t} in simple terms.", f"What is {t}?", f"How does {t} work?",
            f"Why is {t} important?", f"Explain {t} to a ten-year-old.",
            f"Give a short overview of {t}.",
        ])
    if kind == 1:
        a, b = rng.choice(PAIRS)
        return rng.choice([f"Compare {a} and {b}.", f"What are the differences between {a} and {b}?",
                           f"Which is better, {a} or {b}? Give pros and cons."])
    if kind == 2:
        return rng.choice([f"List {rng.choice(n_words)} interesting facts about {t}.",
                           f"Give me {rng.choice(n_words)} tips for {rng.choice(ACTIVITIES)}.",
                           f"What are the main advantages and disadvantages of {t}?"])
    if kind == 3:
        return f"Write a short story about {rng.choice(CHARACTERS)} who {rng.choice(EVENTS)}."
    if kind == 4:
        return f"Write an email to {rng.choice(RECIPIENTS)} about {rng.choice(EMAIL_SUBJECTS)}."
    if kind == 5:
        return rng.choice([f"Write a poem about {t}.", f"Write a haiku about {t}.",
                           f"Write a limerick about {rng.choice(CHARACTERS)}."])
    if kind == 6:
        return rng.choice([f"Write a Python function that {rng.choice(CODE_TASKS)}.",
                           f"Write Python code that {rng.choice(CODE_TASKS)}, and explain it briefly."])
    if kind in (7, 8):
        return _math_problem(rng)
    if kind == 9:
        return f"Translate into {rng.choice(LANGUAGES)}: \"{rng.choice(SENTENCES)}\""
    if kind == 10:
        sents = rng.sample(FACT_SENTENCES, 4)
        para = " ".join(s.format(t=t).capitalize() if s.startswith("{t}") else s.format(t=t) for s in sents)
        return rng.choice(["Summarize the following paragraph:\n\n", "Summarise this text in one sentence:\n\n",
                           "What is the main idea of this paragraph?\n\n"]) + para
    if kind == 11:
        act = rng.choice(ACTIVITIES)
        return rng.choice([f"How can I get better at {act}?", f"Give me advice on {act}.",
                           f"I am struggling with {act}. What should I do?"])
    if kind == 12:
        return rng.choice(QUESTIONS).format(c=rng.choice(COUNTRIES))
    if kind == 13:
        return rng.choice([f"Write a short blog post introduction about {t}.",
                           f"Write a product description for a book about {t}.",
                           f"Write a tweet about {t}."])
    if kind == 14:
        return rng.choice([f"What are common misconceptions about {t}?",
                           f"What is the history of {t}?", f"How has {t} changed the world?"])
    return rng.choice([f"Create a quiz with three questions about {t}.",
                       f"Describe a day in the life of {rng.choice(CHARACTERS)}.",
                       f"Write a dialogue between {rng.choice(CHARACTERS)} and {rng.choice(CHARACTERS)}."])

def build_prompts(n: int = 3000, seed: int = 1234) -> list[str]:
    """Return ``n`` distinct user instructions (deterministic for a given seed).

    Distinct prompts drift from the kinds' equal shares as ``n`` grows: the small templates run out of new
    fillers first, so past a few thousand most new prompts are arithmetic problems and summaries."""
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[str] = []
    tries = 0
    while len(out) < n and tries < n * 50:
        tries += 1
        p = _draw(rng)
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out


def draw_prompts(n: int, seed: int) -> list[str]:
    """``n`` independent draws, repeats allowed: the kinds keep their equal shares however large ``n`` is.

    For sampled answers only (a repeated prompt gets a new answer; a greedy one would repeat itself)."""
    rng = random.Random(seed)
    return [_draw(rng) for _ in range(n)]


if __name__ == "__main__":
    ps = build_prompts()
    print(len(ps))
    for p in ps[:20]:
        print("-", p)
