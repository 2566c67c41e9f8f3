"""A deterministic synthetic multi-domain corpus, written from scratch (no external data).

Six domains (:data:`DOMAINS`) each have their own vocabulary (agents, things, places, verbs with their inflected
forms, adjectives, adverbs and a few domain-only lists such as sports teams or drugs) and their own sentence
templates with learnable structure:

* subject-verb agreement (``the chef stirs`` / ``the chefs stir``), ``a``/``an`` before vowels, number agreement
  of units (``1 cup`` / ``3 cups``), ``does not`` + base form, ``shall`` + base form;
* numbers with domain-typical ranges and constraints (a sports winner's score is higher than the loser's, a
  9-judge court splits 5-4 .. 9-0, a draw repeats the same score, oven temperatures 150-220, body temperatures
  36-40);
* lists (``x , y and z``) and document-level coherence: each document draws a small subset of its domain's words
  and its sentences reuse them.

Function words, numbers and punctuation are shared by all domains (and one unit, ``degrees``, by cooking and
medicine); about 43% of the tokens are domain-specific words. Text is lower-case with every token separated by
one space, so the word-level tokenizer from :func:`build_tokenizer` round-trips it exactly
(``decode(encode(doc)) == doc``).

Everything is deterministic: a document stream is seeded from ``(split, domain, seed)`` through SHA-256 (never
Python's salted ``hash``), and streams are prefix-stable (the first ``n`` documents do not depend on how many are
asked for).
"""

from __future__ import annotations

import functools
import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

__all__ = [
    "DOMAINS",
    "SPLITS",
    "EOS_TOKEN",
    "UNK_TOKEN",
    "DEFAULT_CORPUS_CHARS",
    "Document",
    "generate_documents",
    "corpus_text",
    "corpus_documents",
    "vocabulary",
    "domain_vocabulary",
    "build_tokenizer",
]

DOMAINS: tuple[str, ...] = ("cooking", "astronomy", "law", "sports", "music", "medicine")
SPLITS: tuple[str, ...] = ("train", "valid", "test")
EOS_TOKEN = "<|endoftext|>"
UNK_TOKEN = "<unk>"
DEFAULT_CORPUS_CHARS = 200_000
DOC_SEPARATOR = "\n\n"


@dataclass(frozen=True)
class Document:
    """One document: several sentences of a single domain."""

    domain: str
    text: str


# --------------------------------------------------------------------------------------------------------------
# Shared words
# --------------------------------------------------------------------------------------------------------------
PUNCTUATION: tuple[str, ...] = (".", ",", ";", "?")
NUMBERS: tuple[str, ...] = tuple(str(i) for i in range(41)) + tuple(
    str(i) for i in (45, 50, 60, 75, 90, 100, 120, 150, 180, 200, 220, 250, 500, 1000)
)
_FUNCTION_WORDS = (
    "the a an this that these those some many every each all of and or but because while then also later first "
    "after in on at with for from to by into near against about under is are was were has have does do did not "
    "should can will it they them there very often never always usually today yesterday new old good their "
    "last per between"
).split()

_SG_DETS = ("the", "the", "the", "a", "a", "this", "that", "every", "each")
_PL_DETS = ("the", "the", "the", "these", "those", "some", "many", "all")
_PREPS = ("in", "at", "near", "on", "in", "at")
_SHARED_ADJS = ("new", "old", "good")
_CONNECTORS = (("then", ","), ("also", ","), ("later", ","), ("today", ","), ("yesterday", ","))
_FREQ_ADVS = ("often", "never", "always", "usually")


# --------------------------------------------------------------------------------------------------------------
# Morphology (regular rules; irregular forms are written in the word lists as "base:plural" or
# "base:3sg:past" with empty fields meaning "regular")
# --------------------------------------------------------------------------------------------------------------
def _s_form(w: str) -> str:
    if w.endswith(("s", "sh", "ch", "x", "z")):
        return w + "es"
    if w.endswith("y") and w[-2] not in "aeiou":
        return w[:-1] + "ies"
    return w + "s"


def _past(w: str) -> str:
    if w.endswith("e"):
        return w + "d"
    if w.endswith("y") and w[-2] not in "aeiou":
        return w[:-1] + "ied"
    return w + "ed"


def _nouns(spec: str) -> tuple[tuple[str, str], ...]:
    out = []
    for item in spec.split():
        parts = item.split(":")
        out.append((parts[0], parts[1] if len(parts) > 1 and parts[1] else _s_form(parts[0])))
    return tuple(out)


def _verbs(spec: str) -> tuple[tuple[str, str, str], ...]:
    """(base, 3rd person singular, past)"""
    out = []
    for item in spec.split():
        parts = item.split(":") + ["", ""]
        base = parts[0]
        out.append((base, parts[1] or _s_form(base), parts[2] or _past(base)))
    return tuple(out)


def _words(spec: str) -> tuple[str, ...]:
    return tuple(spec.split())


# --------------------------------------------------------------------------------------------------------------
# Domains
# --------------------------------------------------------------------------------------------------------------
_DOMAIN_SPECS: dict[str, dict[str, tuple]] = {
    "cooking": dict(
        agents=_nouns("chef baker cook waiter butcher host guest apprentice"),
        things=_nouns(
            "onion tomato:tomatoes carrot potato:potatoes egg dumpling pancake sauce soup pie biscuit sausage "
            "mushroom noodle cake herb"
        ),
        places=_words("kitchen oven pan bowl pot skillet tray counter"),
        verbs=_verbs(
            "chop::chopped stir::stirred bake boil fry slice whisk roast garnish peel grill mix knead simmer serve "
            "taste"
        ),
        adjs=_words("crispy fresh salty sweet spicy tender golden creamy sour bitter savoury juicy smoky"),
        advs=_words("gently evenly thoroughly"),
        mass=_words("flour sugar butter salt rice milk cream honey oil vinegar"),
        units=_nouns("cup spoon pinch"),
        extra=_words("add grams minutes degrees salt"),
    ),
    "astronomy": dict(
        agents=_nouns("astronomer astrophysicist observer cosmonaut stargazer navigator"),
        things=_nouns(
            "star planet moon comet asteroid galaxy:galaxies nebula:nebulae quasar pulsar meteor satellite "
            "cluster supernova:supernovae exoplanet"
        ),
        places=_words("observatory sky cosmos horizon spacecraft"),
        verbs=_verbs(
            "observe orbit detect measure photograph track map::mapped chart discover launch scan::scanned "
            "eclipse emit::emitted"
        ),
        adjs=_words("distant bright faint massive icy gaseous rocky celestial lunar solar stellar dusty cosmic"),
        advs=_words("faintly steadily brightly"),
        instruments=_words("telescope spectrograph radiotelescope probe"),
        extra=_words("light years away kilometres million billion days orbits through night appears"),
    ),
    "law": dict(
        agents=_nouns("judge lawyer attorney defendant plaintiff witness jury:juries clerk prosecutor tenant landlord"),
        things=_nouns(
            "contract statute clause verdict lawsuit warrant treaty deed licence sanction testimony:testimonies "
            "subpoena claim ordinance"
        ),
        places=_words("courtroom tribunal chamber parliament archive"),
        verbs=_verbs(
            "sign enforce overturn dismiss review draft file approve reject breach amend sue prosecute uphold::upheld"
        ),
        adjs=_words("legal binding void lawful unlawful criminal civil federal valid formal contractual"),
        advs=_words("hereby formally unanimously"),
        verdicts=_words("guilty innocent liable"),
        extra=_words("according section article shall must court ruled favour filed declared"),
    ),
    "sports": dict(
        agents=_nouns("player coach striker goalkeeper referee captain athlete defender fan umpire"),
        things=_nouns(
            "ball goal match:matches penalty:penalties trophy:trophies medal league tournament season race "
            "jersey whistle racket helmet"
        ),
        places=_words("stadium arena field gymnasium rink"),
        verbs=_verbs(
            "kick pass score tackle defend train win::won lose::lost throw::threw catch::caught sprint dribble "
            "block shoot::shot"
        ),
        adjs=_words("quick strong agile tired athletic competitive defensive muddy sweaty undefeated injured"),
        advs=_words("fiercely swiftly bravely"),
        teams=_words("tigers eagles wolves sharks falcons rovers lions bears"),
        extra=_words("beat ended draw point points scored"),
    ),
    "music": dict(
        agents=_nouns("pianist violinist singer composer drummer conductor guitarist cellist choir orchestra"),
        things=_nouns(
            "song melody:melodies chord symphony:symphonies sonata rhythm harmony:harmonies note album concerto "
            "ballad anthem opera lyric"
        ),
        places=_words("studio theatre conservatory stage auditorium"),
        verbs=_verbs(
            "play compose perform record tune rehearse conduct strum::strummed hum::hummed improvise arrange "
            "sing::sang transpose"
        ),
        adjs=_words("loud soft melodic harmonic acoustic classical lyrical rhythmic tuneful baroque jazzy mellow"),
        advs=_words("softly loudly sweetly"),
        instruments=_words("piano violin guitar drum cello flute trumpet harp organ saxophone"),
        keys=_words("c d e f g"),
        extra=_words("beats minute major minor sharp flat bars verses movements played sang"),
    ),
    "medicine": dict(
        agents=_nouns("doctor nurse surgeon patient pharmacist therapist paramedic midwife:midwives physician dentist"),
        things=_nouns(
            "tablet pill dose vaccine injection symptom fever infection wound fracture rash tumour bandage "
            "prescription capsule"
        ),
        places=_words("hospital clinic ward pharmacy ambulance"),
        verbs=_verbs(
            "diagnose treat prescribe examine monitor inject heal cure vaccinate admit::admitted discharge "
            "sterilise stitch"
        ),
        adjs=_words("chronic acute severe mild viral bacterial swollen infectious sterile clinical painful"),
        advs=_words("carefully promptly regularly"),
        drugs=_words("aspirin insulin penicillin ibuprofen morphine paracetamol"),
        extra=_words("mg daily once twice hours take meals temperature degrees prescribed diagnosed"),
    ),
}

# how many items of each list one document draws (document-level coherence)
_SUBSET_SIZES = {
    "agents": 3,
    "things": 5,
    "places": 2,
    "verbs": 5,
    "adjs": 5,
    "advs": 2,
    "mass": 4,
    "instruments": 2,
    "teams": 4,
    "drugs": 2,
    "verdicts": 3,
    "units": 3,
    "keys": 5,
}


# --------------------------------------------------------------------------------------------------------------
# Sentence generation
# --------------------------------------------------------------------------------------------------------------
class _Doc:
    """Per-document state: the rng and this document's word subsets."""

    __slots__ = ("rng", "r", "w")

    def __init__(self, rng: random.Random, spec: dict[str, tuple]):
        self.rng = rng
        self.r = rng.random
        self.w = {}
        for key, items in spec.items():
            if key == "extra":
                continue
            k = _SUBSET_SIZES[key]
            self.w[key] = tuple(rng.sample(items, k)) if k < len(items) else items

    def pick(self, seq):
        return seq[int(self.r() * len(seq))]

    def num(self) -> int:
        """0 = singular, 1 = plural"""
        return 1 if self.r() < 0.4 else 0

    def np(self, key: str, n: int, adj_p: float = 0.35, det: str | None = None) -> list[str]:
        noun = self.pick(self.w[key])[n]
        words = []
        if self.r() < adj_p:
            words.append(self.pick(_SHARED_ADJS) if self.r() < 0.1 else self.pick(self.w["adjs"]))
        words.append(noun)
        if det is None:
            det = self.pick(_PL_DETS if n else _SG_DETS)
        if det == "a" and words[0][0] in "aeiou":
            det = "an"
        return [det, *words]

    def verb(self, n: int, past: bool, base: bool = False) -> str:
        v = self.pick(self.w["verbs"])
        return v[0] if base else v[2] if past else v[0] if n else v[1]

    def obj(self) -> list[str]:
        return self.np("things", self.num())

    def place(self) -> list[str]:
        return [self.pick(_PREPS), "the", self.pick(self.w["places"])]


def _a(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


# ---- generic templates (every domain, own vocabulary) --------------------------------------------------------
def _g_transitive(d: _Doc) -> list[str]:
    n = d.num()
    out = d.np("agents", n)
    if d.r() < 0.15:
        out.append(d.pick(d.w["advs"]))
    elif d.r() < 0.1:
        out.append(d.pick(_FREQ_ADVS))
    out.append(d.verb(n, past=d.r() < 0.4))
    out += d.obj()
    if d.r() < 0.4:
        out += d.place()
    out.append(".")
    return out


def _g_copula(d: _Doc) -> list[str]:
    n = d.num()
    out = d.np("things", n, adj_p=0.0)
    past = d.r() < 0.3
    out.append(("were" if n else "was") if past else ("are" if n else "is"))
    if d.r() < 0.3:
        out.append("very")
    out.append(d.pick(d.w["adjs"]))
    if d.r() < 0.3:
        out += ["and", d.pick(d.w["adjs"])]
    out.append(".")
    return out


def _g_list(d: _Doc) -> list[str]:
    n = d.num()
    out = d.np("agents", n, adj_p=0.2)
    out.append(d.verb(n, past=d.r() < 0.5))
    things = d.rng.sample(d.w["things"], 3)
    pl = d.r() < 0.5
    for i, t in enumerate(things):
        if i == 1:
            out.append(",")
        elif i == 2:
            out.append("and")
        out += ["the", t[1] if pl else t[0]]
    out.append(".")
    return out


def _g_existential(d: _Doc) -> list[str]:
    t = d.pick(d.w["things"])
    if d.r() < 0.5:
        adj = d.pick(d.w["adjs"]) if d.r() < 0.5 else None
        out = ["there", "is", _a(adj or t[0])]
        if adj:
            out.append(adj)
        out.append(t[0])
    else:
        out = ["there", "are", NUMBERS[2 + int(d.r() * 8)], t[1]]
    out += ["in", "the", d.pick(d.w["places"]), "."]
    return out


def _g_negation(d: _Doc) -> list[str]:
    n = d.num()
    out = d.np("agents", n)
    past = d.r() < 0.4
    out += ["did" if past else ("do" if n else "does"), "not", d.verb(n, past, base=True)]
    out += d.obj()
    out.append(".")
    return out


def _g_because(d: _Doc) -> list[str]:
    n = d.num()
    out = d.np("agents", n, adj_p=0.1)
    out.append(d.verb(n, past=True))
    m = d.num()
    t = d.pick(d.w["things"])[m]
    out += ["the", t, "because", "it" if not m else "they", "was" if not m else "were", d.pick(d.w["adjs"]), "."]
    return out


def _g_question(d: _Doc) -> list[str]:
    n = d.num()
    past = d.r() < 0.4
    out = ["did" if past else ("do" if n else "does")]
    out += d.np("agents", n, adj_p=0.1, det="the")
    out.append(d.verb(n, past, base=True))
    out += d.obj()
    out.append("?")
    return out


def _g_modal(d: _Doc) -> list[str]:
    n = d.num()
    out = d.np("agents", n)
    out += [d.pick(("should", "can", "will")), d.verb(n, False, base=True)]
    out += d.obj()
    if d.r() < 0.5:
        out.append(d.pick(d.w["advs"]))
    out.append(".")
    return out


def _g_contrast(d: _Doc) -> list[str]:
    n = d.num()
    past = d.r() < 0.5
    out = d.np("agents", n, adj_p=0.2) + [d.verb(n, past)] + d.obj() + [",", "but"]
    m = d.num()
    out += d.np("agents", m, adj_p=0.0, det="the")
    out += ["did" if past else ("do" if m else "does"), "not", "."]
    return out


def _g_choice(d: _Doc) -> list[str]:
    n = d.num()
    a, b = d.rng.sample(d.w["things"], 2)
    m = d.num()
    out = [d.pick(("should", "can", "will"))] + d.np("agents", n, adj_p=0.1, det="the")
    out += [d.verb(n, False, base=True), "the", a[m], "or", "the", b[m], "?"]
    return out


def _g_after(d: _Doc) -> list[str]:
    n, m = d.num(), d.num()
    out = ["after"] + d.np("agents", n, adj_p=0.0, det="the") + [d.verb(n, True)] + d.obj() + [","]
    out += d.np("agents", m, adj_p=0.1, det="the") + [d.verb(m, True)] + d.obj() + ["."]
    return out


_GENERIC: tuple[Callable[[_Doc], list[str]], ...] = (
    _g_transitive,
    _g_transitive,
    _g_copula,
    _g_list,
    _g_existential,
    _g_negation,
    _g_because,
    _g_question,
    _g_modal,
    _g_contrast,
    _g_choice,
    _g_after,
)


# ---- cooking --------------------------------------------------------------------------------------------------
def _qty(d: _Doc) -> list[str]:
    unit = d.pick(d.w["units"])
    if d.r() < 0.4:
        return [d.pick(("50", "100", "120", "150", "200", "250", "500")), "grams"]
    q = d.pick(("1", "1", "2", "3", "4", "5", "6"))
    return [q, unit[0] if q == "1" else unit[1]]


def _c_add(d: _Doc) -> list[str]:
    mass = d.rng.sample(d.w["mass"], 2 + int(d.r() * 2))
    out = ["add"]
    for i, m in enumerate(mass):
        if i:
            out.append("and" if i == len(mass) - 1 else ",")
        out += _qty(d) + ["of", m]
    out.append(".")
    return out


def _c_bake(d: _Doc) -> list[str]:
    n = d.num()
    verb = d.pick((("bake", "bakes"), ("roast", "roasts"), ("grill", "grills")))
    if d.r() < 0.5:
        out = [verb[0], "the", d.pick(d.w["things"])[n]]
    else:
        m = d.num()
        out = d.np("agents", m, adj_p=0.0, det="the") + [verb[1] if not m else verb[0], "the"]
        out.append(d.pick(d.w["things"])[n])
    out += ["for", d.pick(("10", "15", "20", "25", "30", "40", "45", "60")), "minutes", "at"]
    out += [d.pick(("150", "180", "200", "220")), "degrees", "."]
    return out


def _c_steps(d: _Doc) -> list[str]:
    v1, v2 = d.rng.sample(d.w["verbs"], 2)
    t = d.pick(d.w["things"])
    out = ["first", ",", v1[0], "the", t[1], ";", "then", v2[0], "them"]
    return out + [d.pick(("with", "into")), "the", d.pick(d.w["mass"]), "."]


def _c_serve(d: _Doc) -> list[str]:
    out = ["the", d.pick(d.w["agents"])[0], "serves", "the", d.pick(d.w["things"])[0], "with"]
    out += [d.pick(d.w["adjs"]), d.pick(d.w["mass"]), "and", "a", "pinch", "of", "salt", "."]
    return out


# ---- astronomy ------------------------------------------------------------------------------------------------
def _a_distance(d: _Doc) -> list[str]:
    out = d.np("things", 0, adj_p=0.4, det="the") + ["is"]
    if d.r() < 0.5:
        out += [d.pick(NUMBERS[2:30]), "light", "years", "away", "."]
    else:
        out += ["about", d.pick(("2", "5", "40", "150", "500")), d.pick(("million", "billion")), "kilometres", "from"]
        out += ["the", d.pick(d.w["things"])[0], "."]
    return out


def _a_observe(d: _Doc) -> list[str]:
    n = d.num()
    out = d.np("agents", n, adj_p=0.0, det="the")
    v = d.pick((("observe", "observed"), ("detect", "detected"), ("photograph", "photographed")))
    out += [v[1], d.pick(NUMBERS[2:13]), d.pick(d.w["things"])[1], "through", "the", d.pick(d.w["instruments"])]
    out.append(".")
    return out


def _a_orbit(d: _Doc) -> list[str]:
    a, b = d.rng.sample(d.w["things"], 2)
    n = d.num()
    out = ["the", d.pick(d.w["adjs"]), a[n], "orbit" if n else "orbits", "the", b[0], "every"]
    out += [d.pick(("12", "27", "30", "90", "180", "250", "1000")), "days", "."]
    return out


def _a_sky(d: _Doc) -> list[str]:
    t = d.pick(d.w["things"])[0]
    adj = d.pick(d.w["adjs"])
    return [_a(adj), adj, t, "appears", "in", "the", "sky", "at", "night", "."]


# ---- law ------------------------------------------------------------------------------------------------------
def _l_section(d: _Doc) -> list[str]:
    out = ["according", "to", d.pick(("section", "article")), d.pick(NUMBERS[1:41]), "of", "the"]
    out += [d.pick(d.w["things"])[0], ",", "the", d.pick(d.w["agents"])[0], d.pick(("shall", "must"))]
    out += [d.verb(0, False, base=True), "the", d.pick(d.w["things"])[0], "."]
    return out


def _l_ruling(d: _Doc) -> list[str]:
    x = 5 + int(d.r() * 5)
    out = ["the", "court", "ruled", str(x), "to", str(9 - x), "in", "favour", "of", "the"]
    out += [d.pick(d.w["agents"])[0], "."]
    return out


def _l_filed(d: _Doc) -> list[str]:
    a, b = d.rng.sample(d.w["agents"], 2)
    adj = d.pick(d.w["adjs"])
    out = ["the", a[0], "filed", _a(adj), adj, "claim", "against", "the", b[0]]
    if d.r() < 0.5:
        out += ["under", "article", d.pick(NUMBERS[1:41])]
    out.append(".")
    return out


def _l_verdict(d: _Doc) -> list[str]:
    n = d.num()
    out = ["the", d.pick(d.w["agents"])[n], "were" if n else "was", d.pick(("formally", "hereby"))]
    out += ["declared", d.pick(d.w["verdicts"]), "by", "the", "court", "."]
    return out


# ---- sports ---------------------------------------------------------------------------------------------------
def _s_beat(d: _Doc) -> list[str]:
    a, b = d.rng.sample(d.w["teams"], 2)
    y = int(d.r() * 5)
    x = y + 1 + int(d.r() * 3)
    return ["the", a, "beat", "the", b, str(x), "to", str(y), "."]


def _s_draw(d: _Doc) -> list[str]:
    x = str(int(d.r() * 5))
    a, b = d.rng.sample(d.w["teams"], 2)
    return ["the", "match", "between", "the", a, "and", "the", b, "ended", "in", "a", x, "to", x, "draw", "."]


def _s_scored(d: _Doc) -> list[str]:
    k = int(d.r() * 6)
    unit = d.pick((("goal", "goals"), ("point", "points")))
    out = ["the", d.pick(d.w["agents"])[0], "scored", str(k), unit[0] if k == 1 else unit[1], "in", "the"]
    out += [d.pick(d.w["adjs"]), d.pick(("match", "tournament", "league", "season")), "."]
    return out


def _s_record(d: _Doc) -> list[str]:
    m = 3 + int(d.r() * 8)
    k = int(d.r() * (m + 1))
    return ["the", d.pick(d.w["teams"]), "have", "won", str(k), "of", "their", "last", str(m), "matches", "."]


# ---- music ----------------------------------------------------------------------------------------------------
def _m_tempo(d: _Doc) -> list[str]:
    out = ["the", d.pick(d.w["agents"])[0], "played", "the", d.pick(d.w["instruments"]), "at"]
    out += [d.pick(("60", "75", "90", "100", "120", "150", "180")), "beats", "per", "minute", "."]
    return out


def _m_key(d: _Doc) -> list[str]:
    out = ["the", d.pick(d.w["things"])[0], "is", "in", d.pick(d.w["keys"])]
    if d.r() < 0.3:
        out.append(d.pick(("sharp", "flat")))
    out += [d.pick(("major", "minor")), "."]
    return out


def _m_parts(d: _Doc) -> list[str]:
    adj = d.pick(d.w["adjs"])
    k = d.pick(("2", "3", "4", "5", "8", "12", "16", "32"))
    return [_a(adj), adj, d.pick(d.w["things"])[0], "has", k, d.pick(("bars", "verses", "movements")), "."]


def _m_duet(d: _Doc) -> list[str]:
    a, b = d.rng.sample(d.w["agents"], 2)
    adj = d.pick(d.w["adjs"])
    out = ["the", a[0], "sang", _a(adj), adj, d.pick(d.w["things"])[0], "while", "the", b[0], "played", "the"]
    out += [d.pick(d.w["instruments"]), "."]
    return out


# ---- medicine -------------------------------------------------------------------------------------------------
def _freq(d: _Doc) -> list[str]:
    x = d.r()
    if x < 0.35:
        return ["once", "daily"]
    if x < 0.7:
        return ["twice", "daily"]
    return ["every", d.pick(("4", "6", "8", "12")), "hours"]


def _d_prescribe(d: _Doc) -> list[str]:
    out = ["the", d.pick(d.w["agents"])[0], "prescribed"]
    out += [d.pick(("5", "10", "20", "25", "50", "100", "200", "250", "500", "1000")), "mg", "of"]
    return out + [d.pick(d.w["drugs"])] + _freq(d) + ["."]


def _d_temperature(d: _Doc) -> list[str]:
    adj = d.pick(d.w["adjs"])
    out = ["the", "patient", "has", "a", "temperature", "of", d.pick(("36", "37", "38", "39", "40")), "degrees"]
    return out + ["and", _a(adj), adj, d.pick(d.w["things"])[0], "."]


def _d_diagnosed(d: _Doc) -> list[str]:
    adj = d.pick(d.w["adjs"])
    out = ["the", d.pick(d.w["agents"])[0], "diagnosed", _a(adj), adj]
    out += [d.pick(("fever", "infection", "rash", "fracture", "wound")), "and", "prescribed"]
    return out + [d.pick(d.w["drugs"]), "."]


def _d_take(d: _Doc) -> list[str]:
    k = d.pick(("1", "1", "2", "3"))
    out = ["take", k, "tablet" if k == "1" else "tablets", "of", d.pick(d.w["drugs"])] + _freq(d)
    if d.r() < 0.4:
        out += ["after", "meals"]
    return out + ["."]


_SPECIFIC: dict[str, tuple[Callable[[_Doc], list[str]], ...]] = {
    "cooking": (_c_add, _c_bake, _c_steps, _c_serve),
    "astronomy": (_a_distance, _a_observe, _a_orbit, _a_sky),
    "law": (_l_section, _l_ruling, _l_filed, _l_verdict),
    "sports": (_s_beat, _s_draw, _s_scored, _s_record),
    "music": (_m_tempo, _m_key, _m_parts, _m_duet),
    "medicine": (_d_prescribe, _d_temperature, _d_diagnosed, _d_take),
}
_SPECIFIC_SHARE = 0.5  # probability that a sentence uses a domain-specific template
_MIN_SENTENCES, _MAX_SENTENCES = 3, 8  # sentences per document


def _document(rng: random.Random, domain: str) -> str:
    d = _Doc(rng, _DOMAIN_SPECS[domain])
    specific = _SPECIFIC[domain]
    n_sent = _MIN_SENTENCES + int(rng.random() * (_MAX_SENTENCES - _MIN_SENTENCES + 1))
    words: list[str] = []
    for _ in range(n_sent):
        if words and rng.random() < 0.12:
            words += d.pick(_CONNECTORS)
        pool = specific if rng.random() < _SPECIFIC_SHARE else _GENERIC
        words += d.pick(pool)(d)
    return " ".join(words)


# --------------------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------------------
def _stable_seed(*parts: object) -> int:
    """A 64-bit seed from SHA-256 of the parts (stable across processes, unlike ``hash``)."""
    key = "\x1f".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "big")


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")


def generate_documents(split: str, n_docs_per_domain: int, seed: int = 0) -> list[Document]:
    """``n_docs_per_domain`` documents of every domain, interleaved (each round of six in a seeded order).

    Deterministic in ``(split, n_docs_per_domain, seed)``; the splits use disjoint streams, and the result for
    ``n`` is a prefix of the result for any larger ``n``.
    """
    _check_split(split)
    if n_docs_per_domain < 0:
        raise ValueError("n_docs_per_domain must be >= 0")
    per_domain = []
    for domain in DOMAINS:
        rng = random.Random(_stable_seed("m2d-synthetic-v1", split, domain, seed))
        per_domain.append([_document(rng, domain) for _ in range(n_docs_per_domain)])
    order_rng = random.Random(_stable_seed("m2d-synthetic-v1-order", split, seed))
    out: list[Document] = []
    perm = list(range(len(DOMAINS)))
    for j in range(n_docs_per_domain):
        order_rng.shuffle(perm)
        out.extend(Document(DOMAINS[i], per_domain[i][j]) for i in perm)
    return out


_AVG_DOC_CHARS = 290  # rough, only used to size the first attempt in corpus_text


def corpus_documents(split: str = "test", max_chars: int | None = None, seed: int = 0) -> list[Document]:
    """The labelled documents behind :func:`corpus_text` (same order, same truncation rule)."""
    return list(_corpus_documents(split, max_chars, seed))


@functools.lru_cache(maxsize=16)
def _corpus_documents(split: str, max_chars: int | None, seed: int) -> tuple[Document, ...]:
    _check_split(split)
    limit = DEFAULT_CORPUS_CHARS if max_chars is None else int(max_chars)
    if limit <= 0:
        return ()
    n = max(1, limit // (_AVG_DOC_CHARS * len(DOMAINS)) + 2)
    while True:
        docs = generate_documents(split, n, seed)
        out: list[Document] = []
        total = 0
        for doc in docs:
            total += len(doc.text) + (len(DOC_SEPARATOR) if out else 0)
            if total > limit:
                if not out:
                    return (Document(doc.domain, doc.text[:limit]),)
                return tuple(out)
            out.append(doc)
        n *= 2


@functools.lru_cache(maxsize=16)
def corpus_text(split: str = "test", max_chars: int | None = None, seed: int = 0) -> str:
    """Documents of all domains interleaved and separated by blank lines (``"\\n\\n"``).

    Whole documents are taken, in :func:`generate_documents` order, while the text stays within ``max_chars``
    (default :data:`DEFAULT_CORPUS_CHARS`, about 200k characters); if even the first document is longer, it is
    cut at ``max_chars``. Deterministic; a shorter ``max_chars`` gives a prefix of a longer one. The domain of
    every document is available from :func:`corpus_documents`.
    """
    return DOC_SEPARATOR.join(doc.text for doc in _corpus_documents(split, max_chars, seed))


def domain_vocabulary(domain: str) -> list[str]:
    """Every content word that belongs to ``domain`` (nouns in both numbers, verb forms, adjectives, extras)."""
    spec = _DOMAIN_SPECS[domain]
    words: list[str] = []
    for items in spec.values():
        for item in items:
            if isinstance(item, tuple):
                words.extend(item)
            else:
                words.append(item)
    return list(dict.fromkeys(words))


@functools.lru_cache(maxsize=1)
def _vocabulary() -> tuple[str, ...]:
    words: list[str] = [*PUNCTUATION, *_FUNCTION_WORDS, *NUMBERS]
    for domain in DOMAINS:
        words.extend(domain_vocabulary(domain))
    return tuple(dict.fromkeys(words))


def vocabulary() -> list[str]:
    """Every word and punctuation token the generator can emit (no special tokens), in a fixed order."""
    return list(_vocabulary())


def build_tokenizer():
    """A word-level ``PreTrainedTokenizerFast`` over :func:`vocabulary`.

    Ids: ``<|endoftext|>`` = 0 (eos, bos and pad), ``<unk>`` = 1, then the vocabulary in order. Text is NFKC- and
    lower-case-normalised and split on whitespace and punctuation; decoding joins the tokens with single spaces,
    so generated documents round-trip exactly. ``save_pretrained`` / ``AutoTokenizer.from_pretrained`` work
    offline.
    """

    vocab = {EOS_TOKEN: 0, UNK_TOKEN: 1}
    for w in _vocabulary():
        vocab.setdefault(w, len(vocab))
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    tk.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation(behavior="isolated")]
    )
    # WordPiece decoding without a continuation prefix in the vocabulary = join the tokens with single spaces
    tk.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tk.add_special_tokens([EOS_TOKEN, UNK_TOKEN])
    specials = {**dict.fromkeys(("bos_token", "eos_token", "pad_token"), EOS_TOKEN), "unk_token": UNK_TOKEN}
    return PreTrainedTokenizerFast(tokenizer_object=tk, clean_up_tokenization_spaces=False, **specials)
