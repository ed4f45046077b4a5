"""RULER's generators (tasks/ruler) against NVIDIA/RULER's own scripts and against its rules.

REFERENCE holds what NVIDIA/RULER's scripts at c3f5e3b (niah.py, variable_tracking.py,
common_words_extraction.py, freq_words_extraction.py) wrote for each task at --max_seq_length 2048
with --num_samples 1 and --random_seed 42 / 43 (= sample 0 / 1 here), with this test's tokenizer
(ruler_tiny.ruler_tokenizer, saved with save_pretrained, --tokenizer_type hf), the template of
synthetic.yaml + constants.py (model template "base"), PaulGrahamEssays.json replaced by
ruler_tiny.essay_text() and nltk's sent_tokenize by our regex splitter (the only two substitutions):
sha256 of input + answer_prefix (first 16 hex digits), outputs, length. That is prepare.py's
``--chunk_amount 2`` (chunk i seeded 42 + i), our default seeding.

STREAM holds samples 1 and 2 of what prepare.py writes with --num_samples 3 and its default
--chunk_amount 1 (one stream seeded 42, one search; sample 0 is REFERENCE's seed-42 sample), under the
same substitutions: ``seeding="stream"``.
"""
import hashlib
import random
import re

import pytest

pytest.importorskip("wonderwords")
transformers = pytest.importorskip("transformers")

from ruler_tiny import NOISE, essay_text, ruler_tokenizer  # noqa: E402

from extrapolab.data.tokenizer import BytesCodec  # noqa: E402
from extrapolab.io import UserError  # noqa: E402
from extrapolab.tasks.ruler import TASKS, ruler_samples  # noqa: E402
from extrapolab.tasks.ruler.niah import DEPTHS  # noqa: E402
from extrapolab.tasks.ruler.prompt import PromptFormat  # noqa: E402
from extrapolab.tasks.ruler.text import AdjNounWords, split_sentences, wonderwords_list  # noqa: E402

REFERENCE = {
    "niah_single_1": [("c6fecac5f673deac", ["4612365"], 2038), ("5b15c64b41c7c0b8", ["2065883"], 2029)],
    "niah_single_2": [("3678544dee0c2e35", ["2322047"], 2039), ("bc1d5b478c3440ad", ["5498425"], 1354)],
    "niah_single_3": [("39776d4ba83c3e96", ["ece66fa2-fd51-46e6-851b-4cf36123fdf7"], 2036),
                      ("186e56a56a81d564", ["9a1394ff-6a38-4a4e-b770-2500791aa55f"], 1365)],
    "niah_multikey_1": [("05d865b4879923bc", ["4374754"], 1344), ("2ad4e27550231f0a", ["1167625"], 1360)],
    "niah_multikey_2": [("1e8c166ff77bb017", ["9186400"], 2037), ("207c12ba69315d7b", ["2935740"], 2002)],
    "niah_multikey_3": [("863bfd4b7241ebb5", ["7428a656-b3ee-4d3b-9a10-412954aebd1b"], 2025),
                        ("986fcb7048945c33", ["a5048de4-ca00-4807-b47e-10901e0df905"], 1991)],
    "niah_multivalue": [("1c7cd3b9618ae34b", ["7273233", "3710343", "9897858", "1009594"], 1389),
                        ("05b5824329bcb28e", ["1456435", "1398352", "9570420", "9450005"], 1387)],
    "niah_multiquery": [("29016bfac3a03e01", ["4194548", "8935169", "3219824", "8930103"], 2029),
                        ("13b00fe1b594e71f", ["5474985", "2076811", "8691081", "3337817"], 1363)],
    "vt": [("1880bfdf651defd1", ["MLFMX", "UECNQ", "IVTRF", "FAGMW", "BKQFS"], 1922),
           ("848b048b69c24a17", ["XMNEC", "LMFPG", "MKZIC", "YNSTX", "TURVU"], 2048)],
    "cwe": [("61a60d20919688eb", ["motionless", "slice", "pyridine", "roundabout", "halting", "cocoa", "boom",
                                  "lasagna", "hiking", "finalize"], 1954),
            ("c00fe511d3d80a18", ["force", "cloak", "decadence", "rightful", "feeling", "estate", "status", "identity",
                                  "neuropathologist", "ruling"], 1998)],
    "fwe": [("a5180246a2182eaa", ["vspzra", "cohpsf", "gsayns"], 1832),
            ("22534b649de9a826", ["ejqinn", "xypgub", "vjzjlj"], 1853)],
}

STREAM = {
    "niah_single_1": [("cddd6ef2d41de913", ["7374122"], 2038), ("12ec4781df04eacc", ["5437923"], 2038)],
    "niah_single_2": [("8f9420c1f5401af9", ["7067228"], 2048), ("82e39fe114521058", ["2166941"], 2042)],
    "niah_single_3": [("390a86e7e72f5797", ["c6a7ee39-c4b0-42cc-97c5-24a55304317f"], 2031),
                      ("d933b09aebf7d16a", ["366eb16f-508e-4ad7-b7c9-3acfe059a0ee"], 1342)],
    "niah_multikey_1": [("919cc94df018fbeb", ["5672073"], 1362), ("5ce3705fd73f5134", ["2626229"], 2043)],
    "niah_multikey_2": [("652ae7f20c761007", ["7232293"], 2004), ("28958b0359a8f8b3", ["2919549"], 2032)],
    "niah_multikey_3": [("ceb32dcfe760cf19", ["9918ee46-1497-4658-b010-f7197e695d0d"], 1975),
                        ("155a5bb7b13642c3", ["3d225c30-b28f-41de-bb14-0bc3304b8590"], 1985)],
    "niah_multivalue": [("e5ca8676128e7b70", ["8973915", "3770370", "5446912", "9852897"], 1366),
                        ("b59490c8120e1c7b", ["6229731", "7693979", "7264956", "8350099"], 2042)],
    "niah_multiquery": [("332a957052f8f02c", ["2642635", "4965789", "8434500", "1247595"], 1371),
                        ("3808e067cffe64bf", ["1036161", "5785687", "9164991", "5449368"], 2031)],
    "vt": [("2aa28ba04f6b7441", ["WYKTO", "PFFLA", "IRKEM", "DQAKO", "AQDMB"], 1922),
           ("d1003ce83edd31de", ["SLTZH", "VNMLT", "GWVCW", "GMPJA", "WEFUI"], 1919)],
    "cwe": [("f5de9b3211c5478c", ["muscle", "vodka", "doctor", "depressed", "broadcast", "creative", "play",
                                  "teammate", "pelt", "tasteless"], 2029),
            ("dee5b59e4dda99ea", ["trachoma", "lunch", "clan", "albatross", "allowance", "compass", "dredger",
                                  "displacement", "prisoner", "rid"], 2047)],
    "fwe": [("820d58c1f3371a5e", ["vkbqbd", "csmtrq", "jawefu"], 1909),
            ("e3fa1138e2662524", ["vbehto", "cqwlsx", "hyvoli"], 1874)],
}


@pytest.fixture(scope="module")
def tok():
    return ruler_tokenizer()


@pytest.fixture(scope="module")
def essay(tmp_path_factory):
    path = tmp_path_factory.mktemp("essay") / "essay.txt"
    path.write_text(essay_text())
    return str(path)


@pytest.fixture(scope="module")
def sets(tok, essay):
    return {t: ruler_samples(t, 2048, tok, 2, cache_dir=False, essay=essay) for t in TASKS}


@pytest.mark.parametrize("task", list(TASKS))
def test_samples_equal_ruler_scripts(sets, task):
    for s, (digest, outputs, length) in zip(sets[task], REFERENCE[task]):
        assert hashlib.sha256((s["input"] + s["answer_prefix"]).encode()).hexdigest()[:16] == digest
        assert s["outputs"] == outputs and s["tokens"] == length


def test_stream_seeding_equals_ruler_scripts_default_single_stream(sets, tok, essay):
    """seeding="stream" is RULER's default (--chunk_amount 1): sample 0 as the per-sample seeding's, then the
    stream's next draws at the size searched once, byte for byte; the per-sample set differs from sample 1 on."""
    for task in TASKS:
        got = ruler_samples(task, 2048, tok, 3, cache_dir=False, essay=essay, seeding="stream")
        assert got[0] == sets[task][0]
        for s, (digest, outputs, length) in zip(got[1:], STREAM[task]):
            assert hashlib.sha256((s["input"] + s["answer_prefix"]).encode()).hexdigest()[:16] == digest, task
            assert s["outputs"] == outputs and s["tokens"] == length
        assert got[1]["input"] != sets[task][1]["input"]
    with pytest.raises(UserError, match="seeding must be chunk .* or stream"):
        ruler_samples("vt", 2048, tok, 1, cache_dir=False, seeding="single")


def test_lengths_counted_in_model_tokens_with_tokens_to_generate(sets, tok):
    fmt = PromptFormat(tok)
    for task, samples in sets.items():
        for s in samples:
            assert s["ids"] == fmt.encode(s["input"] + s["answer_prefix"])
            assert s["tokens"] == len(s["ids"]) + TASKS[task].tokens_to_generate <= 2048
            assert s["target_ids"] == tok(s["target"], add_special_tokens=False)["input_ids"]


def test_niah_needles_keys_values_and_templates(sets):
    pat = re.compile(r"One of the special magic (numbers|uuids) for (\S+(?: \S+)?) is: (\S+)\.")
    for task in [t for t in TASKS if t.startswith("niah")]:
        a = TASKS[task].args
        for s in sets[task]:
            needles = pat.findall(s["input"])
            keys = {}
            for _, k, v in needles:
                keys.setdefault(k, []).append(v)
            asked = [k for k in keys if all(v in s["outputs"] for v in keys[k])]
            assert len(asked) == a["num_needle_q"]
            assert len(s["outputs"]) == a["num_needle_q"] * a["num_needle_v"]
            real = [k for k in keys if len(keys[k]) == a["num_needle_v"]]
            if a["type_haystack"] != "needle":  # the needle haystack is itself needles with random keys
                assert len(needles) == max(a["num_needle_k"], a["num_needle_q"]) * a["num_needle_v"] == \
                    sum(len(v) for v in keys.values())
            assert set(asked) <= set(real)
            kind_v = a["type_needle_v"]
            for v in s["outputs"]:
                assert re.fullmatch(r"\d{7}" if kind_v == "numbers" else r"[0-9a-f-]{36}", v)
            singular = a["num_needle_q"] * a["num_needle_v"] == 1
            noun = kind_v[:-1] if singular else kind_v
            assert s["input"].startswith(f"{'A' if singular else 'Some'} special magic {noun} ")
            assert s["answer_prefix"].endswith("mentioned in the provided text " + ("is" if singular else "are"))
            if a["type_haystack"] == "noise":
                assert all(line == NOISE for line in s["input"].split("\n")[1:-1] if not line.startswith("One of"))
            for k in asked:  # word keys are RULER's adjective-noun pairs
                if a["type_needle_k"] == "words":
                    adj, _, noun_ = k.partition("-")
                    assert adj in wonderwords_list("adjectivelist.txt") or "-" in noun_
            assert s["target"] == " " + ", ".join(sorted(s["outputs"], key=s["input"].find))


def test_essay_needles_sit_at_ruler_depths(sets):
    """Each needle starts a sentence whose index is int(len(sentences) * d / 100) for a d in DEPTHS."""
    for task in ("niah_single_2", "niah_multikey_1", "niah_multivalue"):
        for s in sets[task]:
            body = s["input"].split("\n")[1]  # the context line between instruction and question
            needle_at = [m.start() for m in re.finditer("One of the special magic", body)]
            plain = re.sub(r" ?One of the special magic \S+ for \S+ is: \S+\.", "", body)
            sents = split_sentences(plain)
            for at in needle_at:
                before = re.sub(r" ?One of the special magic \S+ for \S+ is: \S+\.", "", body[:at]).strip()
                k = len(split_sentences(before)) if before else 0
                assert any(int(len(sents) * d / 100) == k for d in DEPTHS), (task, k, len(sents))
            assert 0 <= s["depth"] <= 1 and s["token_position_answer"] > 0


def test_variable_tracking_chain_and_one_shot(sets):
    for s in sets["vt"]:
        names = s["outputs"]
        assert len(names) == 5 == len(set(names)) and all(re.fullmatch(r"[A-Z]{5}", n) for n in names)
        shot, _, task = s["input"].partition("\nMemorize and track")
        assert shot.startswith("Memorize and track") and re.search(r"assigned the value \d{5}, they are:  "
                                                                   r"[A-Z]{3}( [A-Z]{3}){4}\n$", shot)
        value = re.search(rf"VAR {names[0]} = (\d{{5}})", task).group(1)
        lines = task.split("\n")
        at = [next(i for i, line in enumerate(lines) if line.startswith(f"VAR {n} =")) for n in names]
        assert at == sorted(at)  # the chain's order is kept
        for a, b in zip(names, names[1:]):
            assert f"VAR {b} = VAR {a} " in task
        assert f"assigned the value {value} in the text above" in task and f"value {value}, they are: " in \
            s["answer_prefix"]


def test_common_words_counts(sets, tok, essay):
    for L, (common, rare) in ((2048, (6, 1)), (8192, (30, 3))):
        samples = sets["cwe"] if L == 2048 else ruler_samples("cwe", L, tok, 1, cache_dir=False)
        for s in samples:
            main = s["input"].rsplit("Below is a numbered list of words.", 1)[1]
            words = re.findall(r"\d+\. (\S+)", main.split("\nQuestion:")[0])
            counts = {w: words.count(w) for w in set(words)}
            assert {counts[w] for w in s["outputs"]} == {common}
            assert {c for w, c in counts.items() if w not in s["outputs"]} == {rare}
            assert len(s["outputs"]) == 10 and s["tokens"] <= L


def test_frequent_words_zipf_counts(sets):
    from scipy.special import zeta

    for s in sets["fwe"]:
        words = s["input"].split("coded words. ", 1)[1].split("\nQuestion:")[0].split(" ")
        counts = sorted(((words.count(w), w) for w in set(words)), reverse=True)
        assert counts[0][1] == "..." and [w for _, w in counts[1:4]] == s["outputs"]
        n = len(words)
        for k, (c, _) in enumerate(counts[:4], start=1):  # int(N k^-2 / zeta(2)), N recovered from rank 1
            N = counts[0][0] * zeta(2.0)
            assert abs(c - N * k ** -2.0 / zeta(2.0)) <= 1 + 0.02 * c
        assert n == sum(c for c, _ in counts)


def test_deterministic_cached_and_independent_of_n(tok, essay, tmp_path):
    a = ruler_samples("niah_single_2", 1024, tok, 2, cache_dir=tmp_path, essay=essay)
    files = list((tmp_path / "ruler").glob("*.json"))
    assert len(files) == 1
    b = ruler_samples("niah_single_2", 1024, tok, 2, cache_dir=tmp_path, essay=essay)  # read back
    c = ruler_samples("niah_single_2", 1024, tok, 2, cache_dir=False, essay=essay)  # drawn again
    one = ruler_samples("niah_single_2", 1024, tok, 1, cache_dir=False, essay=essay)
    assert a == b == c and one[0] == a[0]
    assert ruler_samples("niah_single_2", 1024, tok, 1, seed=7, cache_dir=False, essay=essay)[0] != a[0]


def test_chat_template_wraps_task_and_keeps_it_singular_only_inside(tok):
    head, tail = "<|im_start|>system\nYou are helpful. Some answers are short.<|im_end|>\n<|im_start|>user\n", \
        "<|im_end|>\n<|im_start|>assistant\n"
    s = ruler_samples("niah_single_1", 1024, tok, 1, chat=(head, tail), cache_dir=False)[0]
    assert s["input"].startswith(head + "A special magic number is hidden") and s["input"].endswith(tail)
    assert s["answer_prefix"].startswith(" The special magic number for ")
    assert s["tokens"] <= 1024


def test_bos_counted_when_the_tokenizer_adds_one(tok):
    from tokenizers import processors

    bos = ruler_tokenizer()
    bos.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A",
                                                                         special_tokens=[("<|endoftext|>", 0)])
    s = ruler_samples("fwe", 1024, bos, 1, cache_dir=False)[0]
    assert s["ids"][0] == 0 and s["tokens"] == len(s["ids"]) + 50 <= 1024
    assert s["ids"][1:] == tok(s["input"] + s["answer_prefix"], add_special_tokens=False)["input_ids"]


def test_extrapolab_bytes_tokenizer():
    s = ruler_samples("niah_single_1", 2048, BytesCodec(), 1, cache_dir=False)[0]
    assert s["tokens"] == len((s["input"] + s["answer_prefix"]).encode()) + 128 <= 2048


def test_adjective_noun_words_equal_rulers_sorted_list():
    adjs, nouns = wonderwords_list("adjectivelist.txt"), wonderwords_list("nounlist.txt")
    runs = [a for a in adjs if any(b != a and (b.startswith(a) or a.startswith(b)) for b in adjs)]
    pick = sorted(set(runs + random.Random(0).sample(adjs, 40) + ["ad hoc", "Early"]))
    ref = sorted(set(f"{a}-{n}" for a in pick for n in nouns))
    lazy = AdjNounWords(pick, nouns)
    assert len(lazy) == len(ref) and list(lazy) == ref and lazy[-1] == ref[-1]


def test_sentence_splitter():
    text = "Dr. Smith went home. He said e.g. this works! Is it? \"Yes.\" A. B. Jones agreed. 3 cats ran."
    sents = split_sentences(text)
    assert sents == ["Dr. Smith went home.", "He said e.g. this works!", "Is it?", "\"Yes.\"",
                     "A. B. Jones agreed.", "3 cats ran."]
    assert " ".join(sents) == text


def test_too_short_and_unknown_task(tok):
    with pytest.raises(UserError, match=r"length 300 is too short for RULER task niah_single_1: .*use lengths >= "):
        ruler_samples("niah_single_1", 300, tok, 1, cache_dir=False)
    with pytest.raises(UserError, match=r"unknown RULER task 'niah_singel_1' \(did you mean 'niah_single_1'\?\)"):
        ruler_samples("niah_singel_1", 2048, tok, 1, cache_dir=False)
    with pytest.raises(UserError, match="needs a QA data set download"):
        ruler_samples("qa_1", 2048, tok, 1, cache_dir=False)


def test_cwe_beyond_the_word_pool_is_refused():
    """RULER switches to json/english_words.json past wonderwords' 8,166 words (not shipped): refused."""
    from extrapolab.tasks.ruler.aggregate import CommonWords
    from extrapolab.tasks.ruler.text import cwe_words

    big = BytesCodec()
    gen = CommonWords(TASKS["cwe"], PromptFormat(big), 42, 10 ** 6)
    gen.words = gen.words[:5000]  # a smaller pool stands in for the 8,166 words at a length that needs more
    with pytest.raises(UserError, match="needs more than the 5000 words of wonderwords' lists"):
        gen.sample(0)
    assert len(cwe_words()) == 8166
