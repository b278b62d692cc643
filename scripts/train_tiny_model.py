"""train_tiny_model.py: make `nanoserve-tiny`, the built-in model nanoserve serves with no download.

A fresh machine with no network should still show real text streaming back, so nanoserve ships a
model small enough for the wheel (~4 MB) and trains it here from nothing, on one CPU core, in about
9 minutes. The script is seeded and single-threaded by default: the same flags give the same model.

1. Corpus. A grammar in this file writes children's stories (names x animals x places x objects
   x seven plots, each sentence with variants: far too many to memorise, so the model has to
   generalise) and user/assistant dialogues in the chat format: story requests that the story
   then fits ("a story about a cat" -> the hero is a cat), greetings, questions about the story
   just told ("Where did Tom go?") and about the story world ("What does a duck say?").
2. Training. A byte-level BPE tokenizer (`tokenizers`; at most 2048 tokens, ~1500 in practice: by
   then every word of the grammar is one token) and a small Llama (LlamaForCausalLM: 4 layers,
   hidden 192, 6 query heads sharing 2 KV heads, tied embeddings, 1.9M parameters) trained with
   AdamW and a cosine schedule on packed rows, each starting at a document start, so a prompt at
   position 0 ("Once upon a time") is what the model trained on. A curriculum (train()) first
   teaches the model to copy a name from earlier in the text; without it, a model this small writes
   "there was a cat named Lily. ... One day, Tom ..." and ignores what the user asked for.
3. Output. An HF-format directory: config.json, model.safetensors (bfloat16), tokenizer.json and
   tokenizer_config.json with the chat template, generation_config.json, and training_report.json
   (held-out loss and perplexity on documents the model never trained on, and sample outputs).

Run:
    python scripts/train_tiny_model.py                # -> nanoserve/assets/nanoserve-tiny, ~9 min
    python scripts/train_tiny_model.py --steps 12 --copy-steps 4 --docs 1000 --out /tmp/tiny   # smoke run

The chat format (one special token per role, every turn closed by <|end|>, which is also EOS):

    <|user|>\nTell me a story about a cat.<|end|>\n<|assistant|>\nSure! Here is a story about a cat. ...<|end|>\n
"""

from __future__ import annotations

import argparse
import bisect
import functools
import json
import math
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path

END, SYSTEM, USER, ASSISTANT = "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"
SPECIAL_TOKENS = [END, SYSTEM, USER, ASSISTANT]  # ids 0..3, in this order
# Rendered by HF's apply_chat_template and, for the training corpus, by render_chat() below.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('role must be system, user or assistant, got ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
COPY_SEQ_LEN = 64  # row length of the warm-up steps (see train())
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "nanoserve" / "assets" / "nanoserve-tiny"

# ---------------------------------------------------------------------------------------------
# 1. The grammar
# ---------------------------------------------------------------------------------------------
GIRLS = "Lily Mia Anna Lucy Zoe Ella Ruby Rosa Sara Emma Nora Ivy Daisy Molly Sophie Grace Luna Kate Amy Hazel".split()
BOYS = "Tom Ben Sam Max Leo Tim Jack Finn Milo Oscar Jake Noah Bob Teddy Oliver Felix Hugo Eli Otto Peter".split()
NAMES = GIRLS + BOYS
# The grammar never puts a name (or kind) first in a story or a reply: byte-level BPE gives "Lily" at
# the start of a text and " Lily" after a space different ids, and a small model learns to copy a
# name back far faster when every mention is the same token.
# kind: (what it says, where it lives, what it eats)
ANIMALS = {
    "cat": ("says meow", "lives in a warm house", "fish and milk"),
    "dog": ("says woof", "lives in a house with its family", "bones and meat"),
    "bird": ("sings tweet tweet", "lives in a nest in a tree", "seeds and worms"),
    "rabbit": ("wiggles its nose and does not say much", "lives in a hole in the ground", "carrots"),
    "fox": ("says yip yip", "lives in a den in the forest", "berries and mice"),
    "bear": ("says grr", "lives in a big cave", "honey and berries"),
    "mouse": ("says squeak", "lives in a small hole in the wall", "cheese"),
    "frog": ("says ribbit", "lives near the pond", "flies and bugs"),
    "duck": ("says quack", "lives by the pond", "bread and seeds"),
    "owl": ("says hoo hoo", "lives in a tall tree", "bugs and mice"),
    "turtle": ("is very quiet", "lives near the water", "leaves and grass"),
    "lion": ("says roar", "lives where the grass is tall", "meat"),
    "pig": ("says oink", "lives on a farm", "apples and corn"),
    "horse": ("says neigh", "lives on a farm", "hay and apples"),
    "cow": ("says moo", "lives on a farm", "grass"),
    "sheep": ("says baa", "lives on a farm", "grass"),
    "squirrel": ("chatters in the trees", "lives in a tree", "nuts"),
    "hedgehog": ("sniffs and snuffles", "lives under the bushes", "bugs and berries"),
    "monkey": ("says ooh ooh", "lives in the jungle trees", "bananas"),
    "elephant": ("makes a loud trumpet sound", "lives where it is hot and sunny", "grass and fruit"),
    "goat": ("says maa", "lives on a farm", "grass and leaves"),
    "penguin": ("squawks", "lives where it is cold and icy", "fish"),
    "chicken": ("says cluck cluck", "lives on a farm", "seeds"),
    "dragon": ("says roar and blows smoke", "lives on a high mountain", "spicy peppers"),
}
ADJS = "little big brave shy kind curious happy sleepy clever tiny fluffy young gentle funny busy".split()
PLACES = ["the park", "the forest", "the garden", "the beach", "the farm", "the pond", "the big hill",
          "the village", "the meadow", "the river", "the lake", "the market", "the school", "the zoo",
          "the playground", "the library", "the old barn", "the snowy mountain", "the sunny field", "the town"]
OBJECTS = ["ball", "kite", "hat", "box", "key", "shell", "book", "drum", "boat", "balloon", "flower", "map",
           "lamp", "bell", "ring", "feather", "toy car", "teddy bear", "scarf", "bucket", "cup", "whistle",
           "umbrella", "crown", "robot", "doll"]
COLORS = "red blue green yellow pink purple orange white shiny soft new old little big".split()
FOODS = ["apples", "cookies", "berries", "carrots", "sandwiches", "cherries", "grapes", "little cakes",
         "nuts", "bananas", "pears", "muffins"]
TIMES = ["morning", "day", "afternoon", "evening", "sunny day", "windy day", "cold morning", "warm day"]
LIKES = ["play in the sun", "run and jump", "sing songs", "read books", "look at the stars", "dig in the sand",
         "paint pictures", "climb trees", "splash in puddles", "make new friends", "dance", "play hide and seek",
         "build things with sticks", "watch the clouds", "pick flowers"]
FRIEND_NAMED = 0.25  # share of stories whose friend has a name too (see story())
SAD, HAPPY = ["sad", "upset", "unhappy", "worried"], ["happy", "glad", "excited", "proud", "joyful"]
COLOR_OF = {"sky": "blue", "grass": "green", "sun": "yellow", "snow": "white", "night": "dark", "sea": "blue",
            "strawberry": "red", "banana": "yellow", "carrot": "orange", "cloud": "white", "leaf": "green"}


@dataclass
class Character:
    name: str
    kind: str
    female: bool
    adj: str
    named: bool = True  # an unnamed friend is "the dog": see story() for why most friends are unnamed

    @property
    def he(self): return "she" if self.female else "he"

    @property
    def his(self): return "her" if self.female else "his"

    @property
    def him(self): return "her" if self.female else "him"

    @property
    def ref(self): return self.name if self.named else f"the {self.kind}"  # "Ben" / "the dog"

    @property
    def Ref(self): return cap(self.ref)  # at the start of a sentence

    @property
    def intro(self): return f"{self.name} the {self.kind}" if self.named else a(f"{self.adj} {self.kind}")

    @property
    def call(self): return f", {self.name}" if self.named else ""  # "Thank you, Ben!" / "Thank you!"


def a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def cap(s: str) -> str:
    return s[0].upper() + s[1:]


def character(r: random.Random, kind: str | None = None, name: str | None = None,
              avoid: tuple = (), named: bool = True) -> Character:
    """A random character; kind may be an animal, 'girl' or 'boy'. `avoid`: names and kinds taken."""
    if kind is None:
        kind = r.choice([k for k in ANIMALS if k not in avoid] + ["girl", "boy"])
    if name is None:
        pool = GIRLS if kind == "girl" else BOYS if kind == "boy" else NAMES
        name = r.choice([n for n in pool if n not in avoid])
    female = name in GIRLS
    return Character(name, kind, female, r.choice(ADJS), named)


def intro(r: random.Random, h: Character, place: str) -> list[str]:
    first = r.choice([
        f"Once upon a time, there was {a(h.adj)} {h.kind} named {h.name}.",
        f"Once upon a time, there was {a(h.adj)} {h.kind} named {h.name}.",
        f"Once upon a time, {a(h.adj)} {h.kind} named {h.name} lived near {place}.",
        f"There was once {a(h.adj)} {h.kind} called {h.name}.",
        f"In a house near {place}, there lived {a(h.adj)} {h.kind} named {h.name}."])
    return [first, f"{cap(h.he)} loved to {r.choice(LIKES)}."]


def plot_lost(r, h, f, place, obj):
    H, color, feel = h.name, r.choice(COLORS), r.choice(HAPPY)
    what, why, fix = r.choice([
        ("A strong wind came and blew the {o} up into a tall tree.", "The {o} was stuck high up in the branches.",
         "{F} climbed up the tree and carefully brought the {o} back down."),
        ("The {o} fell into the water and floated away.", "The water was too deep for {H}.",
         "{F} jumped into the water, swam after the {o} and brought it back."),
        ("The {o} rolled down the hill and into a deep hole.", "{H} could not reach it, because the hole was too deep.",
         "{F} found a long stick and pulled the {o} out of the hole."),
        ("{H} put the {o} down to play, and then {he} could not find it.",
         "{H} looked everywhere, but the {o} was gone.", "{F} looked under a big bush and found the {o} there."),
        ("A noisy crow flew down, took the {o} and flew away to its nest.", "The nest was too high for {H} to reach.",
         "{F} asked the crow nicely, and the crow gave the {o} back.")])
    fill = dict(o=obj, H=H, F=f.Ref, he=h.he)
    return [f"One {r.choice(TIMES)}, {H} went to {place} with {h.his} {color} {obj}.", what.format(**fill),
            why.format(**fill),
            r.choice([f"{H} felt very {r.choice(SAD)}.", f"{H} was {r.choice(SAD)} because {h.his} {obj} was gone.",
                      f"Tears came to {h.his} eyes."]),
            r.choice([f"Just then, {f.intro} came by.", f"Then {f.intro} walked over."]),
            f"\"Why are you so sad, {H}?\" asked {f.ref}.",
            r.choice([f"\"My {obj} is gone!\" said {H}.", f"\"I lost my {obj},\" {H} said."]),
            f"\"Do not worry. I will help you,\" said {f.ref}.", fix.format(**fill),
            f"{H} was so {feel}. \"Thank you{f.call}!\" {h.he} said.",
            r.choice([f"From that day on, {H} and {f.ref} were best friends.",
                      f"After that, {H} always kept {h.his} {obj} close.",
                      f"{H} learned that it is good to have a friend who helps."])], feel


def plot_share(r, h, f, place, obj):
    H, food, feel = h.name, r.choice(FOODS), r.choice(HAPPY)
    return [f"One {r.choice(TIMES)}, {H} had a basket full of {food}.", f"{cap(h.he)} went to {place} to eat them.",
            f"At {place}, {H} saw {f.intro} sitting all alone.",
            f"{f.Ref} looked sad and hungry, because {f.he} had no food.",
            r.choice([f"{H} wanted to eat all the {food}, but then {h.he} thought about {f.ref}.",
                      f"{H} had an idea."]),
            f"\"Would you like some {food}?\" asked {H}.", f"\"Yes, please!\" said {f.ref} with a big smile.",
            f"They sat together under a big tree and ate the {food}.",
            f"The {food} tasted even better because they shared them.",
            f"{f.Ref} said, \"You are very kind, {H}.\"", f"{H} felt warm and {feel} inside.",
            r.choice([f"{H} learned that sharing makes everyone happy.",
                      f"From that day on, {H} and {f.ref} always shared their food."])], feel


def plot_noise(r, h, f, place, obj):
    H = h.name
    noise, source = r.choice([("Boom, boom", f"It was only {f.intro} playing a big drum!"),
                              ("Whoosh", "It was only the wind blowing through the trees."),
                              ("Crack", "It was only a little bird breaking a nut."),
                              ("Tap, tap, tap", "It was only the rain falling on the leaves."),
                              ("Bang", "It was only an old door moving in the wind.")])
    return [f"One evening, {H} was at {place} when {h.he} heard a strange noise.", f"\"{noise}!\" went the noise.",
            f"{H} felt scared. {cap(h.he)} wanted to run home.",
            f"But {H} was brave, so {h.he} took a deep breath and went to look.",
            source, f"{H} laughed and laughed.", f"{cap(h.he)} was not scared anymore.",
            r.choice([f"{H} learned that things are not always as scary as they seem.",
                      f"{H} learned that being brave is not so hard."])], "brave"


def plot_skill(r, h, f, place, obj):
    H = h.name
    skill, did = r.choice([("swim", "swam across the pond"), ("climb a tree", "climbed to the top of the tree"),
                           ("ride a bike", "rode the bike all by " + h.him + "self"),
                           ("fly a kite", "flew the kite high"),
                           ("jump over the log", "jumped over the log"), ("catch a ball", "caught the ball"),
                           ("whistle a song", "whistled a whole song"),
                           ("build a sand castle", "built a tall sand castle")])
    return [f"{H} wanted to learn how to {skill}.", f"{cap(h.his)} friends could all {skill}, but {H} could not.",
            f"One {r.choice(TIMES)}, {H} went to {place} to try.",
            f"{cap(h.he)} tried to {skill}, but {h.he} fell down.",
            f"{H} felt {r.choice(SAD)}.", f"Then {f.intro} saw {H} and came over.",
            f"\"Do not give up{', ' + H if r.random() < 0.5 else ''},\" said {f.ref}. "
            "\"Try again, and I will help you.\"",
            f"So {H} tried again and again.", f"Every day, {H} practiced with {f.ref}.", f"At last, {H} {did}!",
            f"\"I did it!\" shouted {H}.", f"{cap(h.he)} felt so proud.",
            f"{H} learned that if you keep trying, you can do hard things."], "proud"


def plot_rescue(r, h, f, place, obj):
    H, F = h.name, f.ref
    trouble, fix = r.choice([
        (f"{f.Ref} was stuck in the mud.", f"{H} held out a long branch, and {F} pulled on it until {f.he} was free."),
        (f"{f.Ref} was stuck high up in a tree and could not get down.",
         f"{H} ran to get a ladder, and {F} climbed down slowly."),
        (f"{f.Ref}'s leg was stuck under a heavy log.", f"{H} pushed and pushed until the log rolled away."),
        (f"{f.Ref} was lost and did not know the way home.", f"{H} walked with {F} all the way home.")])
    return [f"One {r.choice(TIMES)}, {H} was walking to {place}.", f"On the way, {h.he} heard someone crying for help.",
            f"It was {f.intro}!", trouble, f"\"Please help me!\" cried {F}.",
            r.choice([f"{H} wanted to help, because {h.he} was kind.",
                      f"{H} did not know what to do at first. Then {h.he} had an idea."]), fix,
            f"\"Thank you, {H}! You saved me,\" said {F}.", f"{H} felt happy that {h.he} could help.",
            r.choice([f"{H} learned that a good friend always helps.",
                      f"From that day on, {H} and {F} were best friends."])], "happy"


def plot_picnic(r, h, f, place, obj):
    H, food = h.name, r.choice(FOODS)
    idea = r.choice([f"\"Let us play in the rain!\" said {f.ref}. They jumped in big puddles and laughed.",
                     f"\"Let us have the picnic inside!\" said {f.ref}. They sat on the floor and ate the {food}.",
                     f"\"Let us wait under the big tree,\" said {f.ref}. They told stories until the rain stopped."])
    return [f"One {r.choice(TIMES)}, {H} and {h.his} friend, {f.intro}, wanted to have a picnic at {place}.",
            f"They packed some {food} and {a(obj)}.",
            "But when they got there, dark clouds came and it started to rain.",
            f"{H} was {r.choice(SAD)} because the picnic was ruined.", f"Then {f.ref} had an idea.", idea,
            "Soon the sun came out, and they saw a big rainbow in the sky.",
            f"{H} smiled. It was the best picnic ever.",
            f"{H} learned that a rainy day can still be a fun day."], "happy"


def plot_found(r, h, f, place, obj):
    H, color, feel = h.name, r.choice(COLORS), r.choice(HAPPY)
    other = character(r, avoid=(h.name, f.name, h.kind, f.kind), named=False)
    return [f"One {r.choice(TIMES)}, {H} was playing at {place}.", f"Under a bush, {h.he} found {a(color)} {obj}.",
            f"\"Whose {obj} is this?\" {H} wondered.",
            f"{cap(h.he)} wanted to keep it, but {h.he} knew it was not {'hers' if h.female else 'his'}.",
            f"{H} asked {other.intro}, \"Is this your {obj}?\"", f"\"No, it is not mine,\" said {other.ref}.",
            f"Then {H} saw {f.intro}.", f"{f.Ref} was looking everywhere and looked very worried.",
            f"\"Is this your {obj}?\" asked {H}.", f"\"Yes! I lost it this morning!\" said {f.ref}.",
            f"{f.Ref} was so {feel} that {f.he} gave {H} a big hug.",
            f"{H} learned that it feels good to be honest."], "happy"


PLOTS = {"lost": plot_lost, "share": plot_share, "noise": plot_noise, "skill": plot_skill,
         "rescue": plot_rescue, "picnic": plot_picnic, "found": plot_found}
THEMES = {"sharing": "share", "being brave": "noise", "trying again": "skill", "helping a friend": "rescue",
          "a rainy day": "picnic", "being honest": "found", "a lost toy": "lost"}


def story(r: random.Random, kind=None, name=None, place=None, obj=None, plot=None) -> tuple[str, dict]:
    """One story and its facts (for follow-up questions). Any argument left None is drawn at random.

    Only the hero always has a name. A small model learns to copy a name from earlier in the text
    quickly when one name is in play, and very slowly when it must also tell two names apart (which
    one goes in this slot?), so most friends are "a kind dog", then "the dog".
    """
    h = character(r, kind, name)
    f = character(r, avoid=(h.name, h.kind), named=r.random() < FRIEND_NAMED)
    place, obj = place or r.choice(PLACES), obj or r.choice(OBJECTS)
    body, feel = PLOTS[plot or r.choice(list(PLOTS))](r, h, f, place, obj)
    ending = " The end." if r.random() < 0.4 else ""
    return " ".join(intro(r, h, place) + body) + ending, dict(hero=h, friend=f, place=place, feel=feel)


def short_story(r: random.Random, kind=None, name=None) -> tuple[str, dict]:
    """A few sentences, each naming the hero, that repeat its kind and things: the first lesson of the
    curriculum (see train()), where nearly every word worth predicting is a copy of an earlier one."""
    h, place, feel = character(r, kind, name), r.choice(PLACES), r.choice(HAPPY + SAD)
    H, K, obj, other = h.name, h.kind, r.choice(OBJECTS), r.choice([k for k in ANIMALS if k != h.kind])
    middle = [f"{H} had {a(r.choice(COLORS))} {obj}. {H} played with the {obj} all day.",
              f"{H} loved to {r.choice(LIKES)}.", f"{H} saw {a(other)}. {H} said hello to the {other}.",
              f"{H} liked to eat {r.choice(FOODS)}.", f"{H} was a happy {K}."]
    text = " ".join([r.choice([f"There was {a(h.adj)} {K} named {H}.", f"Once there was {a(K)} named {H}."]),
                     f"One day, {H} went to {place}."] +
                    r.sample(middle, r.randrange(1, 4)) + [f"In the end, {H} the {K} felt {feel}."])
    return text, dict(hero=h, friend=None, place=place, feel=feel)


def follow_ups(r: random.Random, facts: dict, k: int) -> list[tuple[str, str]]:
    """k different questions about the story just told, with answers (the model must look back)."""
    h, f = facts["hero"], facts["friend"]
    return r.sample([q for q in [
        (f"What was the {h.kind}'s name?", f"The {h.kind}'s name was {h.name}."),
        (f"Where did {h.name} go?", f"In the story, {h.name} went to {facts['place']}."),
        (f"Who was {h.name}'s friend?", f"The friend of {h.name} was {f.intro}.") if f else None,
        (f"How did {h.name} feel at the end?", f"At the end, {h.name} felt {facts['feel']}."),
        (f"What kind of animal was {h.name}?" if h.kind in ANIMALS else f"Who was {h.name}?",
         f"In the story, {h.name} was {a(h.kind)}.")] if q], k)


def story_request(r: random.Random, short: bool) -> tuple[str, str, dict]:
    """A user's request, the fitting story (with an optional preface), and its facts."""
    kind = r.choice(list(ANIMALS) + ["girl", "boy"])
    # Mostly a kind of hero (0-2: 'about a cat'), which the story must then copy: the hardest part
    # for a small model. A short story has no place or theme to ask for.
    choice = r.choice([0, 1, 2, 3, 6] if short else [0, 1, 2, 0, 1, 2, 3, 4, 5, 6])
    if choice <= 2:
        ask, kw, about = f"about {a(kind)}", dict(kind=kind), a(kind)
    elif choice == 3:
        name = r.choice(GIRLS if kind == "girl" else BOYS if kind == "boy" else NAMES)
        ask, kw, about = f"about {a(kind)} named {name}", dict(kind=kind, name=name), name
    elif choice == 4:
        place = r.choice(PLACES)
        ask, kw, about = f"about {place}", dict(place=place), place
    elif choice == 5:
        theme = r.choice(list(THEMES))
        ask, kw, about = f"about {theme}", dict(plot=THEMES[theme]), theme
    else:
        ask, kw, about = "", {}, None
    ask = ("a short story " if short else "a story ") + ask
    user = r.choice([f"Tell me {ask}.", f"Can you tell me {ask}?", f"Please tell me {ask}.", f"I want {ask}.",
                     f"tell me {ask}", f"Write {ask}."]).replace(" .", ".").replace(" ?", "?")
    text, facts = (short_story if short else story)(r, **kw)
    # Mostly a preface that repeats the request: a short-range copy that teaches the model to look back.
    preface = r.choice(["", "Sure! "] + 3 * [f"Sure! Here is a story about {about}.\n\n" if about
                                             else "Okay! Here is a story.\n\n"])
    return user, preface + text, facts


def dialogue(r: random.Random, short: bool) -> list[dict]:
    """One chat: a story request, possibly after a greeting and before follow-ups, or a small talk turn."""
    msgs = []
    if r.random() < 0.15:
        msgs.append(dict(role="system", content=r.choice(["You are a friendly storyteller.",
                                                          "You are nanoserve-tiny, a small helpful assistant."])))
    kind, user_name, told_name = r.random(), r.choice(NAMES), r.random() < 0.5
    if kind < 0.25:
        animals = r.sample(list(ANIMALS), 3)
        if told_name:
            hello = r.choice([f"Hi! My name is {user_name}.", f"Hello, I am {user_name}."])
            greet = f"Hello, {user_name}!"
        else:
            hello, greet = r.choice(["Hi!", "Hello.", "Hello!", "Good morning!", "Hey there!"]), "Hello!"
        msgs += [dict(role="user", content=hello),
                 dict(role="assistant", content=f"{greet} I am nanoserve-tiny. I love to tell stories. Would you "
                      f"like a story about {a(animals[0])}, {a(animals[1])} or {a(animals[2])}?")]
    if kind < 0.8:
        user, reply, facts = story_request(r, short)
        msgs += [dict(role="user", content=user), dict(role="assistant", content=reply)]
        for q, ans in follow_ups(r, facts, r.choice([0, 1, 2, 2, 3])):
            msgs += [dict(role="user", content=q), dict(role="assistant", content=ans)]
        if kind < 0.25 and told_name and r.random() < 0.5:  # the user's name, said many turns ago
            msgs += [dict(role="user", content="What is my name?"),
                     dict(role="assistant", content=f"Your name is {user_name}.")]
        if r.random() < 0.2:
            msgs += [dict(role="user", content=r.choice(["Thank you!", "Thanks!", "I liked it."])),
                     dict(role="assistant", content="You are welcome! I am glad you liked the story.")]
        return msgs
    animal, thing = r.choice(list(ANIMALS)), r.choice(list(COLOR_OF))
    says, lives, eats = ANIMALS[animal]
    q, ans = r.choice([(f"What does {a(animal)} say?", f"{cap(a(animal))} {says}."),
                       (f"Where does {a(animal)} live?", f"{cap(a(animal))} {lives}."),
                       (f"What does {a(animal)} eat?", f"{cap(a(animal))} likes to eat {eats}."),
                       (f"What color is the {thing}?", f"The {thing} is {COLOR_OF[thing]}."),
                       ("Who are you?", "I am nanoserve-tiny, a very small model that tells short stories."),
                       ("What is your name?", "My name is nanoserve-tiny."),
                       ("What can you do?", "I can tell you short stories about animals, friends and adventures.")])
    return msgs + [dict(role="user", content=q), dict(role="assistant", content=ans)]


@functools.lru_cache(maxsize=1)
def _compiled_template():
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(CHAT_TEMPLATE)


def render_chat(messages: list[dict]) -> str:
    """The chat template rendered the way transformers renders it (sandboxed jinja2, trim/lstrip blocks)."""
    return _compiled_template().render(messages=messages, add_generation_prompt=False)


def corpus(seed: int, n_docs: int, short: float = 0.2, chat_fraction: float = 0.7) -> list[str]:
    """n_docs documents, each closed by <|end|>: raw stories and rendered chats; `short`: share of short stories."""
    r = random.Random(seed)
    return [render_chat(dialogue(r, r.random() < short)) if r.random() < chat_fraction
            else (short_story if r.random() < short else story)(r)[0] + END for _ in range(n_docs)]


def vocabulary(n_docs: int = 3000, seed: int = 1234) -> set[str]:
    """Lower-case words the grammar writes (tests check that generated text is made of them)."""
    text = re.sub(r"<\|\w+\|>", " ", " ".join(corpus(seed, n_docs)))  # drop the special tokens
    return set(re.findall(r"[a-z]+", text.lower()))


# ---------------------------------------------------------------------------------------------
# 2. Tokenizer and model
# ---------------------------------------------------------------------------------------------
def train_tokenizer(docs: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer)
    # bos = eos = <|end|>: an engine that prepends BOS gives the model "<|end|>Once upon", which is
    # exactly what it saw between packed documents; one that does not gives it a row start.
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=END, eos_token=END, pad_token=END,
                                   chat_template=CHAT_TEMPLATE, model_max_length=512,
                                   clean_up_tokenization_spaces=False)


def pack(token_docs: list[list[int]], seq_len: int) -> "torch.Tensor":
    """Rows of seq_len + 1 tokens from the concatenated documents, each starting at a document start.

    Each next row starts at the last document start that the previous row reached, so a document cut
    by a row's end is seen whole in the next row. Docs of 5, 4, 6, 3, 9 tokens start at 0, 5, 9, 15, 18;
    with seq_len 7 (rows of 8) the rows start at 0, 5, 9, 15 and 18 (row 0 = tokens 0..7, cut in doc 1).
    """
    import torch
    stream = [t for d in token_docs for t in d]
    starts, pos = [], 0
    for d in token_docs:
        starts.append(pos)
        pos += len(d)
    rows, s = [], 0
    while s + seq_len + 1 <= len(stream):
        rows.append(stream[s:s + seq_len + 1])
        nxt = starts[bisect.bisect_right(starts, s + seq_len) - 1]
        s = nxt if nxt > s else s + seq_len  # a document longer than a row is cut in row-sized pieces
    return torch.tensor(rows, dtype=torch.long)


def make_model(vocab_size: int, args: argparse.Namespace):
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    end_id = SPECIAL_TOKENS.index(END)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                      max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=True,
                      bos_token_id=end_id, eos_token_id=end_id, pad_token_id=end_id)
    model = LlamaForCausalLM(cfg)
    model.generation_config = GenerationConfig(bos_token_id=end_id, eos_token_id=end_id, pad_token_id=end_id)
    return model


def heldout_loss(model, token_docs: list[list[int]], batch_size: int = 16) -> float:
    """Mean next-token cross-entropy (nats) over every token after the first of each held-out document."""
    import torch
    import torch.nn.functional as F
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for i in range(0, len(token_docs), batch_size):
            docs = [d[:512] for d in token_docs[i:i + batch_size]]
            width = max(len(d) for d in docs)
            ids = torch.zeros(len(docs), width, dtype=torch.long)
            labels = torch.full((len(docs), width), -100, dtype=torch.long)
            for j, d in enumerate(docs):
                ids[j, :len(d)] = torch.tensor(d)
                labels[j, :len(d)] = torch.tensor(d)
            # Right padding under a causal mask never changes the real positions' logits.
            logits = model(input_ids=ids).logits[:, :-1].float()
            total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                     ignore_index=-100, reduction="sum").item()
            count += int((labels[:, 1:] != -100).sum())
    model.train()
    return total / count


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def train(model, warm_rows, rows, args: argparse.Namespace) -> tuple[float, float]:
    """AdamW with a cosine schedule: args.copy_steps batches of warm_rows (short rows of short stories),
    then batches of rows (each set shuffled, reshuffled every epoch). Returns (final train loss, seconds).

    Why the curriculum: the stories need the model to look back and copy a name ("... a cat named
    Lily. ... One day, Lily ..."). On full stories in long rows a model this small settles on
    grammar and local patterns first, then guesses names for thousands of steps; on short stories in
    64-token rows, where most words worth predicting are copies, it learns to copy within ~150 steps,
    and the skill carries over to the long rows.
    """
    import torch
    import torch.nn.functional as F
    decay = [p for p in model.parameters() if p.dim() >= 2]  # matrices; norms' gains are not decayed
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(args.seed)

    def batches(source, n_steps):  # the same number of tokens per step, whatever the row length
        size = args.batch_size * args.seq_len // (source.shape[1] - 1)
        order = torch.cat([torch.randperm(len(source), generator=g)
                           for _ in range(math.ceil(n_steps * size / len(source)))])
        return [source[order[i * size:(i + 1) * size]] for i in range(n_steps)]

    plan = batches(warm_rows, args.copy_steps) if args.copy_steps else []
    plan += batches(rows, args.steps - args.copy_steps)
    t0, recent = time.time(), []
    for step, batch in enumerate(plan):
        logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        opt.step()
        opt.zero_grad(set_to_none=True)
        recent = (recent + [loss.item()])[-20:]
        if step % 25 == 0 or step == args.steps - 1:
            dt = time.time() - t0
            print(f"step {step:5d}/{args.steps} loss {sum(recent) / len(recent):.4f} lr {lr_at(step, args):.2e} "
                  f"{(step + 1) * batch[:, 1:].numel() / dt:.0f} tok/s {dt:.0f}s", flush=True)
    return sum(recent) / len(recent), time.time() - t0


def samples(model, tokenizer) -> dict:
    """Greedy outputs for the two prompts the quality bar names."""
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a story about a cat."}],
                                         add_generation_prompt=True, tokenize=False)
    out = {}
    for name, prompt in [("story", "Once upon a time"), ("chat", chat)]:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        gen = model.generate(ids, max_new_tokens=160, do_sample=False)
        out[name] = {"prompt": prompt, "completion": tokenizer.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)}
    return out


# ---------------------------------------------------------------------------------------------
# 3. Main: corpus -> tokenizer -> model -> HF directory
# ---------------------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory (HF format)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: deterministic, polite)")
    p.add_argument("--docs", type=int, default=16000, help="documents generated (2%% held out)")
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=192)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--steps", type=int, default=1600)
    p.add_argument("--copy-steps", type=int, default=300, help="first steps on short stories (see train())")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=50)
    args = p.parse_args()
    for field in ("docs", "vocab_size", "hidden", "layers", "heads", "kv_heads", "steps", "batch_size", "seq_len",
                  "threads"):
        if getattr(args, field) <= 0:
            raise ValueError(f"{field} must be positive (got {getattr(args, field)})")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        raise ValueError("hidden must divide by heads, and heads by kv_heads")
    if not 0 <= args.copy_steps < args.steps:
        raise ValueError(f"copy_steps must be in [0, steps) (got {args.copy_steps})")
    if args.seq_len > 512:
        raise ValueError(f"seq_len must be at most max_position_embeddings 512 (got {args.seq_len})")

    import torch
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_start = time.time()

    docs = corpus(args.seed, args.docs)
    n_held = max(1, len(docs) // 50)
    train_docs, held_docs = docs[:-n_held], docs[-n_held:]
    tokenizer = train_tokenizer(train_docs, args.vocab_size)
    encode = lambda ds: [e.ids for e in tokenizer.backend_tokenizer.encode_batch(ds, add_special_tokens=False)]
    train_tok, held_tok = encode(train_docs), encode(held_docs)
    rows = pack(train_tok, args.seq_len)
    # About one pass over the short stories in the warm-up steps (a 64-token row holds about one).
    n_warm = args.copy_steps * args.batch_size * args.seq_len // COPY_SEQ_LEN + 100
    warm_rows = pack(encode(corpus(args.seed + 1, n_warm, short=1.0, chat_fraction=0.0)), COPY_SEQ_LEN)
    n_train_tokens = sum(map(len, train_tok))
    print(f"corpus: {len(train_docs)} train docs ({n_train_tokens} tokens, {len(rows)} rows of {args.seq_len}), "
          f"{len(held_docs)} held-out docs; vocab {len(tokenizer)}; "
          f"{time.time() - t_start:.0f}s", flush=True)

    model = make_model(len(tokenizer), args)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters; {args.steps} steps x {args.batch_size} x {args.seq_len} "
          f"= {args.steps * args.batch_size * args.seq_len / 1e6:.2f}M tokens", flush=True)
    train_loss, train_s = train(model, warm_rows, rows, args)

    loss_fp32 = heldout_loss(model, held_tok)
    model.to(torch.bfloat16).to(torch.float32)  # round to the weights that are shipped, evaluate those
    loss = heldout_loss(model, held_tok)
    out = samples(model, tokenizer)

    args.out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(args.out)
    tokenizer.save_pretrained(args.out, save_jinja_files=False)  # keep chat_template in tokenizer_config.json
    # transformers 5 names the class TokenizersBackend; the older name loads in 4.x and 5.x alike.
    tok_cfg = json.loads((args.out / "tokenizer_config.json").read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    (args.out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    disk = sum(f.stat().st_size for f in args.out.iterdir() if f.is_file())
    report = {
        "parameters": n_params, "steps": args.steps, "copy_steps": args.copy_steps,
        "tokens_seen": args.steps * args.batch_size * args.seq_len,
        "train_docs": len(train_docs), "train_corpus_tokens": n_train_tokens, "heldout_docs": len(held_docs),
        "heldout_tokens": sum(len(d) - 1 for d in held_tok), "train_loss_last20": round(train_loss, 4),
        "heldout_loss": round(loss, 4), "heldout_perplexity": round(math.exp(loss), 4),
        "heldout_loss_fp32_before_rounding": round(loss_fp32, 4), "training_seconds": round(train_s, 1),
        "total_seconds": round(time.time() - t_start, 1), "threads": args.threads, "seed": args.seed,
        "samples": out, "args": {k: str(v) for k, v in vars(args).items() if k != "out"},
    }
    (args.out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    disk += (args.out / "training_report.json").stat().st_size
    print(f"held-out loss {loss:.4f} (perplexity {math.exp(loss):.3f}); fp32 before bf16 rounding {loss_fp32:.4f}")
    print(f"saved {args.out} ({disk / 1e6:.2f} MB); total {time.time() - t_start:.0f}s")
    for name, s in out.items():
        print(f"--- {name} ---\n{s['prompt']}{s['completion']}")


if __name__ == "__main__":
    main()
