"""T2 retrieval tasks: reproducible generation, recoverable answers, exact-match scoring."""
from pathlib import Path
import re

import numpy as np
import pytest
import torch

from extrapolab.data.tokenizer import BPECodec, BytesCodec, train_bpe
from extrapolab.align import temperature_scope
from extrapolab.tasks import retrieval as R
from extrapolab.io import UserError
from extrapolab.model.gpt import GPT, ModelConfig


@pytest.fixture(scope="module")
def bpe():
    text = [" ".join(R.JUNK) * 3, "line 1234: value 56789\nWhat is the value of line 42? The pass key is 7.",
            R.TEMPLATES["passkey"][0], R.TEMPLATES["kv"][0]] * 5
    return BPECodec(train_bpe(text, 320))


def parse(kind: str, text: str) -> str:
    """Brute-force reader: the answer as a human would find it in the prompt text."""
    if kind == "passkey":
        keys = set(re.findall(r"pass key is (\d{5})\.", text)) | set(re.findall(r"(\d{5}) is the pass key", text))
        assert len(keys) == 1
        return " " + keys.pop()
    table = dict(re.findall(r"^line (\d+): value (\d+)$", text, flags=re.M))
    asked = re.findall(r"What is the value of line (\d+)\?", text)
    assert len(asked) == 1 and len(table) == len(re.findall(r"^line ", text, flags=re.M))  # distinct keys
    return " " + table[asked[0]]


@pytest.mark.parametrize("kind", R.KINDS)
@pytest.mark.parametrize("tok_name", ["bytes", "bpe"])
def test_generation_is_reproducible_and_answer_recoverable(kind, tok_name, bpe):
    tok = BytesCodec() if tok_name == "bytes" else bpe
    lengths, depths = [300, 700], [0.0, 0.5, 1.0]
    a = R.make_examples(kind, lengths, depths, 3, seed=5, tokenizer=tok)
    assert [e.to_dict() for e in a] == [e.to_dict() for e in R.make_examples(kind, lengths, depths, 3, 5, tok)]
    assert [e.value for e in a] != [e.value for e in R.make_examples(kind, lengths, depths, 3, 6, tok)]
    one = R.make_examples(kind, [700], depths, 3, seed=5, tokenizer=tok)  # cells do not depend on the others
    assert [e.to_dict() for e in one] == [e.to_dict() for e in a if e.target_length == 700]
    unit = max(len(tok.encode(" " + s)) for s in R.JUNK) if kind == "passkey" else len(tok.encode("line 9999: value 99999\n"))
    for e in a:
        text = tok.decode(e.prompt)
        assert parse(kind, text) == tok.decode(e.answer) == " " + e.value
        assert e.target_length - 2 * unit - 4 <= e.length <= e.target_length  # filled up to the length
        assert e.length == len(e.prompt) + len(e.answer)
        needle = f" The pass key is {e.value}" if kind == "passkey" else f"line {e.key}: value {e.value}"
        assert tok.decode(e.prompt[e.needle_pos:]).startswith(needle)
    for L in lengths:  # the needle moves from the start to the end with the depth
        pos = [np.mean([e.needle_pos / e.length for e in a if e.target_length == L and e.depth == d]) for d in depths]
        assert pos[0] < pos[1] < pos[2]
    assert pos[0] < 0.25 and pos[2] > 0.75


def test_too_short_lengths_are_refused():
    with pytest.raises(UserError, match="too short for the passkey task"):
        R.make_examples("passkey", [100], [0.5], 1)
    with pytest.raises(UserError, match="unknown retrieval task"):
        R.make_examples("topic", [1000], [0.5], 1)
    with pytest.raises(UserError, match="too short"):
        R.retrieval_stream("kv", 1000, 40, tokenizer=BytesCodec())


def test_training_stream(bpe):
    for tok in (BytesCodec(), bpe):
        s = R.retrieval_stream("mix", 6000, 256, seed=3, tokenizer=tok)
        assert s.dtype == np.uint16 and s.size == 6000
        assert np.array_equal(s, R.retrieval_stream("mix", 6000, 256, seed=3, tokenizer=tok))
        docs = np.split(s, np.flatnonzero(s == tok.eot_id) + 1)[:-1]  # complete documents
        assert len(docs) >= 20 and all(len(d) <= 256 for d in docs)
        kinds = set()
        for d in docs:
            text = tok.decode(d[:-1])
            kind = "kv" if "line" in text else "passkey"
            kinds.add(kind)
            q = text.rfind(" is ") + 3  # the answer follows the question's last " is"
            assert parse(kind, text[:q]) == text[q:]
        assert kinds == {"kv", "passkey"}


class Oracle(torch.nn.Module):
    """Knows each prompt's answer; puts the next answer token on top."""

    def __init__(self, examples, vocab):
        super().__init__()
        self.answers = {tuple(e.prompt): e.answer for e in examples}
        self.lens = {len(e.prompt) for e in examples}
        self.vocab = vocab

    def forward(self, idx):
        out = torch.zeros(idx.shape[0], idx.shape[1], self.vocab)
        for b, row in enumerate(idx.tolist()):
            n = next(n for n in self.lens if n <= len(row) and tuple(row[:n]) in self.answers)
            out[b, -1, self.answers[tuple(row[:n])][len(row) - n]] = 1.0
        return out


@pytest.mark.parametrize("kind", R.KINDS)
def test_scoring_oracle_is_perfect_and_random_model_fails(kind, tmp_path):
    ex = R.make_examples(kind, [260, 400], [0.0, 1.0], 2, seed=0)
    recs = R.evaluate(Oracle(ex, 257), ex, {"none": None})
    assert len(recs) == len(ex) and all(r["correct"] for r in recs)
    rand = GPT(ModelConfig(vocab_size=257, layers=1, heads=2, dim=16, scheme="alibi")).eval()
    with pytest.raises(ValueError, match="scope"):  # tasks/ knows no temperature: the caller applies it
        R.evaluate(rand, ex, {"tau0.5": {260: 0.5, 400: 0.5}})
    recs = R.evaluate(rand, ex, {"none": None, "tau0.5": {260: 0.5, 400: 0.5}}, batch_size=4, scope=temperature_scope)
    assert not any(r["correct"] for r in recs)
    assert {r["tau"] for r in recs if r["rule"] == "tau0.5"} == {0.5}
    Ls, Ds, acc = R.accuracy_grid(recs, "none")
    assert Ls == [260, 400] and Ds == [0.0, 1.0] and (acc == 0).all()
    table = R.retrieval_table(recs + R.evaluate(Oracle(ex, 257), ex, {"oracle": None}))
    assert "| oracle | 100 | 100 | 100 |" in table and "| none | 0 | 0 | 0 |" in table
    for p in R.plot_heatmap(recs, tmp_path / "heat"):
        assert Path(p).stat().st_size > 1000


class _Piece:
    """A SentencePiece-like toy codec: a space is glued to the word after it ('▁12' style), digits
    one by one; so the separator is never a token of its own."""

    def __init__(self):
        self.vocab: dict[str, int] = {}

    def encode(self, text):
        out, word = [], ""
        for ch in text:
            if ch == " " or (ch.isdigit() and word and not word.endswith(" ")):
                if word:
                    out.append(word)
                word = ch
            else:
                word += ch
        if word:
            out.append(word)
        return [self.vocab.setdefault(w, len(self.vocab)) for w in out]


@pytest.mark.parametrize("tok_name", ["bytes", "bpe", "piece"])
def test_answer_ids_are_the_value_as_it_follows_the_prompt(tok_name, bpe):
    """The answer is tokenized as it reads after the answer prefix (joint encoding), and ``lead``
    marks the separator only where the tokenizer encodes it alone: the scorer can tell the value
    from the word a model puts first (the cause of the study's low passkey, docs/results)."""
    tok = {"bytes": BytesCodec(), "bpe": bpe, "piece": _Piece()}[tok_name]
    a, lead = R.answer_ids(tok, "The pass key is", "17759")
    joint, head = tok.encode("The pass key is 17759"), tok.encode("The pass key is")
    assert list(joint[:len(head)]) == list(head) and a == list(joint[len(head):])
    sep = list(tok.encode(" "))
    if tok_name == "bytes":
        assert lead == 1 and a == [32, *b"17759"]
    elif tok_name == "piece":
        assert lead == 0 and len(a) == 5  # '▁1', '7', '7', '5', '9': no separator token to tell apart
    else:
        assert lead in (0, len(sep)) and (lead == 0) == (a[:len(sep)] != sep)
    for e in R.make_examples("passkey", [300], [0.5], 2, seed=1, tokenizer=tok):
        assert e.lead == lead and e.answer == R.answer_ids(tok, "\nWhat is the pass key? The pass key is",
                                                           e.value)[0]


def test_teacher_forced_value_and_greedy_answer_tell_the_separator_apart():
    """A model that knows the key but starts its answer with another word (SmolLM2-Instruct after
    "The pass key is": " a") fails greedy exact match and the whole-answer teacher-forced match
    alike, and retrieves the value: the two numbers the extension study reports."""
    from extrapolab.extend.cells import passkey_records

    ex = R.make_examples("passkey", [300], [0.0, 1.0], 1, seed=2)
    assert all(e.lead == 1 for e in ex)
    WORD = ord("a")

    class LeadFirst(torch.nn.Module):  # knows the value; at the separator's step prefers "a"
        def forward(self, idx, opts=None):
            out = torch.zeros(idx.shape[0], idx.shape[1], 257)  # [B, n, V]
            for b, row in enumerate(idx.tolist()):
                e = next(e for e in ex if row[:len(e.prompt)] == e.prompt)
                for t in range(len(e.prompt) - 1, len(row)):  # position t predicts token t + 1
                    j = t + 1 - len(e.prompt)  # answer index
                    if j < len(e.answer):
                        out[b, t, e.answer[j]] = 1.0
                        if j < e.lead:
                            out[b, t, WORD] = 2.0
            return out

    recs = passkey_records(LeadFirst(), ex, 1.0)
    assert all(r["retrieved"] and not r["correct"] and not r["lead_ok"] for r in recs)
    assert all(r["pred"][0] == WORD and r["pred"][1:] == r["answer"][1:] for r in recs)
    greedy = R.score(LeadFirst(), ex)  # greedy decoding says what the whole-answer match says
    assert [g["correct"] for g in greedy] == [r["correct"] for r in recs] == [False, False]
