"""The semantic cache: reuse an earlier answer when a request asks the same question.

Two requests may share an answer only if everything but their last user turn is
identical and the two last turns ask the same thing. So:

1. :func:`semantic_request` splits a chat into its *context* (endpoint, system
   prompt, earlier turns) and its *question* (the last user turn); a completion's raw
   prompt is text to continue, answered exactly or not at all. The context is matched exactly: it is hashed into the
   namespace (:func:`~serve_app.core.cache.keys.semantic_namespace`, with the model,
   revision, params, the embedder's name and revision, and the caller's scope).
   Embedding a whole conversation instead would make long shared histories look alike
   whatever the last instruction says.
2. Only the question is embedded; :class:`SemanticIndex` finds the stored questions of
   the namespace at cosine >= threshold.
3. :func:`same_question` then has the last word: an embedding cannot be trusted with
   "safe" vs "unsafe" (MiniLM: 0.99) or "dog bigger than cat" vs "cat bigger than dog"
   (0.99), so a candidate is reused only if both questions have the same numbers, the
   same negations and the same content words in the same order (see there). Whatever
   the embedding says, a question with another number, negation, entity, language or
   word order never gets this one's answer.

Nothing here imports ray; nothing here is thread-safe (one event loop owns an index).
"""

from __future__ import annotations

import math
import re
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from serve_app.core.cache.keys import _model_part

# Longer questions are answered exactly or not at all: the guard compares texts, which
# the index then has to keep, and the embedder's context (MiniLM: 256 tokens) would
# truncate or refuse them anyway.
MAX_QUESTION_CHARS = 1000


# ---- what is compared ------------------------------------------------------------------


@dataclass(frozen=True)
class SemanticRequest:
    """A generation call as the semantic cache sees it."""

    endpoint: str  # "chat" (completions never get here); in the namespace, so no other endpoint shares
    context: Any  # matched exactly: every chat message before the last user turn (canonical dicts)
    question: str  # embedded and guarded: the last user turn


def semantic_request(*, prompts: Optional[Sequence[str]],
                     messages: Optional[Sequence[dict]]) -> Optional[SemanticRequest]:
    """The context and question of a chat (``messages``: role/content dicts); None where
    the semantic cache does not apply: a completion (``prompts``), a chat that does not
    end with a user turn (say, an assistant prefill), an empty or overlong question."""
    if messages is None:
        # A raw completion prompt is text to continue, not a question: its whitespace,
        # case and punctuation decide the continuation ("return x *" vs "return x **"),
        # so it is answered exactly or not at all.
        return None
    if not messages or messages[-1].get("role") != "user":
        return None
    endpoint, context, question = "chat", [dict(m) for m in messages[:-1]], messages[-1].get("content")
    if not isinstance(question, str) or not question.strip() or len(question) > MAX_QUESTION_CHARS:
        return None
    return SemanticRequest(endpoint=endpoint, context=context, question=question)


# ---- the guard -------------------------------------------------------------------------

# Numbers ("1,000" is 1000; "1.5" stays 1.5) and words (inner apostrophes kept, so
# contractions can be expanded). \w is Unicode-aware: any script tokenizes.
_TOKEN = re.compile(r"\d+(?:[.,]\d+)*|[^\W\d_]+(?:['\u2019][^\W\d_]+)*")
_THOUSANDS = re.compile(r",(?=\d{3}(?:\D|$))")
# Every other character that is neither a letter, a digit, white space nor sentence
# punctuation is meaning: signs and operators (5+3 / 5-3, 3 > 2 / 3 < 2, != / ==, 1e3 /
# 1e-3), currencies and percent ($100 / EUR100, 5% of), language names (C++ / C# / C).
_SENTENCE_PUNCTUATION = set(".,;:?!'\"()\u2019\u2018\u201c\u201d\u00bf\u00a1")

_NUMBER_WORDS = {
    word: str(value)
    for value, word in enumerate(
        "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
        "sixteen seventeen eighteen nineteen twenty".split()
    )
}
_NUMBER_WORDS |= {"thirty": "30", "forty": "40", "fifty": "50", "sixty": "60", "seventy": "70", "eighty": "80",
                  "ninety": "90", "hundred": "100", "thousand": "1000", "million": "1000000",
                  "billion": "1000000000", "trillion": "1000000000000", "dozen": "12", "half": "0.5",
                  "once": "x1", "twice": "x2", "thrice": "x3", "first": "#1", "second": "#2", "third": "#3",
                  "fourth": "#4", "fifth": "#5", "last": "#-1", "double": "x2", "triple": "x3"}

_NEGATIONS = frozenset(
    "not no never none nothing nobody noone nowhere neither nor without cannot hardly barely".split()
)
# A word that is another word with one of these in front negates it (safe/unsafe,
# legal/illegal, possible/impossible, agree/disagree, toxic/nontoxic).
_NEGATING_PREFIXES = ("un", "in", "im", "il", "ir", "dis", "non", "anti", "a")

_CONTRACTIONS = {"n't": "not", "'re": "are", "'m": "am", "'ll": "will", "'ve": "have", "'d": "would", "'s": ""}
_IRREGULAR_NOT = {"won't": ["will", "not"], "can't": ["can", "not"], "cannot": ["can", "not"],
                  "shan't": ["shall", "not"], "ain't": ["is", "not"]}

# Words that may differ between two phrasings of one question. Deliberately few: only
# articles, present-tense copulas and "do", and question words whose swap for one another
# cannot change what is asked. Pronouns, prepositions, modals ("can dogs eat grapes?" is
# not "do dogs eat grapes?"), tense-bearing verbs (was, will, had), quantifiers and every
# negation are content: "in" vs "on", "before" vs "after", "was" vs "is" ask something
# else. A word here that is replaced by a content word is still caught: the content
# word has no partner on the other side.
_STOPWORDS = frozenset("a an the is are am be do does please kindly what which".split())
# Request framing at the start of a question ("Can you tell me ...", "Tell me ...").
_FRAMINGS = (
    ("can", "you", "tell", "me"), ("could", "you", "tell", "me"), ("would", "you", "tell", "me"),
    ("can", "you", "please", "tell", "me"), ("could", "you", "please", "tell", "me"),
    ("please", "tell", "me"), ("tell", "me"), ("do", "you", "know"), ("i", "want", "to", "know"),
    ("i", "would", "like", "to", "know"), ("i", "wonder"), ("can", "you"), ("could", "you"), ("would", "you"),
    ("hey",), ("hi",), ("hello",),
)
# "How do I X", "How can I X", "How should I X" and "How to X" ask for the same steps.
_HOW_TO = {("how", aux, who) for aux in ("do", "can", "should") for who in ("i", "you", "we", "one")}


def _words(text: str) -> list[str]:
    """Lower-cased words and numbers, contractions expanded, number words as digits."""
    out: list[str] = []
    for raw in _TOKEN.findall(_THOUSANDS.sub("", text)):
        # An acronym keeps its case: "the US" is not "us". Any other word is folded.
        word = raw if len(raw) > 1 and raw.isupper() else raw.casefold().replace("\u2019", "'")
        if word[0].isdigit():
            out.append(word.replace(",", "."))  # "1,5" (decimal comma) reads as 1.5
            continue
        if word in _IRREGULAR_NOT:
            out += _IRREGULAR_NOT[word]
            continue
        for suffix, expansion in _CONTRACTIONS.items():
            if word.endswith(suffix) and len(word) > len(suffix):
                out.append(word[: -len(suffix)])
                if expansion:
                    out.append(expansion)
                break
        else:
            out.append(word.replace("'", ""))
    return [_NUMBER_WORDS.get(w, w) for w in out]


def _symbols(text: str) -> list[str]:
    """The text's meaningful symbols, in order (see _SENTENCE_PUNCTUATION). A hyphen
    between two words of two letters or more joins them ("side-effects"); anywhere else
    ("x-y", "1e-3", "-5") it is a minus."""
    out = []
    for i, c in enumerate(text):
        if c.isalnum() or c.isspace() or c == "_" or c in _SENTENCE_PUNCTUATION:
            continue
        if c == "-" and i >= 2 and text[i - 2:i].isalpha() and text[i + 1:i + 3].isalpha():
            continue
        out.append(c)
    return out


def _stem(word: str) -> str:
    """A light English inflection stripper (lists/list, mixing/mix), for content words only.
    Too light to merge different words often; where it misses, the pair is a cache miss."""
    if word[0].isdigit() or not word.isalpha():
        return word
    if len(word) > 4 and word.endswith("ies"):
        return word[:-3] + "y"
    if len(word) > 5 and word.endswith("ing"):
        return word[:-3]
    if len(word) > 4 and word.endswith("ed"):
        return word[:-2]
    if len(word) > 4 and word.endswith(("ches", "shes", "xes", "sses", "zes")):
        return word[:-2]
    if len(word) > 3 and word.endswith("s") and not word.endswith(("ss", "us", "is")):
        return word[:-1]
    return word


def _content(words: list[str]) -> list[str]:
    for framing in _FRAMINGS:
        if tuple(words[: len(framing)]) == framing:
            words = words[len(framing):]
            break
    out: list[str] = []
    i = 0
    while i < len(words):
        if tuple(words[i: i + 3]) in _HOW_TO:
            out += ["how", "to"]
            i += 3
        else:
            out.append(words[i])
            i += 1
    return [_stem(w) for w in out if w not in _STOPWORDS]


def _is_number(word: str) -> bool:
    """Digits, or a number word as _words maps it ("#1" first, "#-1" last, "x2" twice)."""
    return word[0].isdigit() or (word[0] in "#x" and word[1:].lstrip("-")[:1].isdigit())


def _prefix_negates(words: set[str], others: set[str]) -> bool:
    """Some word of ``words`` is a word of ``others`` with a negating prefix (unsafe / safe)."""
    return any(w.startswith(p) and w[len(p):] in others for w in words - others for p in _NEGATING_PREFIXES
               if len(w) - len(p) >= 3)


def _one_block_swap(a: list[str], b: list[str]) -> bool:
    """``b`` is ``a`` with two adjacent blocks of at least two words each swapped
    ("in Python, how do I reverse a list" / "how do I reverse a list in Python"). A swap
    of single words or of the two ends of a relation ("dog bigger than cat" / "cat bigger
    than dog", "milk chocolate" / "chocolate milk") is not one."""
    start = 0
    while start < len(a) and a[start] == b[start]:
        start += 1
    end = len(a)
    while end > start and a[end - 1] == b[end - 1]:
        end -= 1
    middle_a, middle_b = a[start:end], b[start:end]
    return any(middle_b == middle_a[cut:] + middle_a[:cut] for cut in range(2, len(middle_a) - 1))


def question_difference(a: str, b: str) -> Optional[str]:
    """Why questions ``a`` and ``b`` may have different answers, or None if they ask the same.

    In order: "symbol" (the signs, operators, currency and other symbols beyond
    sentence punctuation differ, in order: 5+3 / 5-3, $ / EUR, C++ / C#), "number" (the
    multisets of numbers differ, digits and number words alike),
    "negation" (the negation words differ, or a word of one is a word of the other
    with a negating prefix: safe/unsafe, legal/illegal), "content" (the content words
    differ beyond inflection: another entity, another language, an added or dropped
    qualifier), "order" (the same content words in another order, other than two blocks
    swapped). Case (but not of acronyms: US / us), sentence punctuation, whitespace,
    articles, copulas and request framing may differ. Conservative on purpose: a refused
    paraphrase costs a model call, a wrong hit serves another question's answer.
    """
    if _symbols(a) != _symbols(b):
        return "symbol"
    words_a, words_b = _words(a), _words(b)
    if Counter(w for w in words_a if _is_number(w)) != Counter(w for w in words_b if _is_number(w)):
        return "number"
    if Counter(w for w in words_a if w in _NEGATIONS) != Counter(w for w in words_b if w in _NEGATIONS):
        return "negation"
    set_a, set_b = set(words_a), set(words_b)
    if _prefix_negates(set_a, set_b) or _prefix_negates(set_b, set_a):
        return "negation"
    content_a, content_b = _content(words_a), _content(words_b)
    if Counter(content_a) != Counter(content_b):
        return "content"
    if content_a != content_b and not _one_block_swap(content_a, content_b):
        return "order"
    return None


def same_question(a: str, b: str) -> bool:
    return question_difference(a, b) is None


# ---- the index -------------------------------------------------------------------------

# Accounting of what the index holds beyond its float32 rows, in bytes: the Python
# objects of a namespace (its slots object, dicts, lists, numpy header, name) and of
# one entry (key and question strings' headers, dict slot). Rounded up from
# tracemalloc measurements so that the budget bounds the real footprint.
_NAMESPACE_OVERHEAD = 1024
_ENTRY_OVERHEAD = 256
_SLOT_BYTES = 16  # the keys and questions list slots of one row


class _Namespace:
    """Rows of one namespace: a float32 matrix grown by doubling, used as a ring once full."""

    __slots__ = ("name", "matrix", "keys", "questions", "slot_of", "count", "next_slot", "dim", "entry_bytes",
                 "nbytes")

    def __init__(self, name: str, dim: int, capacity: int):
        self.name = name
        self.dim = dim
        self.matrix = np.zeros((capacity, dim), dtype=np.float32)
        self.keys: list[Optional[str]] = [None] * capacity
        self.questions: list[Optional[str]] = [None] * capacity
        self.slot_of: dict[str, int] = {}
        # Rows 0..count-1 are in use, or freed by discard: a freed row has no key, scores 0
        # and is skipped; the ring overwrites it in its turn, so the ring stays oldest-first.
        self.count = 0
        self.next_slot = 0  # the ring's oldest row, overwritten next once full
        self.entry_bytes = 0
        self.nbytes = 0  # as last accounted in SemanticIndex.nbytes


def _unit(vector: Any) -> np.ndarray | None:
    v = np.asarray(vector, dtype=np.float32).reshape(-1)
    norm = float(np.linalg.norm(v))
    if v.size == 0 or not math.isfinite(norm) or norm == 0.0:
        return None
    return v / norm


def _entry_bytes(key: str, question: str) -> int:
    return _ENTRY_OVERHEAD + len(key) + len(question.encode("utf-8"))


class SemanticIndex:
    """Nearest-neighbour lookup of earlier questions by embedding, per namespace, in bounded memory.

    Each namespace (from :func:`~serve_app.core.cache.keys.semantic_namespace`) holds at
    most ``max_entries_per_namespace`` L2-normalized float32 rows in one numpy matrix, so
    a lookup is one matrix-vector product (10,000 rows x 384: about 15 MB, about 1 ms on
    a 2-core CPU). A full namespace overwrites its oldest row. The whole index, all
    namespaces together, stays within ``max_bytes``: the least recently used namespaces
    go first (a namespace per conversation context and caller makes many small ones), and
    a namespace grows no larger than half the budget. Adding a key again replaces its
    vector. The index stores keys and questions, not answers: a key it returns may have
    expired from the store, in which case the caller treats it as a miss (and may
    :meth:`discard` it).
    """

    _INITIAL_CAPACITY = 1  # most namespaces (one conversation context) hold one or two rows
    _CANDIDATES = 4  # rows above the threshold checked by the guard, best first

    def __init__(self, *, max_entries_per_namespace: int = 10_000, threshold: float = 0.95,
                 max_bytes: int = 64 * 2**20):
        if max_entries_per_namespace < 1:
            raise ValueError(f"max_entries_per_namespace is {max_entries_per_namespace}; it must be at least 1")
        if not -1.0 <= threshold <= 1.0:
            raise ValueError(f"threshold is {threshold}; a cosine similarity lies in [-1, 1]")
        if max_bytes < 4 * _NAMESPACE_OVERHEAD:
            raise ValueError(f"max_bytes is {max_bytes}; it must be at least {4 * _NAMESPACE_OVERHEAD}")
        self.max_entries_per_namespace = max_entries_per_namespace
        self.threshold = threshold
        self.max_bytes = max_bytes
        self._spaces: OrderedDict[str, _Namespace] = OrderedDict()  # least recently used first
        self.nbytes = 0  # accounted bytes of every namespace together
        self.evictions = 0  # entries dropped for the byte budget
        self.refused = 0  # lookups whose similar candidates the guard refused

    def __len__(self) -> int:
        return sum(len(ns.slot_of) for ns in self._spaces.values())

    @property
    def namespaces(self) -> int:
        return len(self._spaces)

    # ---- accounting ----

    def _account(self, ns: _Namespace) -> None:
        rows = ns.matrix.shape[0]
        nbytes = _NAMESPACE_OVERHEAD + len(ns.name) + ns.matrix.nbytes + rows * _SLOT_BYTES + ns.entry_bytes
        self.nbytes += nbytes - ns.nbytes
        ns.nbytes = nbytes

    def _row_limit(self, dim: int) -> int:
        # A namespace's matrix never takes more than half the budget, so one busy
        # namespace cannot evict every other one, and growing it can never overshoot.
        return max(1, min(self.max_entries_per_namespace, (self.max_bytes // 2) // (dim * 4 + _SLOT_BYTES)))

    def _drop_namespace(self, name: str) -> int:
        ns = self._spaces.pop(name)
        self.nbytes -= ns.nbytes
        return len(ns.slot_of)

    def _free_slot(self, ns: _Namespace, slot: int) -> None:
        key = ns.keys[slot]
        if key is None:
            return
        del ns.slot_of[key]
        ns.entry_bytes -= _entry_bytes(key, ns.questions[slot] or "")
        ns.keys[slot] = ns.questions[slot] = None
        ns.matrix[slot] = 0.0  # scores 0 against everything; and skipped as keyless anyway

    def _enforce_budget(self, current: _Namespace) -> None:
        while self.nbytes > self.max_bytes:
            oldest = next(iter(self._spaces.values()))
            if oldest is not current:
                self.evictions += self._drop_namespace(oldest.name)
                continue
            # Only the namespace just written is left: drop its oldest rows, never the
            # newest (the row limit keeps its matrix within half the budget).
            victims = [s for s in _ring_order(current) if current.keys[s] is not None]
            if len(victims) <= 1:
                return
            self._free_slot(current, victims[0])
            self.evictions += 1
            self._account(current)

    # ---- the API ----

    def add(self, namespace: str, vector: Sequence[float], key: str, question: str) -> None:
        """Remember that ``question`` (embedded as ``vector``) was answered under ``key``."""
        unit = _unit(vector)
        if unit is None:
            return  # a zero or non-finite vector has no direction to match on
        if len(question) > MAX_QUESTION_CHARS:
            return  # see MAX_QUESTION_CHARS; semantic_request never sends one
        ns = self._spaces.get(namespace)
        if ns is None:
            ns = self._spaces[namespace] = _Namespace(namespace, unit.size, self._INITIAL_CAPACITY)
        elif unit.size != ns.dim:
            raise ValueError(f"vector has {unit.size} dimensions; namespace {namespace!r} holds {ns.dim}")
        self._spaces.move_to_end(namespace)
        slot = ns.slot_of.get(key)
        if slot is not None:
            self._free_slot(ns, slot)  # the same key again: replace its vector and question
        elif ns.count < self._row_limit(ns.dim):
            if ns.count == ns.matrix.shape[0]:
                self._grow(ns)
            slot = ns.count
            ns.count += 1
        else:
            slot = ns.next_slot  # the oldest row
            ns.next_slot = (slot + 1) % ns.count
            # The row may be one that discard freed, with no key to forget (this raised
            # KeyError(None) once).
            self._free_slot(ns, slot)
        ns.keys[slot], ns.questions[slot] = key, question
        ns.slot_of[key] = slot
        ns.entry_bytes += _entry_bytes(key, question)
        ns.matrix[slot] = unit
        self._account(ns)
        self._enforce_budget(ns)

    def _grow(self, ns: _Namespace) -> None:
        capacity = min(ns.matrix.shape[0] * 2, self._row_limit(ns.dim))
        matrix = np.zeros((capacity, ns.dim), dtype=np.float32)
        matrix[: ns.count] = ns.matrix[: ns.count]
        ns.matrix = matrix
        ns.keys.extend([None] * (capacity - len(ns.keys)))
        ns.questions.extend([None] * (capacity - len(ns.questions)))

    def lookup(self, namespace: str, vector: Sequence[float], question: str, *,
               threshold: float | None = None) -> tuple[str, float] | None:
        """The key of the most similar stored question with cosine >= ``threshold`` (default:
        the index's) that :func:`same_question` accepts as asking what ``question`` asks."""
        ns = self._spaces.get(namespace)
        if ns is None or not ns.slot_of:
            return None
        unit = _unit(vector)
        if unit is None or unit.size != ns.dim:
            return None
        self._spaces.move_to_end(namespace)
        limit = self.threshold if threshold is None else threshold
        scores = ns.matrix[: ns.count] @ unit
        if ns.count > self._CANDIDATES:
            best = np.argpartition(-scores, self._CANDIDATES)[: self._CANDIDATES]
        else:
            best = np.arange(ns.count)
        refused = False
        for slot in sorted(best.tolist(), key=lambda s: -scores[s]):
            similarity = float(scores[slot])
            if similarity < limit:
                break
            key = ns.keys[slot]
            if key is None:  # a freed row
                continue
            if same_question(question, ns.questions[slot] or ""):
                return key, min(similarity, 1.0)
            refused = True
        self.refused += refused
        return None

    def discard(self, namespace: str, key: str) -> bool:
        """Forget one key (say, its entry expired from the store). True if it was there."""
        ns = self._spaces.get(namespace)
        if ns is None or key not in ns.slot_of:
            return False
        self._free_slot(ns, ns.slot_of[key])
        if not ns.slot_of:
            self._drop_namespace(namespace)
        else:
            self._account(ns)
        return True

    def drop_prefix(self, model: str) -> int:
        """Drop every namespace of ``model`` (all revisions); return how many entries went."""
        prefix = _model_part(model) + ":"
        doomed = [name for name in self._spaces if name.startswith(prefix)]
        return sum(self._drop_namespace(name) for name in doomed)


def _ring_order(ns: _Namespace) -> list[int]:
    """The rows of a namespace from oldest to newest, as the ring overwrites them."""
    return [(ns.next_slot + i) % ns.count for i in range(ns.count)]
