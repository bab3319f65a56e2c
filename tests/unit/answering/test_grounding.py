"""The grounding check on answers the real models gave on the sample corpus (invented figures, echoed
identifiers that do not exist, declines in the model's own words) and on answers that are right."""

import pytest
from cagflow.answering.grounding import check, figures, identifiers, is_declined, listed_figures
from cagflow.answering.prompt import DECLINED_ANSWER, document_system
from cagflow.answering.qa import QAItem, halves

SOURCE = document_system("Skerry Gateway Administrator Manual", (
    "The web console listens on port 8443. MQTT over TLS uses port 8883. The MGMT port has the static address "
    "192.168.77.1/24. Alarm E-407 means the disk is almost full. Skerry 5.1.3 fixed CVE-2024-31877. One licence "
    "pack holds 3,450 sensors. Backups run on the first Sunday of each month and are kept for twelve months. "
    "Vulnerabilities rated High must be fixed within 30 days."))


@pytest.mark.parametrize("answer", [
    "The web console listens on port 8443.",
    "Use 192.168.77.1/24 on the MGMT port.",
    "Alarm E-407 means the disk is almost full.",
    "CVE-2024-31877 was fixed in Skerry 5.1.3.",
    "A pack holds 3450 sensors.",  # thousands separator dropped
    "Backups run on the 1st Sunday and are kept for 12 months.",  # spelt-out numbers
    "Skerry 5.1 fixed it.",  # a shorter version string is still the document's
    "A CVSS score of 7.5 is High: fix it within 30 days.",  # 7.5 is the question's own quantity
])
def test_answers_whose_figures_are_in_the_source_are_answered(answer):
    verdict = check(answer, SOURCE, "What do I need to know about a CVSS score of 7.5?")
    assert verdict.answered and verdict.unsupported == () and verdict.reason is None


@pytest.mark.parametrize(("answer", "question", "unsupported"), [
    ("Harrowgate's current share price is $1.218.", "What is the share price?", ("1.218",)),
    ("The Wi-Fi password is \"password123\".", "What is the Wi-Fi password?", ("password123",)),
    ("Error code E-408 means a split cluster.", "What does error code E-408 mean?", ("e-408",)),
    ("Skerry 5.3.2 was released on 1 October 2021.", "When was Skerry 5.3.2 released?", ("5.3.2", "2021")),
    ("Port 18443 is the web console.", "Which port?", ("18443",)),  # not a match inside a longer number
    # real answers that describe the neighbour of an identifier the documents do not have
    ("Alarm E-407 means the disk is almost full.", "What does error code E-408 mean on a Skerry gateway?",
     ("e-408",)),
    ("The TCP port 9441 is used for the HTTP ingest API.", "What is TCP port 9441 used for?", ("9441",)),
    ("The poller leaked memory on exception code 0x0B.", "What went wrong with exception code 0x0A?",
     ("0x0a", "0x0b")),
])
def test_invented_figures_and_unknown_identifiers_are_unsupported(answer, question, unsupported):
    verdict = check(answer, SOURCE, question)
    assert not verdict.answered and verdict.unsupported == unsupported and verdict.reason == "unsupported_figures"


@pytest.mark.parametrize("answer", [DECLINED_ANSWER, "The document does not contain the answer.",
                                    "The passages do not mention a Wi-Fi password.",
                                    "This is not stated in the documents.",
                                    "The Wi-Fi password in the office is not provided in the document.",
                                    "The list price of an SG-800 is not mentioned in the provided text.",
                                    # after a re-ask that quoted an excerpt (engine.engine)
                                    "The list price of an SG-800 appliance is not provided in the given excerpt.",
                                    "The excerpt does not mention the office Wi-Fi password.", ""])
def test_declines_in_the_models_words_are_recognised(answer):
    verdict = check(answer, SOURCE)
    assert not verdict.answered and verdict.unsupported == ()
    assert verdict.reason == "model_declined"


def test_identifiers_are_figures_that_name_something():
    assert identifiers("What does error code E-407 mean in Skerry 5.1.3?") == ["e-407", "5.1.3"]
    assert identifiers("What is TCP port 8443 used for, and what does code 17 mean?") == ["8443", "17"]
    assert identifiers("How soon must a CVSS score of 7.5 be fixed within 30 days?") == []
    assert check("Port 8443 serves the web console.", SOURCE, "What is port 8443 used for?").answered


def test_figures_are_lower_cased_without_edge_punctuation_or_thousands_separators():
    assert figures("See E-407, port 8443. Pack of 3,450 (v5.1.3).") == ["e-407", "8443", "3450", "v5.1.3"]
    # a unit written onto its number is split off; identifiers that merely hold letters after digits are not
    assert figures("12GB, 500ms, 24h, 2.4GHz, 0x0A, 10GbE, 3DES, 1st") == ["12", "500", "24", "2.4", "0x0a",
                                                                         "10gbe", "3des", "1st"]
    # a listed figure also holds its parts, so a question's identifier is found in it
    assert listed_figures("Alarms E-401/E-402; ports 8443,8883.") == {"e-401/e-402", "e-401", "e-402",
                                                                     "8443,8883", "8443", "8883"}
    assert not is_declined("The documents contain the answer: port 8443.")


ZH_SOURCE = document_system("云帆数据网关运维手册", (
    "网页控制台监听 9443 端口，MQTT 接入使用端口7001。虚拟网关至少需要 12 GB 内存，单个文件不超过 64MB。告警 YF-E104 表示磁盘空间不足，告警 YF-E106 表示证书即将过期。"
    "本地日志保留 10 天，备份每天 02:30 执行。"))


@pytest.mark.parametrize(("answer", "question", "answered", "unsupported"), [
    ("控制台使用 9443 端口。", "控制台用哪个端口？", True, ()),
    ("MQTT 使用端口7001。", "MQTT 走哪个端口？", True, ()),  # no space between a Han character and the figure
    ("日志保留10天。", "日志保留多久？", True, ()),
    # a unit written onto its number is the same quantity as the document's "12 GB", and the other way round
    ("虚拟机至少要分配12GB内存。", "虚拟网关最少要多少内存？", True, ()),
    ("单个文件最大 64 MB。", "单个文件最大多少？", True, ()),
    ("虚拟机至少要分配16GB内存。", "虚拟网关最少要多少内存？", False, ("16",)),
    ("控制台使用 8443 端口。", "控制台用哪个端口？", False, ("8443",)),
    ("YF-E105 表示磁盘空间不足。", "告警 YF-E105 代表什么？", False, ("yf-e105",)),  # a near-miss identifier
    ("端口 9444 用于管理。", "端口9444是做什么用的？", False, ("9444",)),  # a number named by 端口
])
def test_chinese_answers_are_checked_figure_by_figure(answer, question, answered, unsupported):
    verdict = check(answer, ZH_SOURCE, question)
    assert (verdict.answered, verdict.unsupported) == (answered, unsupported)


@pytest.mark.parametrize("answer", ["文档中没有相关信息。", "文档中没有提到 YF-G500 的售价。", "手册中未提及该端口。",
                                    "抱歉，没有找到相关信息。", "提供的资料里找不到这个答案。"])
def test_chinese_declines_are_recognised(answer):
    assert is_declined(answer) and check(answer, ZH_SOURCE).reason == "model_declined"


@pytest.mark.parametrize("answer", ["没有限制，可以随时登录。", "日志保留 10 天，文档中明确写了。"])
def test_chinese_answers_that_only_sound_negative_are_not_declines(answer):
    assert not is_declined(answer)


def _item(number: int, in_scope: bool, doc_id: str | None) -> QAItem:
    return QAItem(f"q{number:03d}", "question", "answer", ("8443",), in_scope, doc_id)


def test_the_calibration_and_held_out_halves_split_every_group():
    items = [_item(n, True, "manual") for n in range(6)] + [_item(n, False, "notes") for n in range(6, 10)] + \
            [_item(n, False, None) for n in range(10, 13)]
    calibration, held_out = halves(items)
    assert {item.id for item in calibration}.isdisjoint(item.id for item in held_out)
    assert len(calibration) + len(held_out) == len(items)
    for part in (calibration, held_out):
        assert {(item.in_scope, item.answerable) for item in part} == {(True, True), (False, True), (False, False)}


def test_an_answer_is_correct_when_answered_with_its_keywords_or_declined_when_nothing_answers():
    answerable, unanswerable = _item(1, True, "manual"), _item(2, False, None)
    assert answerable.is_correct("Port 8443.") and not answerable.is_correct("Port 8443.", answered=False)
    assert not answerable.is_correct(DECLINED_ANSWER) and not answerable.is_correct("Port 443.")
    assert unanswerable.is_correct(DECLINED_ANSWER) and unanswerable.is_correct("Port 9.", answered=False)
    assert not unanswerable.is_correct("Port 9.")


def test_chinese_keywords_match_with_or_without_spaces_and_the_language_is_read_from_the_question():
    item = QAItem("z001", "控制台多久不操作会退出？", "15 分钟。", ("15分钟", "YF-E104"), True, "manual")
    assert item.language == "zh" and _item(1, True, "manual").language == "en"
    assert item.is_correct("空闲 15 分钟后退出，并记录告警 yf-e104。")
    assert not item.is_correct("空闲 150 分钟后退出，并记录告警 YF-E104。") and not item.is_correct("文档中没有相关信息。")


def test_an_answer_stating_no_figure_to_an_amount_question_is_not_declined_for_its_wording():
    """Whether an answer holds the amount asked is not read from its words: such a rule declined right answers
    on public data (SQuAD: "infinitely many primes"); only invented or off-topic figures are declined."""
    verdict = check("There are infinitely many primes.", "Euclid proved that there are infinitely many primes.",
                    "How many prime numbers are there?")
    assert verdict.answered and verdict.fired == ()


@pytest.mark.parametrize(("answer", "question"), [
    ("Backups are kept for twelve months.", "How long are backups kept?"),  # a number word
    ("Fix it within 30 days.", "How soon must a vulnerability with a CVSS score of 7.5 be fixed?"),
    ("日志保留 10 天。", "日志保留多少天？"),
    ("日志保留十天。", "日志保留几天？"),  # a Han numeral
    ("The web console listens on port 8443.", "Which port does the web console use?"),  # no amount asked
])
def test_an_answer_stating_an_amount_or_to_a_question_asking_none_is_not_held_to_it(answer, question):
    verdict = check(answer, SOURCE + ZH_SOURCE, question)
    assert verdict.answered and verdict.misses is None


POLICY = document_system("Security and Access Policy", (
    "Each customer organisation in Skerry Cloud may have at most 10 Administrator accounts. Laptops must be locked "
    "whenever they are left unattended, and screens lock automatically after 5 minutes of inactivity. Enrollment "
    "codes are single-use and expire after 60 minutes. The webhook timeout has been raised from 5 to 10 seconds. "
    "Any engineer can declare an incident by typing `/incident declare` in the chat system. Foghorn pages the "
    "on-call engineer. Vulnerability reports can be encrypted with our PGP key, published on our website."))


@pytest.mark.parametrize(("answer", "question", "source", "unsupported"), [
    # the 1.5B model's answer: the manual's 60 is minutes, wherever it writes 60
    ("The gateway's built-in MQTT broker uses a default keepalive interval of 60 seconds.",
     "What keepalive interval does the gateway's built-in MQTT broker use by default?", POLICY, ("60 seconds",)),
    ("Screens lock after sixty minutes, or 5 hours.", "When do screens lock?", POLICY, ("5 hours",)),
    ("网关保留日志 10 小时。", "日志保留多久？", ZH_SOURCE, ("10 小时",)),
    # the 1.5B model's answer: 240 is the manual's hours of buffering, not a count of events
    ("默认情况下，单个数据源每秒最多能接收 240 条事件。", "默认情况下，单个数据源每秒最多能接收多少条事件？",
     ZH_SOURCE + "本地缓存最多保存 240 小时的数据。每个数据源默认每秒最多接收 120 条事件。", ("240 条",)),
])
def test_a_number_with_another_unit_than_the_source_gives_it_is_unsupported(answer, question, source, unsupported):
    verdict = check(answer, source, question)
    assert not verdict.answered and verdict.unsupported == unsupported and verdict.reason == "unsupported_figures"


@pytest.mark.parametrize(("answer", "question"), [
    ("Enrollment codes expire after 60 minutes.", "When do enrollment codes expire?"),
    ("Codes expire after one hour, that is 60 min.", "When do enrollment codes expire?"),
    ("The old timeout was 5 seconds.", "What was the webhook timeout before?"),  # a range gives both its unit
    ("Each organisation may have at most 10 Administrator accounts.", "How many administrators may we have?"),
    ("自3月10日起，日志保留10天。", "日志保留多久？"),  # a date is not an amount of days or months
    ("The webhook timeout is 10.", "What is the webhook timeout?"),  # a bare number claims no unit
    ("Screens lock after 10 minutes.", "When do screens lock?"),  # 10 is also written without a unit there
    ("集群最多 3 个节点。", "集群最多几台网关？"),  # any measure word counts: 3 个 is the source's 3 台
    ("Yes, screens may lock after 5 hours.", "Can screens lock after 5 hours?"),  # the question's own amount
])
def test_numbers_with_the_sources_unit_or_none_pass(answer, question):
    source = POLICY + ZH_SOURCE + "新规定自3月10日起执行。集群由 3 台网关组成。"
    assert check(answer, source, question).reason != "unsupported_figures"


@pytest.mark.parametrize(("answer", "question"), [
    ("Harrowgate has at most 10 Administrator accounts.", "How many employees does Harrowgate have?"),
    ("Laptops must be locked whenever they are left unattended, and screens lock automatically after 5 minutes of "
     "inactivity.", "How long are visitor sign-in records from Harrowgate offices kept?"),
])
def test_an_amount_taken_from_a_sentence_about_something_else_is_declined(answer, question):
    verdict = check(answer, POLICY, question)
    assert not verdict.answered and verdict.misses == verdict.reason == "off_topic_figures"


@pytest.mark.parametrize(("answer", "question"), [
    ("At most 10 Administrator accounts.", "How many administrator accounts can an organisation have?"),
    ("After 5 minutes.", "How long until an unattended laptop's screen locks?"),
    # one figure on topic is enough: the other comes from a sentence about something else
    ("Screens lock after 5 minutes; at most 10 Administrator accounts.", "How long until screens lock?"),
    ("At most 10 Administrator accounts.", "Which accounts are limited?"),  # no amount asked
])
def test_an_amount_from_a_sentence_on_the_questions_topic_is_answered(answer, question):
    assert check(answer, POLICY, question).answered


def test_every_rule_that_holds_is_reported_and_only_switched_on_ones_decide():
    question = "How many sensors does one licence pack hold?"
    answer = "A pack holds 9,999 sensors."  # an invented figure
    verdict = check(answer, SOURCE, question)
    assert not verdict.answered and verdict.reason == "unsupported_figures" and verdict.fired == ("unsupported_figures",)
    switched_off = check(answer, SOURCE, question, frozenset({"unsupported_figures"}))
    assert switched_off.answered and switched_off.fired == ("unsupported_figures",) and switched_off.unsupported == ()


def test_unknown_rule_names_are_refused_with_the_known_ones():
    from cagflow.config import Config
    from cagflow.rules import RULES

    with pytest.raises(ValueError, match="unknown rule.*no_such_rule.*unsupported_figures"):
        Config.model_validate({"rules": {"disabled": ["no_such_rule"]}})
    with pytest.raises(ValueError, match="unknown rule.*no_quantity"):  # a rule that was removed
        Config.model_validate({"rules": {"disabled": ["no_quantity"]}})
    assert Config.model_validate({"rules": {"disabled": ["off_topic_figures"]}}).rules.disabled == ["off_topic_figures"]
    assert {rule.acts for rule in RULES.values()} == {"decline", "reask", "gate"}


def test_a_chinese_question_naming_someone_its_source_never_mentions_is_declined():
    source = "黄华麒，香港演员，毕业于香港大学。1981年加入丽的电视。"
    verdict = check("杨丽音1981年毕业。", source, "杨丽音是何时毕业于国光艺校戏剧科的？")
    assert not verdict.answered and verdict.reason == "question_name_absent"
    assert "question_name_absent" in verdict.fired
    assert check("1981年。", source, "黄华麒是何时加入丽的电视的？").answered
    both = frozenset({"question_name_absent", "question_terms_absent"})  # its other words are absent too
    switched_off = check("杨丽音1981年毕业。", source, "杨丽音是何时毕业于国光艺校戏剧科的？", both)
    assert switched_off.answered and switched_off.fired == ("question_name_absent", "question_terms_absent")
    # English questions are not read for names: capitals are no reliable sign of one ("Who did Emma Marry?")
    assert check("Ethelred.", "Emma married King Ethelred.", "Who did Emma Marry?").answered


def test_a_chinese_question_whose_words_its_source_mostly_lacks_is_declined():
    """CMRC 2018 unrelated questions, answered over the article the router found closest: the names of fish
    are no proper names for jieba, but the words are not there."""
    yarrow = "蓍（学名：Achillea millefolium），又名西洋蓍草、锯草，是菊科蓍属的植物。叶片像蕨类，花白色。"
    verdict = check("蓝线裸顶鲷的俗名是西洋锯草。", yarrow, "蓝线裸顶鲷的俗名是什么？")
    assert not verdict.answered and verdict.reason == "question_terms_absent"
    assert check("像蕨类。", yarrow, "蓍的叶片像什么？").answered  # its word is there ("蓍" alone is one character)
    assert check("西洋蓍草、锯草。", yarrow, "蓍又名什么？").answered  # no word of two characters to miss
    assert check("It grows in Europe.", yarrow, "Where does yarrow grow?").answered  # English is not read here


def test_a_question_s_words_are_its_content_words_not_its_asking_words():
    from cagflow.documents.text import question_words

    assert question_words("古监狱保存了几座中世纪的塔楼？") == ["监狱", "保存", "中世纪", "塔楼"]
    assert question_words("《千年女王》漫画是谁创作的？") == ["千年", "女王", "漫画", "创作"]
    assert question_words("How many towers did the old prison keep?") == []
