import pytest

from polyalign.data.bucketing import load_scheme
from polyalign.data.text import length_units, normalize, remove_cjk_spacing
from tests.conftest import SCHEME


def test_v2_unit_counts_the_issue_examples():
    assert length_units("Don't stop -- it's 2024! naïve café_bar", "v2") == 11
    assert length_units("北京是中国的首都。它有3000多年历史！", "v2") == 17


def test_v1_unit_counts_words_and_punctuation_and_treats_unspaced_chinese_as_one_token():
    # Don ' t stop - - it ' s 2024 ! naïve café_bar
    assert length_units("Don't stop -- it's 2024! naïve café_bar", "v1") == 13
    assert length_units("北京是中国的首都。", "v1") == 2


def test_v2_unit_edge_cases():
    assert length_units("２０２３年", "v2") == 2  # full-width digit run + one CJK character
    assert length_units("rock'n'roll", "v2") == 3  # rock'n, ', roll
    assert length_units("カタカナ 한국어 _", "v2") == 0  # other word characters are skipped
    assert length_units("", "v2") == 0
    with pytest.raises(ValueError, match="unknown length unit"):
        length_units("x", "v3")


def test_normalize_line_breaks_and_whitespace():
    assert normalize("  a\r\nb\rc  ") == "a\nb\nc"
    assert normalize("a\t\u00a0 b\u3000c") == "a b c"
    # U+2028, U+0085, form feed and vertical tab are whitespace inside a line, not line breaks.
    assert normalize("a\u2028b\u0085c\x0cd\x0be") == "a b c d e"
    assert normalize("a\n\n\n \n\nb") == "a\n\nb"
    assert normalize("  line one  \n   line two ") == "line one\nline two"
    assert normalize("Case Stays") == "Case Stays"


def test_remove_cjk_spacing_keeps_spaces_between_latin_words():
    assert remove_cjk_spacing("我 也 要 去 健 身 懒 半 年 了") == "我也要去健身懒半年了"
    assert remove_cjk_spacing("打 包 2 斤 牛 油 回 来 ， 谢 谢 。") == "打包2斤牛油回来，谢谢。"
    assert remove_cjk_spacing("I love you 哈 哈") == "I love you哈哈"


@pytest.mark.parametrize("length,expected", [(0, "short"), (40, "short"), (41, "medium"), (120, "medium"),
                                             (121, "long"), (240, "long"), (241, "xlong"), (10**6, "xlong")])
def test_length_bins_are_inclusive_upper_bounds(length, expected):
    assert load_scheme(SCHEME).length_bin(length) == expected


def test_a_count_of_one_is_written_in_the_singular():
    """Every count the commands print goes through counted(): "in 1 buckets" was printed by pairs import."""
    from polyalign.core.wording import counted

    assert [counted(n, "bucket") for n in (0, 1, 2)] == ["0 buckets", "1 bucket", "2 buckets"]
    assert counted(1, "cpu device") == "1 cpu device" and counted(3, "query", "queries") == "3 queries"


def test_a_sentence_continued_after_a_semicolon_keeps_an_acronym_in_capitals():
    """The demo's report line joins the comparison's first readings with semicolons: "MAUVE, ..." read as
    "mAUVE, ..."."""
    from polyalign.core.wording import continued

    assert [continued(s) for s in ("The intervals put", "MAUVE, hidden-state", "BNG: x", "A model", "")] == [
        "the intervals put", "MAUVE, hidden-state", "BNG: x", "a model", ""]
