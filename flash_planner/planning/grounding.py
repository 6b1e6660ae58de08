"""Arguments copied from the request: the strings a grounded argument may take.

A catalog argument marked `grounded: true` (config/skills.yaml) names something the request
mentions, so its value must be a run of consecutive words of the task, or of the scene, modulo
case, punctuation and a leading article ("the red cup" in "Bring the red cup, please").
A plan that names a thing nobody mentioned cannot be acted on (perception has nothing to look
for), and a small model swaps a name it never learned for one it knows: both are caught here.

Under the plan grammar the planner compiles `RequestWords.pattern` into the request's
grammar, so a constrained plan cannot name anything else; without the grammar `parse_plan`
rejects a plan that does (`RequestWords.contains`). Every value the pattern allows, the
check accepts. `pattern` allows runs of at most `MAX_WORDS` words, each as written or in
lower case, joined by single spaces; it keeps a request's grammar small (tens of ms to
compile, even for a 150k vocabulary).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

WORD = re.compile(r"\w+(?:[.'-]\w+)*")
ARTICLES = frozenset({"the", "a", "an"})
MAX_WORDS = 6


def words_of(text: str) -> tuple[str, ...]:
    """The words of `text` as written: letters and digits, with inner `.`, `'` and `-`."""
    return tuple(WORD.findall(text))


def _normal(words) -> list[str]:
    """Lower case, one leading article dropped: the form two names are compared in."""
    out = [w.lower() for w in words]
    return out[1:] if out and out[0] in ARTICLES else out


def _regex_word(word: str) -> str:
    # a word holds \w characters and inner . ' - : only the dot means something in a regex
    spell = sorted({word, word.lower()})
    alternatives = "|".join(w.replace(".", "\\.") for w in spell)
    return f"({alternatives})" if len(spell) > 1 else alternatives


@dataclass(frozen=True)
class RequestWords:
    """The words of one request's task and scene, which grounded arguments are taken from."""
    task: tuple[str, ...]
    context: tuple[str, ...] = ()

    @classmethod
    def of(cls, task: str, context: str = "") -> RequestWords:
        return cls(words_of(task), words_of(context))

    def contains(self, value: str) -> bool:
        """Whether `value` is a run of words of the task or of the scene (modulo case,
        punctuation and a leading article); an empty name never is."""
        name = _normal(words_of(value))
        if not name:
            return False
        needle = f" {' '.join(name)} "
        return any(needle in f" {' '.join(w.lower() for w in part)} "
                   for part in (self.task, self.context))

    @cached_property
    def pattern(self) -> str | None:
        """A regular expression (xgrammar's JSON-Schema `pattern`) of the values a grounded
        argument may take; None when the request has no words to name anything with."""
        runs = set()
        for part in (self.task, self.context):
            for start in range(len(part)):
                run = part[start:start + MAX_WORDS]
                article = run[0].lower() in ARTICLES
                if article and len(run) == 1:
                    continue              # an article alone names nothing
                regex = _regex_word(run[-1])
                for word in reversed(run[1:-1]):
                    regex = f"{_regex_word(word)}( {regex})?"
                if len(run) > 1:      # a run that starts at an article must go on past it
                    tail = f" {regex}" if article else f"( {regex})?"
                    regex = _regex_word(run[0]) + tail
                runs.add(regex)
        return "(" + "|".join(sorted(runs)) + ")" if runs else None
