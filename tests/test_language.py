import pytest

from polyalign.data.language import detect_language


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
