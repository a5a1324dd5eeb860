"""Language identification for rows whose source does not declare a language.

Chinese, Japanese and Korean are told apart by script, which is exact and cheap; Traditional and
Simplified Chinese are both `zh`. `LanguageChooser` decides a record's language among a scheme's
languages plus `other` (prepare's rule, docs/data.md "Languages"): by script in the core install;
lingua, a statistical detector that runs offline (the `langid` extra), is asked only to tell
Latin-script languages apart, and without it Latin-script text is the scheme's one Latin-script
language. `detect_language` is the open-ended detector over every language lingua knows. Short
Latin-script texts are too ambiguous for any detector ("Yes." reads as Catalan), so they default to
English unless the detector is confident. lingua runs in its low-accuracy mode
(trigram models only): about 70 MB and a quarter second to load, against about 900 MB and five seconds
for the full models, with the same answers on sentence-length text.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from dataclasses import dataclass

from polyalign.core.extras import require

UNDETERMINED = "und"
_MIN_LETTERS_FOR_DETECTOR = 24
_MIN_CONFIDENCE = 0.6


def _script_counts(text: str) -> dict[str, int]:
    counts = {"han": 0, "kana": 0, "hangul": 0, "latin": 0, "other": 0}
    for ch in text:
        cp = ord(ch)
        if 0x3400 <= cp <= 0x4DBF or 0x4E00 <= cp <= 0x9FFF or 0xF900 <= cp <= 0xFAFF or 0x20000 <= cp <= 0x2FA1F:
            counts["han"] += 1
        elif 0x3040 <= cp <= 0x30FF or 0x31F0 <= cp <= 0x31FF:
            counts["kana"] += 1
        elif 0xAC00 <= cp <= 0xD7AF or 0x1100 <= cp <= 0x11FF or 0x3130 <= cp <= 0x318F:
            counts["hangul"] += 1
        elif ch.isalpha():
            if cp < 0x250 or 0x1E00 <= cp <= 0x1EFF or 0xFF21 <= cp <= 0xFF5A:
                counts["latin"] += 1
            else:
                counts["other"] += 1
    return counts


# Everyday Chinese characters Japanese writing does not use (pronouns, question particles, simplified
# forms): a Chinese sentence quoting a Japanese title has kana, but a Japanese sentence has none of these.
_CHINESE_ONLY = frozenset("你们吗呢吧这还么说对个为时过给让哪谁啊呀"  # pronouns, particles
                          "电车门见问长东书语话请谢认识读买卖钱饭馆发经样进实关开网")  # simplified forms


def _japanese(counts: dict[str, int], text: str) -> bool:
    """Han text with kana reads as Japanese (kana over a tenth of it), unless the kana are the smaller part
    and Chinese-only characters show the sentence around them is Chinese (`原版名称叫：借りぐらしのアリエッ
    ティ，你知道还有其他名字吗？` is a Chinese question naming a Japanese film)."""
    if counts["kana"] * 10 <= counts["han"] + counts["kana"]:
        return False
    return counts["kana"] >= counts["han"] or sum(ch in _CHINESE_ONLY for ch in text) < 2


# The script each declared language is written in; a language not listed is not checked.
_SCRIPT_OF = {"zh": ("han",), "ja": ("kana", "han"), "ko": ("hangul", "han")}
_LATIN_LANGUAGES = frozenset("en fr de es it pt nl sv da no fi pl cs sk sl hr ro hu tr id ms vi".split())
_MIN_LETTERS_FOR_SCRIPT = 10


def contradicting_script(declared: str, text: str, min_weighed: int | None = None) -> str | None:
    """The script most of `text`'s letters are in, when it cannot be the declared language's (e.g.
    Arabic or Hebrew letters in an `en` source, no Chinese character in a `zh` one); None when the text
    agrees, is too short to tell (under _MIN_LETTERS_FOR_SCRIPT letters, or `min_weighed` weighed ones: a
    CJK character counting 3), or the language is not one whose script is known here."""
    expected = _SCRIPT_OF.get(declared) or (("latin",) if declared in _LATIN_LANGUAGES else None)
    if expected is None:
        return None
    counts = _script_counts(text)
    # weighed as detect_language does: one CJK character carries about a short word
    weighed = {script: n * (3 if script in ("han", "kana", "hangul") else 1) for script, n in counts.items()}
    if (sum(counts.values()) if min_weighed is None else sum(weighed.values())) < (
            _MIN_LETTERS_FOR_SCRIPT if min_weighed is None else min_weighed):
        return None
    if sum(weighed[s] for s in expected) * 2 >= sum(weighed.values()):
        return None
    return max(weighed, key=weighed.get)


@functools.lru_cache(maxsize=1)
def _detector():
    lingua = require("lingua", "langid", "detecting the language of rows whose source declares none",
                     "or give the source a `language:` in the data config")
    return lingua.LanguageDetectorBuilder.from_all_languages().with_low_accuracy_mode().build()


def _lingua_code(text: str) -> tuple[str, float]:
    values = _detector().compute_language_confidence_values(text[:2000])
    if not values:
        return UNDETERMINED, 0.0
    best = values[0]
    return best.language.iso_code_639_1.name.lower(), best.value


def detect_language(text: str) -> str:
    """ISO 639-1 code of the dominant language of `text`, or "und" when there is no letter at all."""
    counts = _script_counts(text)
    cjk = counts["han"] + counts["kana"] + counts["hangul"]
    letters = cjk + counts["latin"] + counts["other"]
    if letters == 0:
        return UNDETERMINED
    # One CJK character carries about as much as a short Latin word; weigh them so that a Chinese
    # sentence quoting an English term stays Chinese and vice versa.
    if cjk * 3 >= counts["latin"] + counts["other"]:
        if counts["hangul"] > counts["han"] + counts["kana"]:
            return "ko"
        return "ja" if _japanese(counts, text) else "zh"
    if counts["latin"] >= counts["other"]:
        if counts["latin"] < _MIN_LETTERS_FOR_DETECTOR:
            return "en"
        code, confidence = _lingua_code(text)
        return code if code != "en" and confidence >= _MIN_CONFIDENCE else "en"
    code, _ = _lingua_code(unicodedata.normalize("NFC", text))
    return code


# --- choosing among a scheme's languages -----------------------------------------------------------

CJK_LANGUAGES = ("zh", "ja", "ko")
OTHER = "other"
_CLEAR_SHARE = 0.8  # a text is "clearly" in a script when this share of its weighed letters is
_MIN_WEIGHED = 10  # a response with fewer weighed letters than this cannot decide alone
_OTHER_CONFIDENCE = 0.99  # lingua must be this sure before Latin text is called a language outside the scheme
EVEN_SHARE = 0.6  # a conversation whose main script holds less than this of its letters is split nearly evenly


@dataclass(frozen=True)
class ScriptReading:
    language: str  # zh, ja, ko, "latin", "script" (another script), or und
    share: float  # of the weighed letters, the share in that script
    weighed: int  # letters, a CJK character counting 3


# Code and TeX are no language: a Chinese question about JavaScript is Chinese however long its code
# block (SegmentFault), and COIG's answers are full of math. Fenced blocks, inline code, $...$, $$...$$
# and TeX commands (\\frac) are left out before a text is read. Inline code may wrap onto the next line but
# never spans a blank one (CommonMark's code spans).
_NOT_PROSE = re.compile(r"```.*?(?:```|$)|`(?:[^`\n]|\n(?![ \t]*\n))+`|\$\$.*?\$\$|\$[^$\n]*\$|\\[A-Za-z]+", re.DOTALL)


def prose(text: str) -> str:
    """`text` less its code and math (`_NOT_PROSE`), or the whole text where that leaves no letter: a row
    that is only code is read as it is (its identifiers and comments), not as a text with no language."""
    stripped = _NOT_PROSE.sub(" ", text)
    return stripped if any(ch.isalpha() for ch in stripped) else text


def has_prose(text: str) -> bool:
    """Whether `text` holds a letter outside its code and math: an answer that is only a code block or a
    formula does not say which language its conversation is in (the question does)."""
    return any(ch.isalpha() for ch in _NOT_PROSE.sub(" ", text))


def read_script(text: str) -> ScriptReading:
    """The script most of `text`'s letters are in (code and TeX left out where prose remains), its share and
    the letter count."""
    text = prose(text)
    counts = _script_counts(text)
    weighed = {script: n * (3 if script in ("han", "kana", "hangul") else 1) for script, n in counts.items()}
    total = sum(weighed.values())
    if total == 0:
        return ScriptReading(UNDETERMINED, 0.0, 0)
    cjk = weighed["han"] + weighed["kana"] + weighed["hangul"]
    if cjk * 2 >= total:
        if counts["hangul"] > counts["han"] + counts["kana"]:
            language = "ko"
        else:
            language = "ja" if _japanese(counts, text) else "zh"
        return ScriptReading(language, cjk / total, total)
    if weighed["latin"] >= weighed["other"]:
        return ScriptReading("latin", weighed["latin"] / total, total)
    return ScriptReading("script", weighed["other"] / total, total)


# Scripts in words, for a reader told an answer is written in one.
SCRIPT_WORDS = {"han": "Chinese characters", "kana": "Japanese kana", "hangul": "Hangul", "latin": "Latin letters",
                "other": "another script"}


# A reply of two CJK characters (是啊, 多谢) or four Latin letters (sure) is in a language; a source row is
# judged on ten letters (prepare's check), but a dialogue's answers are often shorter than that.
_MIN_WEIGHED_FOR_ANSWER = 4


def wrong_script(language: str, text: str) -> str | None:
    """The script an answer in a `language` conversation is mostly written in when that language is not
    written in it (`contradicting_script`, on its prose: a Chinese answer quoting code stays Chinese);
    None when it agrees, is too short to tell (under two CJK characters or four Latin letters: "OK" in a
    Chinese conversation says nothing), or is only code or math (which says no language)."""
    return contradicting_script(language, prose(text), _MIN_WEIGHED_FOR_ANSWER) if has_prose(text) else None


def lingua_available() -> bool:
    try:
        # optional extra: langid; this only asks whether lingua is installed
        import lingua  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=1)
def _latin_detector():
    """lingua over the major Latin-script languages only: over every language it knows, its trigram
    models call plain English Yoruba with 99% confidence ("Venezuela is located in South America...")."""
    from lingua import IsoCode639_1, Language, LanguageDetectorBuilder  # optional extra: langid (lingua)

    languages = [Language.from_iso_code_639_1(getattr(IsoCode639_1, code.upper()))
                 for code in sorted(_LATIN_LANGUAGES - {"no"}) + ["nb"]]
    return LanguageDetectorBuilder.from_languages(*languages).with_low_accuracy_mode().build()


def _latin_code(text: str) -> tuple[str, float]:
    values = _latin_detector().compute_language_confidence_values(text[:2000])
    if not values:
        return UNDETERMINED, 0.0
    return values[0].language.iso_code_639_1.name.lower(), values[0].value


def _prompt_prevails(asked: ScriptReading, reading: ScriptReading) -> bool:
    """Whether the prompt, mostly (EVEN_SHARE) in another script than the answer and longer, keeps the
    answer from deciding: a Chinese passage and question answered with an English title is zh."""
    return asked.language != reading.language and asked.share >= EVEN_SHARE and asked.weighed >= reading.weighed


class LanguageChooser:
    """A record's language among `languages` (the scheme's) plus `other`.

    - Script first: text mostly in Chinese characters is zh, with enough kana ja, Hangul ko.
    - The text decided on (code and TeX math left out): a conversation's whole text (one language per
      dialogue), unless the record's response has prose and is clearly (80%) in another script: from 5
      weighed letters where the conversation's main script holds under EVEN_SHARE (60%) of it, otherwise
      from 20 and not against a prompt mostly in another script and longer (`_in_conversation`). A
      single row: its response when that is clearly in one script (80% of at least 10 weighed
      letters) and the prompt (context and question) is not mostly (60%) in another and longer;
      otherwise the whole row. So a Chinese question quoting a long
      English title is decided by its Chinese answer, and a Chinese passage's answer naming English
      terms stays zh.
    - Latin script: with lingua installed (over the major Latin-script languages), it chooses among
      the scheme's Latin-script languages,
      calling the text `other` only when it is at least 99% sure of a language outside the scheme on
      24 letters or more (for a single row: of its response and of the whole row), and never where the
      prompt, 24 Latin letters or more, does not read as another language (`_unless_prompt_says`); without lingua,
      the scheme's first Latin-script language (en), and `note` says so once in the manifest. Another
      script: lingua's language if the scheme has it, else `other`.
    """

    def __init__(self, languages):
        self.languages = tuple(languages)
        self.latin = [code for code in self.languages if code in _LATIN_LANGUAGES]
        self.lingua = lingua_available()
        self._conversation: tuple[str | None, str] = (None, "")

    @property
    def note(self) -> str:
        if self.lingua:
            return (f"by script; Latin-script text told apart by lingua among {', '.join(self.latin) or 'none'} "
                    "and other")
        return ("by script; lingua not installed (the langid extra), so Latin-script text is taken as "
                f"{self.latin[0] if self.latin else OTHER} without telling Latin-script languages apart")

    def choose(self, response: str, prompt: str, conversation: str | None = None) -> str:
        if conversation is not None:
            return self._in_conversation(response, prompt, conversation)
        reading, asked = read_script(response), read_script(prompt)
        whole = f"{prompt}\n{response}"
        response_decides = has_prose(response) and reading.weighed >= _MIN_WEIGHED and reading.share >= _CLEAR_SHARE \
            and not _prompt_prevails(asked, reading)
        if not response_decides:
            return self._unless_prompt_says(prompt, self._name(whole, read_script(whole)))
        if asked.language == reading.language == "latin" and self.lingua:
            # `other` only when lingua says so of the response alone and of the whole row
            named = {self._name(response, reading), self._name(whole, read_script(whole))}
            return self._unless_prompt_says(prompt, OTHER) if named == {OTHER} else min(named - {OTHER})
        return self._unless_prompt_says(prompt, self._name(response, reading))

    def _unless_prompt_says(self, prompt: str, language: str) -> str:
        """`language`, unless it is `other` and the prompt is long enough to tell (_MIN_LETTERS_FOR_DETECTOR
        Latin letters of prose) and lingua does not call it another language: then the scheme's Latin-script
        language it is. An English question answered with foreign names ("Cléopâtre from director Georges
        Méliès", a list of Italian prime ministers) is an English row; lingua's trigrams, 99% sure of French
        on the whole row, were not."""
        if language != OTHER or not self.lingua or not self.latin:
            return language
        text = prose(prompt)
        reading = read_script(text)
        if reading.language != "latin" or _script_counts(text)["latin"] < _MIN_LETTERS_FOR_DETECTOR:
            return language
        named = self._name(text, reading)
        return named if named in self.latin else language

    def _in_conversation(self, response: str, prompt: str, conversation: str) -> str:
        """A reply's language in a conversation, which decides unless the reply is clearly in another
        script and has prose: where the conversation is split nearly evenly between scripts (EVEN_SHARE),
        from 5 weighed letters (a Chinese passage listing English song titles, answered with a name in
        Chinese characters); otherwise from 20, and not where what came before the reply is mostly in
        another script and longer (a Chinese passage and question answered with an English title stays
        zh, as a single row does). `other` needs both to say so: a foreign name as the reply of a
        Chinese conversation stays zh, an English conversation about a Polish village stays en."""
        reading = read_script(response)
        if self._conversation[0] is not conversation:
            whole = read_script(conversation)
            self._conversation = (conversation, (self._name(conversation, whole), whole))
        language, whole = self._conversation[1]
        if not has_prose(response):  # a reply that is only code or a formula: the conversation says
            return language
        if whole.share < EVEN_SHARE:
            decides = reading.weighed >= _MIN_WEIGHED // 2
        else:
            decides = reading.weighed >= 2 * _MIN_WEIGHED and not _prompt_prevails(read_script(prompt), reading)
        if decides and reading.share >= _CLEAR_SHARE and reading.language != whole.language:
            named = self._name(response, reading)
            return language if named == OTHER and language != OTHER else self._unless_prompt_says(prompt, named)
        if language == OTHER and reading.weighed >= _MIN_WEIGHED:
            return self._unless_prompt_says(prompt, self._name(response, reading))
        return self._unless_prompt_says(prompt, language)

    def outside_name(self, text: str) -> str:
        """What a text `choose` called `other` is, for the reason it is left out of a scheme without `other`:
        lingua's language where the langid extra is installed (an English row in a Chinese-only scheme is
        `en`), else its script (`latin_script`, `other_script`): `other` told a user nothing."""
        text = prose(text)
        reading = read_script(text)
        if self.lingua:
            code, _ = (_latin_code if reading.language == "latin" else _lingua_code)(unicodedata.normalize("NFC", text))
            if code != UNDETERMINED:
                return code
        return {"latin": "latin_script", "script": "other_script"}.get(reading.language, OTHER)

    def _name(self, text: str, reading: ScriptReading) -> str:
        if reading.language in CJK_LANGUAGES or reading.language == UNDETERMINED:
            return reading.language
        if reading.language == "latin":
            if not self.lingua:
                return self.latin[0] if self.latin else OTHER
            code, confidence = _latin_code(prose(text))
            if code in self.latin:
                return code
            if code != UNDETERMINED and confidence >= _OTHER_CONFIDENCE and _script_counts(prose(text))["latin"] >= \
                    _MIN_LETTERS_FOR_DETECTOR or not self.latin:
                return OTHER
            return self.latin[0]
        if not self.lingua:
            return OTHER
        code, _ = _lingua_code(unicodedata.normalize("NFC", prose(text)))
        return code if code in self.languages else OTHER
