import json
import zipfile

import pytest

from polyalign.data import language
from polyalign.data.language import LanguageChooser, detect_language
from tests.conftest import DEMO_DATA, write_config


@pytest.mark.parametrize("text,expected", [
    ("I need to find an expensive restaurant that's in the south section of the city.", "en"),
    ("Yes.", "en"),
    ("北京是中国的首都。它有3000多年历史！", "zh"),
    ("《戰國無雙3》是由光榮和ω-force開發的戰國無雙系列的正統第三續作。", "zh"),
    ("我用Python写了一个HTTP服务器", "zh"),
    ("The word 你好 means hello in Mandarin Chinese, and people use it every day.", "en"),
    ("東京は日本の首都であり、世界最大の都市圏を形成している。", "ja"),
    ("서울은 대한민국의 수도이며 가장 큰 도시입니다.", "ko"),
    ("Je voudrais réserver une table pour deux personnes ce soir, s'il vous plaît.", "fr"),
    ("12345 !!! ...", "und"),
])
def test_detect_language(text, expected):
    assert detect_language(text) == expected


def test_a_chinese_turn_naming_a_japanese_title_stays_chinese():
    """KdConv (film, test dialogue 33, turn 6): a Chinese question naming a film by its Japanese title. Its
    kana are over a tenth of its characters, which read as Japanese and dropped the turn from a zh
    dialogue; the Chinese-only characters around the title (你, 还, 吗) keep it Chinese. Japanese text
    stays Japanese."""
    from tests.conftest import SHARED_DATA

    dialogue = json.loads((SHARED_DATA / "zh/kdconv/film/test.json").read_text(encoding="utf-8"))[33]
    turn = dialogue["messages"][5]["message"]
    assert "借りぐらしのアリエッティ" in turn
    assert detect_language(turn) == "zh" and language.read_script(turn).language == "zh"
    assert LanguageChooser(["zh", "en"]).choose(turn, "", None) == "zh"
    assert language.read_script("東京は日本の首都であり、世界最大の都市圏を形成している。").language == "ja"


# --- choosing among the scheme's languages (prepare's rule) ------------------------------------------


def cmrc_question(text):
    document = json.loads((DEMO_DATA / "zh/cmrc2018/cmrc2018_trial.json").read_text(encoding="utf-8"))
    return next((p["context"], qa) for a in document["data"] for p in a["paragraphs"] for qa in p["qas"]
                if qa["question"] == text)


@pytest.mark.parametrize("lingua", [True, False])
def test_a_question_quoting_an_english_title_is_decided_by_its_chinese_answer(monkeypatch, lingua):
    monkeypatch.setattr(language, "lingua_available", lambda: lingua)
    context, qa = cmrc_question("MIT OpenCourseWare指什么？")  # mostly Latin letters, a Chinese answer
    answer = qa["answers"][0]["text"]
    chooser = LanguageChooser(["en", "zh"])
    assert language.read_script(qa["question"]).language == "latin"
    assert chooser.choose(answer, qa["question"]) == "zh"
    assert chooser.choose(answer, f"{context}\n{qa['question']}") == "zh"
    # an answer naming English terms under a Chinese question stays zh as well
    context, qa = cmrc_question("MonoDevelop目前支持的语言有哪些？")
    assert chooser.choose(qa["answers"][0]["text"], f"{context}\n{qa['question']}") == "zh"


def test_lingua_only_chooses_among_the_scheme_languages_and_other(monkeypatch):
    dutch = ("De dag dat Jezus gekruisigd werd", "Wat is goede vrijdag?")  # a real row of the PolyAlign sample
    assert LanguageChooser(["en", "zh"]).choose(*dutch) == "other"
    monkeypatch.setattr(language, "lingua_available", lambda: False)
    chooser = LanguageChooser(["en", "zh"])
    assert chooser.choose(*dutch) == "en" and "lingua not installed" in chooser.note


def _chats_and_reading(tmp_path, dialogues: int | None = None):
    """(rows, data config): an English chat export of CamRest676's dialogues (the first `dialogues`) and
    the CMRC 2018 file, neither declaring a language."""
    every = json.loads(zipfile.ZipFile(DEMO_DATA / "en/camrest676/data.zip").read("data/dialogues.json"))
    rows = [{"id": d["dialogue_id"], "messages": [
        {"role": "user" if t["speaker"] == "user" else "assistant", "content": t["utterance"]} for t in d["turns"]]}
        for d in every[:dialogues]]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    config = write_config(tmp_path / "data.yaml", [
        {"name": "restaurant_chats", "format": "chat", "path": "chat.jsonl"},
        {"name": "reading", "format": "squad", "path": str(DEMO_DATA / "zh/cmrc2018/cmrc2018_trial.json")}],
        dedup=False)
    return rows, config


@pytest.mark.parametrize("lingua", [True, False])
def test_en_chat_and_zh_qa_without_language_prepare_keeping_every_row(monkeypatch, tmp_path, lingua):
    """The core install (lingua absent) and the langid extra: an English chat export of every CamRest676
    dialogue (short turns such as "Thank you goodbye." decided with their dialogue) and the CMRC 2018
    file, neither declaring a language, keep every row under en and zh."""
    from polyalign.data.prepare import prepare

    monkeypatch.setattr(language, "lingua_available", lambda: lingua)
    rows, config = _chats_and_reading(tmp_path)
    manifest = prepare(config, tmp_path / "run", progress=False)
    chats, reading = manifest["sources"]
    assert chats["detected_languages"] == {"en": chats["records"]} and chats["kept"] == chats["records"]
    assert chats["read"] == len(rows) < chats["records"]  # a dialogue row becomes a record per reply
    assert reading["detected_languages"] == {"zh": reading["records"]} and reading["kept"] == reading["read"] == 1002
    assert ("lingua not installed" in manifest["language_detection"]) is not lingua


@pytest.mark.parametrize("lingua, named", [(True, "en"), (False, "latin_script")])
def test_rows_in_a_language_the_scheme_leaves_out_are_dropped_under_what_they_are(monkeypatch, tmp_path, lingua,
                                                                                   named):
    """A Chinese-only scheme and an English chat export that declares no language: every reply is dropped as
    language_not_in_scheme:en (lingua) or :latin_script (the core install), counted under that name in
    detected_languages and listed in dropped.jsonl; `other` said nothing of what the rows were."""
    import yaml

    from polyalign.data.prepare import prepare
    from tests.conftest import SCHEME, read_jsonl

    monkeypatch.setattr(language, "lingua_available", lambda: lingua)
    scheme = yaml.safe_load(SCHEME.read_text())
    scheme["values"]["language"] = ["zh"]
    (tmp_path / "zh_only.yaml").write_text(yaml.safe_dump(scheme, allow_unicode=True))
    rows, config = _chats_and_reading(tmp_path, dialogues=5)
    config.write_text(config.read_text().replace(str(SCHEME), str(tmp_path / "zh_only.yaml")))
    manifest = prepare(config, tmp_path / "run", progress=False)
    chats = manifest["sources"][0]
    replies = sum(m["role"] == "assistant" for r in rows for m in r["messages"])
    assert chats["detected_languages"] == {named: replies} and chats["kept"] == 0
    assert chats["dropped"] == {f"language_not_in_scheme:{named}": replies}
    dropped = read_jsonl(tmp_path / "run" / "data" / "dropped.jsonl")
    assert {d["reason"] for d in dropped if d["source"] == "restaurant_chats"} == {f"language_not_in_scheme:{named}"}


def _conversation(user: str, reply: str) -> tuple[str, str, str]:
    """(reply, prompt, conversation) as a two-turn chat export's record reaches the chooser."""
    return reply, user, f"{user}\n{reply}"


def _shared_rows():
    """Real conversations whose language the dialogue rule once got wrong: a CMRC 2018 passage listing
    English song titles answered with a Chinese name; a CMRC question answered with a Vietnamese bank's
    Latin-script name; a SegmentFault question that is mostly JavaScript; an English question about a
    Polish village, its passage full of Polish names."""
    from tests.conftest import SHARED_DATA

    def squad(path, question):
        document = json.loads((SHARED_DATA / path).read_text(encoding="utf-8"))
        return next((p["context"], qa["answers"][0]["text"]) for a in document["data"] for p in a["paragraphs"]
                    for qa in p["qas"] if qa["question"] == question) + (question,)

    context, answer, question = squad("zh/cmrc2018/cmrc2018_dev.json", "铺轨（Making Tracks）的主演员是谁？")
    songs = _conversation(f"{context}\n\n问题：{question}", answer)
    context, answer, question = squad("zh/cmrc2018/cmrc2018_trial.json", "西贡商业信用银行的英文名是什么？")
    bank = _conversation(f"{context}\n\n问题：{question}", answer)
    with open(SHARED_DATA / "zh/coig-cqia/segmentfault/segmentfault_upvote5_clean.jsonl", encoding="utf-8") as rows:
        row = next(r for r in map(json.loads, rows) if r["output"].startswith("执行效率没什么问题"))
    code = _conversation(f"{row['instruction']}\n{row['input']}".strip(), row["output"])
    sample = json.loads((SHARED_DATA / "en/polyalign-sample/dist_sft_test.json").read_text(encoding="utf-8"))
    row = next(r for r in sample if r["output"].startswith("Laskowice is a village"))
    village = _conversation(f"{row['instruction']}\n\n{row['input']}", row["output"])
    return songs, bank, code, village


def test_a_conversation_keeps_its_language_unless_a_clear_reply_says_otherwise_and_other_needs_both():
    songs, bank, code, village = _shared_rows()
    assert language.read_script(songs[2]).share < 0.8 and language.read_script(songs[0]).weighed < 10
    assert "```" in code[2] and language.read_script(code[2]).language == "zh"  # code is no language
    chooser = LanguageChooser(["en", "zh"])
    assert [chooser.choose(*row) for row in (songs, bank, code, village)] == ["zh", "zh", "zh", "en"]
    # the single-row rule is unchanged by these: a row is not a conversation
    assert LanguageChooser(["en", "zh"]).choose(village[0], village[1]) == "en"
    # a reply clearly in another script of a clear conversation still decides (an English reply to a
    # Chinese request), and a Latin-script conversation lingua calls another language stays `other`
    dutch = ("De dag dat Jezus gekruisigd werd", "Wat is goede vrijdag?")  # the PolyAlign sample's Dutch row
    assert chooser.choose(*_conversation(*reversed(dutch))) == "other"
    assert chooser.choose(village[0], songs[1], f"{songs[1]}\n{village[0]}") == "en"
    # a reply, row or conversation that is only code is read as it is (lingua's reading of its identifiers),
    # never as a text with no letters (`und`, dropped)
    block = "```\n" + "\n".join(line for line in code[0].splitlines() if line.isascii() and "```" not in line) + "\n```"
    assert language.prose(block) == block and language.read_script(block).language == "latin"
    assert chooser.choose(block, block) == chooser.choose(block, block, f"{block}\n{block}") == "other"
    assert chooser.choose("```\nprint(1)\n```", "```\nx = foo(bar)\n```") == "en"  # too few letters to tell


@pytest.mark.parametrize("path, question", [
    ("zh/cmrc2018/cmrc2018_dev.json", "艾里森创作《星际奇航》中哪一集赢得了当年美国编剧工会的最佳电视剧本奖？"),
    ("zh/cmrc2018/cmrc2018_dev.json", "至NET奇兵的法文版主题曲叫什么名字？"),
    ("zh/cmrc2018/cmrc2018_trial.json", "德国环境与自然保护联盟的英文是什么？")])
def test_a_chinese_passage_answered_with_an_english_title_stays_chinese_as_a_conversation(path, question):
    """CMRC 2018 questions whose answer spans are English (or French) titles, as a support team exported them
    (one user turn of passage and question, one reply): the passage and question, mostly Chinese and longer,
    keep the conversation zh, as the same row read as a single row is."""
    from tests.conftest import SHARED_DATA

    document = json.loads((SHARED_DATA / path).read_text(encoding="utf-8"))
    context, answer = next((p["context"], qa["answers"][0]["text"]) for a in document["data"]
                           for p in a["paragraphs"] for qa in p["qas"] if qa["question"] == question)
    user = f"{context}\n\n问题：{question}"
    assert language.read_script(answer).language == "latin" and language.read_script(user).language == "zh"
    chooser = LanguageChooser(["en", "zh"])
    assert chooser.choose(answer, user, f"{user}\n{answer}") == "zh"
    assert chooser.choose(answer, user) == "zh"


@pytest.mark.parametrize("folder, row", [("segmentfault", 5), ("zhihu", 83)])
def test_an_answer_that_is_only_code_or_a_formula_leaves_the_language_to_the_question(folder, row):
    """COIG-CQIA rows a support team's logs held: a Chinese TypeScript question answered with one code
    block, a Chinese series question answered with one $$...$$ formula. The answer has no prose, so the
    question decides, as a row and as a conversation."""
    from tests.conftest import SHARED_DATA

    path = next((SHARED_DATA / "zh/coig-cqia" / folder).glob("*.jsonl"))
    with path.open(encoding="utf-8") as rows:
        record = json.loads(next(line for k, line in enumerate(rows) if k == row))
    question, answer = f"{record['instruction']}\n{record['input']}".strip(), record["output"]
    assert not language.has_prose(answer) and language.has_prose(question)
    chooser = LanguageChooser(["en", "zh"])
    assert chooser.choose(answer, question) == "zh"
    assert chooser.choose(answer, question, f"{question}\n{answer}") == "zh"


def test_short_replies_in_the_other_language_are_told_apart_and_a_word_or_two_are_not(demo_run):
    """evaluate's wrong-language check (`wrong_script`) on real short replies of the demo data: a Chinese reply
    of two or three characters in an English conversation is Chinese, an English one of a few words in a
    Chinese conversation is English (prepare's ten-letter rule left them unjudged); a lone character or a
    two-letter word says nothing; each agrees with its own language."""
    from polyalign.data.language import contradicting_script, wrong_script
    from polyalign.data.records import read_records

    records = read_records(demo_run[0] / "data" / "train.jsonl")
    chinese = [r.response for r in records if r.language == "zh" and 2 <= len(r.response.strip("。！？!?，, ")) <= 3
               and all("\u4e00" <= c <= "\u9fff" for c in r.response.strip("。！？!?，, "))][:20]
    english = [r.response for r in records if r.language == "en" and 4 <= sum(c.isalpha() for c in r.response) <= 9
               and r.response.isascii()][:20]
    assert len(chinese) >= 5 and len(english) >= 5, (chinese, english)
    for text in chinese:
        assert contradicting_script("en", text) is None  # under prepare's ten letters
        assert wrong_script("en", text) == "han" and wrong_script("zh", text) is None, text
    for text in english:
        assert wrong_script("zh", text) == "latin" and wrong_script("en", text) is None, text
    lone = next(r.response for r in records if r.language == "zh" and len(r.response.strip("。！？!?，, ")) == 1
                and "\u4e00" <= r.response.strip("。！？!?，, ") <= "\u9fff")
    assert wrong_script("en", lone) is None and wrong_script("zh", "OK") is None


def test_an_english_question_answered_with_foreign_names_stays_english_and_a_dutch_row_does_not(tmp_path):
    """PolyAlign sample rows its authors label English, read with no `language:` (lingua installed): an English
    question answered "Cléopâtre from director Georges Méliès", one answered with a list of Italian prime
    ministers, and "Yes" to an English passage about Amelanchier were dropped as fr, it and it (lingua's
    trigrams were 99% sure of the answer and of the whole row, and an alpaca row's passage was left out of
    the text its language is read from). Their English prompts keep them en; the sample's Dutch row is still
    left out, as language_not_in_scheme:nl."""
    from polyalign.data.prepare import prepare
    from tests.conftest import SHARED_DATA

    sample = json.loads((SHARED_DATA / "en/polyalign-sample/dist_sft_val.json").read_text(encoding="utf-8"))
    starts = ("The oldest film set in ancient Egypt", ". Giorgia Meloni", "Yes", "De dag dat Jezus")
    rows = [next(r for r in sample if r["output"].startswith(start) and (start != "Yes" or "Amelanchier" in r["input"]))
            for start in starts]
    assert {r["bucket_id"].split("|")[0] for r in rows} == {"en"} and "Méliès" in rows[0]["output"]
    (tmp_path / "rows.json").write_text(json.dumps(rows), encoding="utf-8")
    config = write_config(tmp_path / "data.yaml", [{"name": "sample", "format": "llamafactory", "path": "rows.json",
                                                    "split": "train"}], dedup=False)
    manifest = prepare(config, tmp_path / "run", progress=False)
    kept = [json.loads(line) for line in (tmp_path / "run/data/train.jsonl").read_text().splitlines()]
    assert [r["response"][:12] for r in kept] == [r["output"][:12] for r in rows[:3]]
    assert {r["language"] for r in kept} == {"en"}
    assert manifest["sources"][0]["dropped"] == {"language_not_in_scheme:nl": 1}


def test_inline_code_that_wraps_onto_a_second_line_is_no_language():
    """A COIG-CQIA SegmentFault question quoting a Vue error in one inline code span that wraps onto a second
    line (CommonMark allows it): the span was read as English prose and the Chinese row became en. A span
    never crosses a blank line, so a stray backtick does not swallow paragraphs."""
    from tests.conftest import SHARED_DATA

    with open(SHARED_DATA / "zh/coig-cqia/segmentfault/segmentfault_upvote5_clean.jsonl", encoding="utf-8") as rows:
        row = next(r for r in map(json.loads, rows) if r["instruction"].startswith("vue项目报错如下"))
    question = f"{row['instruction']}\n{row['input']}".strip()
    span = question[question.index("`"):question.rindex("`") + 1]
    assert "\n" in span and "\n\n" not in span
    assert span not in language.prose(question) and "项目报错" in language.prose(question)
    chooser = LanguageChooser(["en", "zh"])
    assert chooser.choose(row["output"], question) == "zh"
    assert chooser.choose(row["output"], question, f"{question}\n{row['output']}") == "zh"
    assert language.prose("a `b\n\nc` d") == "a `b\n\nc` d"  # no span across a blank line
