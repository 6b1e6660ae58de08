"""Arguments copied from the request: the strings a grounded argument may take.

A catalog argument marked `grounded: true` (config/skills.yaml) names something the request
mentions, so its value must be a run of consecutive words of the task, or of the scene, modulo
case, punctuation and a leading article ("the red cup" in "Bring the red cup, please").
A plan that names a thing nobody mentioned cannot be acted on (perception has nothing to look
for), and a small model swaps a name it never learned for one it knows: both are caught here.

Under the plan grammar the planner compiles `RequestWords.pattern` into the request's
grammar, so a constrained plan cannot name anything else; without the grammar `parse_plan`
rejects a plan that does (`RequestWords.contains`). Every value the pattern allows, the
check accepts, but the pattern asks for more: a whole phrase. A name under the grammar starts
and ends at a content word (not an article, preposition, pronoun, conjunction, auxiliary or
"please": `NOT_NAME`), holds no such word but "of" and articles ("cup of tea", never "cup
back on the shelf"), crosses no punctuation, lies outside quotes (a quoted text is to be
said), and ends where the text's phrase does: before punctuation, the end of the text, or a
word that follows names (a `NOT_NAME` word other than an article, or one of `AFTER_NAME`:
"back", "open", "belongs", ...; a word before an article is a verb: "grab the cup"). So
"hard kettle" in "fetch the hard kettle and ..." may be named, but not "hard" (a small model
stops a name it never saw after its first word), "then" or "from". A name followed by a verb
outside those lists ("the cup Anna wants") can only be named with that verb; the scene can
say it otherwise ("the cup is Anna's"). `pattern` allows runs of at most `MAX_WORDS` words,
each as written or in lower case, joined by single spaces; it keeps a request's grammar
small (tens of ms to compile, even for a 150k vocabulary).

A request may also list the scene's objects and places (`scene`: from perception). Each entry
is a name, optionally followed by its declared short forms after `|` ("coke can|coke"). An
argument marked `grounded: scene` then takes exactly one of those names or short forms (the
grammar's enum), and the validated plan carries the entry's full name; a `grounded: true`
argument may also take a run of a listed name's words, as of the task's.

A text the task quotes is words to say, as written: an argument marked `grounded: quote` (a
`say` skill's text) takes exactly one of the task's quoted texts (`RequestWords.quotes`)
when it quotes any, and any string when it quotes none ("say hello, then ..."). A small model
misspells a sentence it never saw ("the kettle cargetus") or repeats it to the token limit;
the robot is to say what it was told.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from functools import cached_property

WORD = re.compile(r"\w+(?:[.'-]\w+)*")
ARTICLES = frozenset({"the", "a", "an"})
MAX_WORDS = 6
# Words that never start or end a name, nor sit inside one but for INSIDE_NAME ("cup of
# tea"). Not the modals that are also nouns: a soda can, a will, May.
NOT_NAME = ARTICLES | frozenset("""
    to in on at from into onto of for with by near under over behind beside inside outside
    between through toward towards across along around via upon within without against above
    below beneath underneath past until off out away up down
    and or but then so nor if when while once after before because than as
    i it its them they their me my you your us our we he she him her his this that these those
    there here what which who whom whose where how
    is are was were be been being am has have had do does did could would should shall might
    must not
    please now again also too soon later afterwards just already still
    """.split())
INSIDE_NAME = ARTICLES | {"of"}
# Words that often follow a name in a task or scene without being function words: a name
# may end before them ("put the cup back", "get drawer 2 open", "the cup belongs on ...").
AFTER_NAME = frozenset("""
    back first next right left last straight directly quickly carefully gently immediately
    open closed shut ready
    needs belongs goes sits lies stands rests hangs remains stays waits looks seems ends
    """.split())
# A quoted text is words to say, not things to name (inside single quotes, an apostrophe
# before a letter is one: 'the cup is Anna's').
QUOTED = re.compile(r"""("[^"]*"|“[^”]*”|(?<!\w)'(?:[^']|'\w)*'(?!\w))""")


def quoted_texts(text: str) -> tuple[str, ...]:
    """The texts `text` quotes, without their quote marks and outer blanks, each once in
    order; empty quotes are none."""
    inner = (q[1:-1].strip() for q in QUOTED.findall(text))
    return tuple(dict.fromkeys(q for q in inner if q))


def words_of(text: str) -> tuple[str, ...]:
    """The words of `text` as written: letters and digits, with inner `.`, `'` and `-`."""
    return tuple(WORD.findall(text))


def phrase_marks(text: str) -> tuple[tuple[bool, ...], ...]:
    """For each word of `text`: whether a name may start with it, whether one may end with
    it, and whether no name goes on past it (punctuation, the end of the text or a function
    word follows it; see the module's doc)."""
    found = list(WORD.finditer(text))
    quoted = [q.span() for q in QUOTED.finditer(text)]
    starts, ends, stops = [], [], []
    for i, match in enumerate(found):
        word, last = match.group().lower(), i + 1 == len(found)
        said = any(a < match.start() < b for a, b in quoted)
        gap = "" if last else text[match.end():found[i + 1].start()]
        following = "" if last else found[i + 1].group().lower()
        stops.append(last or bool(gap.strip())
                     or (following in NOT_NAME and following not in INSIDE_NAME))
        starts.append(not said and word not in NOT_NAME)
        ends.append(not said and word not in NOT_NAME and word not in AFTER_NAME
                    and (stops[-1] or following in AFTER_NAME
                         or (following in NOT_NAME and following not in ARTICLES)))
    return tuple(starts), tuple(ends), tuple(stops)


def _normal(words) -> list[str]:
    """Lower case, one leading article dropped: the form two names are compared in."""
    out = [w.lower() for w in words]
    return out[1:] if out and out[0] in ARTICLES else out


def _regex_word(word: str) -> str:
    # a word holds \w characters and inner . ' - : only the dot means something in a regex
    spell = sorted({word, word.lower()})
    alternatives = "|".join(w.replace(".", "\\.") for w in spell)
    return f"({alternatives})" if len(spell) > 1 else alternatives


def scene_entries(scene) -> tuple[tuple[str, ...], ...]:
    """A scene list's entries as (name, *short forms), split at `|` and stripped; entries
    are checked by the request (`request.check_scene`)."""
    return tuple(tuple(part.strip() for part in entry.split("|")) for entry in scene)


def _listed_text(entries) -> str:
    # every name and short form, each its own stretch for the phrase rule
    return ". ".join(part for entry in entries for part in entry)


@dataclass(frozen=True)
class RequestWords:
    """The words of one request's task and scene, which grounded arguments are taken from,
    and where in them a name may start and end (`phrase_marks`); the scene's listed names,
    which `grounded: scene` arguments are taken from; and the task's quoted texts, which
    `grounded: quote` arguments are."""
    task: tuple[str, ...]
    context: tuple[str, ...]
    # per part (task, scene, listed names), per word: whether a name may start with it, end
    # with it, and whether no name goes on past it (`phrase_marks`)
    marks: tuple[tuple[tuple[bool, ...], ...], ...]
    # the listed scene names, each as (name, *short forms)
    scene: tuple[tuple[str, ...], ...] = ()
    # the task's quoted texts (`quoted_texts`), which `grounded: quote` arguments are taken
    # from; a scene description's quotes are what it saw written, not words to say
    quotes: tuple[str, ...] = ()

    @classmethod
    def of(cls, task: str, context: str = "", scene=()) -> RequestWords:
        entries = scene_entries(scene)
        return cls(words_of(task), words_of(context),
                   (phrase_marks(task), phrase_marks(context),
                    phrase_marks(_listed_text(entries))), entries, quoted_texts(task))

    @cached_property
    def listed(self) -> tuple[str, ...]:
        """The words of the listed names, one stretch per name (see `of`)."""
        return words_of(_listed_text(self.scene))

    @cached_property
    def scene_values(self) -> tuple[str, ...]:
        """Every value a `grounded: scene` argument may take: the names and short forms."""
        return tuple(dict.fromkeys(part for entry in self.scene for part in entry))

    def scene_name(self, value: str) -> str | None:
        """The listed name `value` is (or is a declared short form of), modulo case, spaces
        and a leading article; None when it is none of them."""
        key = _normal(words_of(value))
        return next((entry[0] for entry in self.scene
                     if key and any(_normal(words_of(part)) == key for part in entry)), None)

    def nearest(self, value: str, n: int = 3) -> list[str]:
        """The listed names closest to `value` in spelling (for an error message)."""
        names = {part.lower(): entry[0] for entry in self.scene for part in entry}
        close = difflib.get_close_matches(value.lower(), list(names), n=n * 2, cutoff=0.3)
        return list(dict.fromkeys(names[c] for c in close))[:n] \
            or [entry[0] for entry in self.scene[:n]]

    def contains(self, value: str) -> bool:
        """Whether `value` is a run of words of the task, of the scene or of one listed name
        (modulo case, punctuation and a leading article); an empty name never is."""
        name = _normal(words_of(value))
        if not name:
            return False
        needle = f" {' '.join(name)} "
        names = (words_of(part) for entry in self.scene for part in entry)
        return any(needle in f" {' '.join(w.lower() for w in part)} "
                   for part in (self.task, self.context, *names))

    @cached_property
    def pattern(self) -> str | None:
        """A regular expression (the JSON-Schema `pattern` of a grounded argument) of the
        values a grounded argument may take, anchored `^(...)$`: runs of up to MAX_WORDS
        words, within one stretch between punctuation and function words, that start at a
        word not in NOT_NAME and end where a name may end. None when the request has no
        such run."""
        runs = set()
        for part, (starts, ends, stops) in zip((self.task, self.context, self.listed),
                                               self.marks):
            for start in range(len(part)):
                if not starts[start]:
                    continue
                stop = next(i for i in range(start, len(part)) if stops[i])
                window = range(start, min(start + MAX_WORDS, stop + 1))
                last = max((i for i in window if ends[i]), default=None)
                if last is None:
                    continue
                regex = _regex_word(part[last])
                for i in range(last - 1, start - 1, -1):
                    tail = f" {regex}"
                    regex = _regex_word(part[i]) + (f"({tail})?" if ends[i] else tail)
                runs.add(regex)
        # Anchored here, the one place the regex is made: a JSON-Schema pattern matches
        # anywhere in the string (ECMA-262 search), so unanchored it would let "xx cup yy"
        # through a server that follows the spec (llama.cpp's llama-server even gives up on
        # it and accepts any string). xgrammar reads a pattern whole either way and takes
        # `^`/`$` at its ends, so the grammar admits the same names.
        return "^(" + "|".join(sorted(runs)) + ")$" if runs else None
