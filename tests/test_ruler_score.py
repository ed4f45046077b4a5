"""RULER's metrics against hand-made predictions, and the scorer against plain references: KV-cached
greedy decoding equals full-context greedy decoding, teacher-forced scores equal one full forward's
(a tiny random Llama through transformers, and extrapolab's GPT)."""
import pytest
import torch

pytest.importorskip("wonderwords")
transformers = pytest.importorskip("transformers")

from ruler_tiny import essay_text, ruler_tokenizer, save_llama  # noqa: E402

from extrapolab.data.tokenizer import BytesCodec  # noqa: E402
from extrapolab.model import GPT, ModelConfig  # noqa: E402
from extrapolab.tasks.ruler import postprocess, ruler_samples, score_samples  # noqa: E402
from extrapolab.tasks.ruler import string_match_all, string_match_part  # noqa: E402
from extrapolab.tasks.ruler.prompt import PromptFormat  # noqa: E402


def test_string_match_all_and_part_by_hand():
    preds = ["The special magic numbers for happy-apple are 1234567 and 7654321.", "I do not know.",
             "7654321, 1111111", "ABC-def is: 42"]
    refs = [["1234567", "7654321"], ["1234567"], ["1234567", "7654321", "1111111", "2222222"], ["abc-DEF"]]
    # per sample: all 2/2, 0/1, 2/4 (a multi-value answer that names half the values), case-insensitive 1/1
    assert string_match_all(preds, refs) == round((100 + 0 + 50 + 100) / 4, 2) == 62.5
    assert string_match_part(preds, refs) == 75.0  # any one reference counts
    assert string_match_all(["1234567"], [["123456", "34567"]]) == 100.0  # substrings, no token boundaries
    assert string_match_all(["a b"], [["x", "y", "z"]]) == 0.0
    assert string_match_all(["The top words are: fish fish fish"], [["fish", "cat", "dog"]]) == 33.33  # 2 places


def test_postprocess_as_ruler():
    assert postprocess("  \x00 answer\tis\r\n 42 \x1f") == "answer\nis\n\n 42"
    assert postprocess("\n\n") == ""


def _full_greedy(step, ids, n, stop):
    out = []
    for _ in range(n):
        nxt = int(step(ids + out).argmax())
        out.append(nxt)
        if nxt in stop:
            break
    return out


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    return save_llama(tmp_path_factory.mktemp("llama") / "m", max_positions=4096)


@pytest.fixture(scope="module")
def llama(llama_folder):
    from extrapolab.hf import load_hf

    return load_hf(f"hf:{llama_folder}", device="cpu", dtype="fp32")


@pytest.mark.parametrize("rope", ["selfextend:4,128", "yarn:2"])
def test_cached_scoring_equals_full_forwards_with_rope(llama_folder, rope):
    """--rope methods the extension study runs RULER with: the two-pass Self-Extend through transformers'
    attention registry, YaRN through rope_parameters (L_tr 512, samples at 1,024 tokens)."""
    from extrapolab.hf import load_hf

    loaded = load_hf(f"hf:{llama_folder}", device="cpu", dtype="fp32", rope=rope, train_length=512)
    _check_against_full_forwards(loaded, ["niah_single_1"])


def test_cached_greedy_and_teacher_forcing_equal_full_forwards_hf(llama):
    _check_against_full_forwards(llama, ["niah_single_1", "fwe"])


def _check_against_full_forwards(llama, tasks):
    tok = llama.tokenizer
    fmt = PromptFormat(tok)
    # 16 decoding steps per sample: enough to compare, a few seconds on the reference path
    samples = [{**x, "tokens_to_generate": 16} for t in tasks for x in ruler_samples(t, 1024, tok, 1, cache_dir=False)]
    recs = score_samples(llama, samples, tok)
    m = llama.model
    for s, r in zip(samples, recs):
        with torch.no_grad():
            def step(ids):
                return m(input_ids=torch.tensor([ids])).logits[0, -1]

            ref = _full_greedy(step, s["ids"], s["tokens_to_generate"], fmt.stop_ids(m))
            assert r["pred"] == postprocess(fmt.decode([i for i in ref if i not in fmt.stop_ids(m)]))
            assert r["generated"] == len(ref)
            tgt = s["target_ids"]
            logits = m(input_ids=torch.tensor([s["ids"] + tgt[:-1]])).logits[0, -len(tgt):]  # [k, V]
            lp = torch.log_softmax(logits.float(), -1)[torch.arange(len(tgt)), torch.tensor(tgt)]
            assert r["tf_logprob"] == pytest.approx(float(lp.sum()), abs=2e-3)
            assert r["tf_exact"] == bool((logits.argmax(-1) == torch.tensor(tgt)).all())
            assert r["tf_tokens"] == len(tgt) and 0 <= r["tf_token_acc"] <= 1


def test_cached_greedy_and_teacher_forcing_equal_full_forwards_gpt():
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=257, dim=32, layers=2, heads=4, scheme="alibi", train_length=64)).eval()
    codec = BytesCodec()
    fmt = PromptFormat(codec)
    samples = [{**x, "tokens_to_generate": 16} for x in ruler_samples("fwe", 600, codec, 1, cache_dir=False)]
    rec = score_samples(model, samples, codec, greedy=True, teacher=True)[0]
    s = samples[0]
    with torch.no_grad():
        def step(ids):
            return model(torch.tensor([ids]))[0, -1]

        ref = _full_greedy(step, s["ids"], s["tokens_to_generate"], {codec.eot_id})
        assert rec["pred"] == postprocess(fmt.decode([i for i in ref if i != codec.eot_id]))
        tgt = s["target_ids"]
        logits = model(torch.tensor([s["ids"] + tgt[:-1]]))[0, -len(tgt):]  # [k, V]
        lp = torch.log_softmax(logits.float(), -1)[torch.arange(len(tgt)), torch.tensor(tgt)]
    assert rec["tf_logprob"] == pytest.approx(float(lp.sum()), abs=2e-3)
    hits = sum(o.lower() in rec["pred"].lower() for o in s["outputs"])
    assert rec["match"] == hits / 3 and rec["score"] == 100 * hits / 3  # unrounded: rounded at the average


def test_teacher_only_records_have_no_greedy_fields(llama):
    s = ruler_samples("niah_single_1", 1024, llama.tokenizer, 1, cache_dir=False)
    r = score_samples(llama, s, llama.tokenizer, greedy=False)[0]
    assert "tf_exact" in r and "score" not in r and "pred" not in r


def test_target_holds_every_reference(tmp_path):
    tok = ruler_tokenizer()
    (tmp_path / "essay.txt").write_text(essay_text())
    for task in ("niah_multivalue", "vt", "cwe"):
        s = ruler_samples(task, 2048, tok, 1, cache_dir=False, essay=tmp_path / "essay.txt")[0]
        assert all(o in s["target"] for o in s["outputs"])


def _ruler_string_match_all(preds, refs):
    """NVIDIA/RULER scripts/eval/synthetic/constants.py at c3f5e3b, as written there."""
    score = sum([sum([1.0 if r.lower() in pred.lower() else 0.0 for r in ref]) / len(ref)
                 for pred, ref in zip(preds, refs)]) / len(preds) * 100
    return round(score, 2)


def test_task_score_is_rounded_once_at_the_average_as_ruler():
    """RULER rounds a task's score once, at its average: fwe (3 references) with 0 and 1 of 3 found is 16.67,
    where rounding each sample to 2 places first (0, 33.33) would give 16.66; so for every mix of terms here."""
    from itertools import combinations_with_replacement

    from extrapolab.tasks.ruler.report import cell_summary, summarize

    refs = ["abcdef", "ghijkl", "mnopqr"]
    preds = {0: "none", 1: "abcdef", 2: "abcdef ghijkl", 3: "abcdef ghijkl mnopqr"}
    differ = 0
    for n in (2, 3, 4, 5):
        for hits in combinations_with_replacement(range(4), n):
            ps = [preds[h] for h in hits]
            want = _ruler_string_match_all(ps, [refs] * n)
            assert string_match_all(ps, [refs] * n) == want
            recs = [{"task": "fwe", "length": 64, "index": i, "pred": p, "match": h / 3, "score": 100 * h / 3}
                    for i, (p, h) in enumerate(zip(ps, hits))]
            assert cell_summary(recs)["score"] == want
            assert summarize(recs, ["fwe"], [64])["cells"]["fwe"][64]["score"] == want
            differ += round(sum(round(100 * h / 3, 2) for h in hits) / n, 2) != want
    assert cell_summary([{"match": 0.0}, {"match": 1 / 3}])["score"] == 16.67
    assert differ > 10  # the per-sample rounding this replaces was off in these cells


def test_cells_scored_before_the_terms_were_kept_get_them_back():
    """A stored cell whose records carry a per-sample score rounded to 2 places (and no ``match``) is summed
    from terms recomputed from its greedy outputs, so it too is rounded once."""
    from extrapolab.tasks.ruler.report import cell_summary
    from extrapolab.tasks.ruler.score import add_terms

    samples = [{"task": "fwe", "outputs": ["abcdef", "ghijkl", "mnopqr"]}] * 2
    old = [{"task": "fwe", "length": 64, "index": 0, "pred": "-", "score": 0.0},
           {"task": "fwe", "length": 64, "index": 1, "pred": "ABCDEF", "score": 33.33}]
    assert cell_summary(old)["score"] == 16.66  # what the per-sample rounding gave
    assert cell_summary(add_terms(old, samples))["score"] == 16.67
    assert old[1]["match"] == 1 / 3
