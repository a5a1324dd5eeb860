"""Feature values against hand-computed ones (FEATURES.md, set v1)."""

import math

import pytest

from polyalign.features.response import FEATURE_NAMES, sentences, syllables, text_features


def test_feature_set_has_134_unique_names_and_every_value():
    assert len(FEATURE_NAMES) == len(set(FEATURE_NAMES)) == 134
    assert list(text_features("ok")) == list(FEATURE_NAMES)


def test_english_sentence_by_hand():
    f = text_features("Don't stop -- it's 2024! naïve café_bar")
    # sentences: "Don't stop -- it's 2024!" (24 chars, 7 tokens) and "naïve café_bar" (14 chars, 4 tokens)
    expected = {
        "char_count": 39, "char_no_space_count": 33, "whitespace_count": 6, "punctuation_count": 5,
        "digit_char_count": 4, "alphabetic_char_count": 23, "uppercase_char_count": 1, "non_ascii_char_count": 2,
        "token_count": 11, "word_token_count": 8, "unique_word_count": 8, "sentence_count": 2,
        "avg_char_per_token": 3.0, "avg_char_per_sentence": 19.5, "avg_word_length": 3.375,
        "avg_tokens_per_sentence": 5.5, "min_tokens_per_sentence": 4, "max_tokens_per_sentence": 7,
        "std_tokens_per_sentence": 1.5, "avg_sentence_char_length": 19.0, "std_sentence_char_length": 5.0,
        "short_word_count": 4, "medium_word_count": 4, "short_word_ratio": 0.5,
        "root_ttr": round(8 / math.sqrt(8), 6), "corrected_ttr": 2.0, "shannon_entropy": 3.0,
        "syllable_count": 7, "avg_syllables_per_word": 1.0,
        # wps = 8 / 2 = 4, spw = 1
        "flesch_reading_ease": round(206.835 - 1.015 * 4 - 84.6, 6),
        "flesch_kincaid_grade": round(0.39 * 4 + 11.8 - 15.59, 6),
        "gunning_fog": 1.6,
        "coleman_liau": round(0.0588 * (100 * 23 / 7) - 0.296 * (100 * 2 / 7) - 15.8, 6),
        "automated_readability_index": round(4.71 * 33 / 7 + 0.5 * 4 - 21.43, 6),
        "exclamation_mark_count": 1, "apostrophe_count": 2, "hyphen_count": 2, "punctuation_density": round(5 / 11, 6),
        "exclam_sentence_ratio": 0.5, "terminal_punctuation_ratio": 0.5, "sentence_initial_capital_ratio": 0.5,
        "title_case_token_count": 1, "lowercase_token_count": 6, "contraction_count": 2, "number_token_count": 1,
        "year_token_count": 1, "pos_x_count": 11, "pos_x_ratio": 1.0, "pos_noun_count": 0,
    }
    assert {k: f[k] for k in expected} == expected


def test_chinese_answer_by_hand():
    text = "2004年06月25日。"  # a KdConv answer (film/dev.json, dialogue 0, turn 4)
    f = text_features(text)
    expected = {
        "char_count": 12, "token_count": 7, "word_token_count": 6, "sentence_count": 1, "digit_char_count": 8,
        "alphabetic_char_count": 3, "non_ascii_char_count": 4, "punctuation_count": 1, "period_count": 1,
        "terminal_punctuation_ratio": 1.0, "year_token_count": 0, "number_token_count": 3,
        "avg_char_per_token": round(12 / 7, 6), "type_token_ratio": 1.0, "shannon_entropy": round(math.log2(6), 6),
        "flesch_reading_ease": 0.0, "coleman_liau": 0.0, "avg_word_length": round(11 / 6, 6),
    }
    assert {k: f[k] for k in expected} == expected


def test_regex_counts_follow_the_spec_examples():
    assert text_features("1999. 1990s x2005 2023年 2000-2010")["year_token_count"] == 3
    assert text_features("1ST ２nd 1st2nd 5th5")["ordinal_token_count"] == 2
    assert text_features("see https://www.x.com or http:// or www.")["url_count"] == 1
    assert text_features("a@b.c 用户@example.com a@b")["email_count"] == 2
    assert text_features("- a\n-\n* b\n-")["bullet_line_count"] == 3
    assert text_features("1. x\n2)\nA. y")["enumerated_line_count"] == 3
    assert text_features("3000 yes!!! 哈哈哈哈")["repeated_char_sequence_count"] == 3
    assert text_features("x²①")["digit_char_count"] == 2
    assert text_features("“你好”「对」『是』\"a\"")["quote_count"] == 8
    assert (text_features("a```b` c")["code_fence_count"] == 1
            and text_features("a```b` c")["inline_code_marker_count"] == 4)


def test_sentence_split_and_shape_ratios():
    text = "Wait... what?! Fine。好；ok"
    assert sentences(text) == ["Wait.", ".", ".", "what?", "!", "Fine。", "好；", "ok"]
    f = text_features(text)
    assert f["sentence_count"] == 8 and f["ellipsis_count"] == 1
    assert f["question_sentence_ratio"] == 0.125 and f["exclam_sentence_ratio"] == 0.125
    assert f["terminal_punctuation_ratio"] == 0.75 and f["sentence_initial_capital_ratio"] == 0.25
    assert f["paragraph_count"] == 1 and text_features("one\n\ntwo\nthree")["paragraph_count"] == 2


@pytest.mark.parametrize("word,count", [("table", 2), ("make", 1), ("the", 1), ("beautiful", 3), ("eye", 1),
                                        ("queue", 1), ("recipe", 2), ("rhythm", 1), ("don't", 1)])
def test_syllables(word, count):
    assert syllables(word) == count


def test_lexical_diversity_by_hand():
    f = text_features("the cat the cat the dog")
    # tokens: the cat the cat the dog -> types {the:3, cat:2, dog:1}, n = 6
    assert (f["type_token_ratio"] == 0.5 and f["hapax_ratio"] == round(1 / 6, 6)
            and f["dislegomena_ratio"] == round(1 / 6, 6))
    assert f["repeated_token_ratio"] == 0.5  # (3-1) + (2-1) over 6
    # bigrams: the-cat x2, cat-the x2, the-dog: 5 bigrams, 3 distinct, repeated (2-1)+(2-1) = 2
    assert f["distinct_2"] == 0.6 and f["repeated_bigram_ratio"] == 0.4
    assert f["distinct_3"] == 0.75  # the-cat-the, cat-the-cat, the-cat-the, cat-the-dog: 3 of 4
    assert f["max_token_frequency"] == 3 and f["max_token_frequency_ratio"] == 0.5 and f["adjacent_repeat_count"] == 0
    entropy = -(0.5 * math.log2(0.5) + (1 / 3) * math.log2(1 / 3) + (1 / 6) * math.log2(1 / 6))
    assert f["shannon_entropy"] == round(entropy, 6)


def test_empty_text_is_all_zero_and_normalisation_is_applied():
    assert all(v == 0 for v in text_features("").values())
    assert text_features("  Hello\r\n\r\n\r\nworld  ") == text_features("Hello\n\nworld")
