"""The vocabulary scored in blocks of positions (eval/core.py) equals scoring the full logits, for
every family the adapter chunks (tiny random models, a final soft-cap included), never holds more
than one block of logits, and `extrapolab bench --hf` measures E1 against a bare forward in one process."""
import json

import numpy as np
import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from hf_tiny import CHUNK_FAMILIES, MAXPOS, TEXT, save_tiny, write_tiny_gguf  # noqa: E402

from extrapolab.eval import core, last_token, nonoverlapping, positionwise, sliding  # noqa: E402
from extrapolab.hf import open_hf  # noqa: E402
from extrapolab.io import UserError  # noqa: E402


class FullLogits(nn.Module):
    """The same HF model behind only ``forward`` (full [B, L, V] logits): the unchunked reference."""

    def __init__(self, m) -> None:
        super().__init__()
        self.m, self.cfg = m, m.cfg

    def forward(self, idx, positions=None, opts=None):
        return self.m(idx, positions=positions, opts=opts)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("chunk")
    return {f: open_hf(f"hf:{save_tiny(f, root / f)}", device="cpu", dtype="fp32") for f in CHUNK_FAMILIES}


@pytest.mark.parametrize("family", CHUNK_FAMILIES)
def test_blocks_of_positions_equal_full_logits(models, family, monkeypatch):
    m = models[family]
    assert core.scores_from_hidden(m) and not core.scores_from_hidden(FullLogits(m))
    tok = np.asarray(m.loaded.tokenizer(TEXT)["input_ids"], dtype=np.int64)
    L = MAXPOS - 1
    blocks = []
    real = m.logits_from_hidden
    monkeypatch.setattr(m, "logits_from_hidden", lambda h: blocks.append(h.shape[0]) or real(h))
    monkeypatch.setattr(core, "SCORE_CHUNK_MB", 5 * m.cfg.vocab_size * 4 / 2**20)  # 5 positions per block
    runs = {}
    for name, model in (("chunked", m), ("full", FullLogits(m))):
        runs[name] = [nonoverlapping(model, tok, L, max_tokens=3 * L, batch_size=2)["nll"],
                      sliding(model, tok, L, 7, max_tokens=3 * L)["nll"],
                      last_token(model, tok, [8, L], n=5)[L],
                      positionwise(model, tok, L, n_segments=3)["nll"]]
    a, b = runs["chunked"], runs["full"]
    assert a[0] == pytest.approx(b[0], rel=1e-6) and a[1] == pytest.approx(b[1], rel=1e-6)
    assert a[2] == pytest.approx(b[2], rel=1e-6)
    np.testing.assert_allclose(a[3], b[3], rtol=1e-6)
    assert blocks and max(blocks) == 5  # never more than one block of logits at a time


def test_softcap_is_applied(models):
    m = models["gemma3_text"]
    x = torch.tensor([m.loaded.tokenizer(TEXT)["input_ids"][:20]])
    with torch.no_grad():
        full = m.hf(input_ids=x).logits
        h = m.final_hidden(x)
        ours, raw = m.logits_from_hidden(h), m.hf.get_output_embeddings()(h)
    assert float(full.abs().max()) < 0.2 and torch.allclose(ours, full, atol=1e-6)  # capped at 0.2
    assert not torch.allclose(raw, full, atol=1e-3)


def test_chunked_nll_is_cross_entropy():
    g = torch.Generator().manual_seed(0)
    h, head = torch.randn(23, 6, generator=g), nn.Linear(6, 11)
    y = torch.randint(0, 11, (23,), generator=g)
    want = torch.nn.functional.cross_entropy(head(h), y, reduction="none")
    for chunk in (1, 4, 23, 100):
        assert torch.allclose(core.chunked_nll(head, h, y, chunk), want, atol=1e-6)
    assert core.chunk_positions(49152, 64.0) == 341 and core.chunk_positions(10**9, 1.0) == 1


def test_bench_hf_e1_against_bare_forward(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from extrapolab.cli.main import app
    from extrapolab.hf.bench import bench_hf_eval, format_hf_eval

    path, _ = write_tiny_gguf(tmp_path / "b.gguf", "Q8_0", add_bos=True)
    res = bench_hf_eval(f"hf:{path}", [16, 32], windows=2, rounds=2, cache_dir=tmp_path / "c")
    m = open_hf(f"hf:{path}", cache_dir=tmp_path / "c")
    stream = torch.randint(0, m.cfg.vocab_size, (2 * 32 + 1,), generator=torch.Generator().manual_seed(32)).numpy()
    row = res["rows"]["32"]
    assert row["ppl"] == pytest.approx(nonoverlapping(m, stream, 32)["ppl"], rel=1e-6)  # the same windows
    assert len(row["e1_s"]) == len(row["bare_s"]) == 2 and row["ratio"]["rounds"] == 2
    assert row["e1_peak_mib"] > 0 and row["bare_peak_mib"] > 0 and res["meta"]["window_prefix"] == m.prefix
    assert "| 32 | 2 |" in format_hf_eval(res)
    out = tmp_path / "bench.json"
    monkeypatch.chdir(tmp_path)  # the CLI converts into ./.extrapolab-cache
    r = CliRunner().invoke(app, ["bench", "--hf", f"hf:{path}", "--lengths", "16", "--rounds", "1", "--out", str(out),
                                 "--device", "cpu"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "E1 ×bare" in r.output and json.loads(out.read_text())["rows"]["16"]["ratio"]["rounds"] == 1


def test_bench_hf_times_extensions_against_plain_e1(tmp_path):
    """--rope rows: E1 of the extended model (sharing the plain model's weights) in the same rounds,
    its ratio to plain E1 (past L_tr = 48, so log-n acts too), and the two-pass goal line for Self-Extend / ReRoPE only."""
    from extrapolab.hf.bench import bench_hf_eval, format_hf_eval

    path, _ = write_tiny_gguf(tmp_path / "b.gguf", "F32")
    res = bench_hf_eval(f"hf:{path}", [64], windows=2, rounds=2, cache_dir=tmp_path / "c",
                        ropes=["selfextend:2,8", "logn"])
    stream = torch.randint(0, res["meta"]["vocab"], (2 * 64 + 1,), generator=torch.Generator().manual_seed(64)).numpy()
    row = res["rows"]["64"]
    for spec in ("selfextend:2,8", "logn"):
        m = open_hf(f"hf:{path}", rope=spec, cache_dir=tmp_path / "c")
        x = row["ropes"][spec]
        assert x["ppl"] == pytest.approx(nonoverlapping(m, stream, 64)["ppl"], rel=1e-6)
        assert x["ppl"] != row["ppl"]  # the extension acts (the plain model's weights, its own positions)
        assert len(x["e1_s"]) == 2 and x["ratio"]["rounds"] == 2 and x["peak_mib"] > 0
    assert row["ropes"]["selfextend:2,8"]["twopass"] and not row["ropes"]["logn"]["twopass"]
    text = format_hf_eval(res)
    assert "| 64 | selfextend:2,8 |" in text and "two-pass --rope selfextend:2,8: E1" in text
    assert "two-pass --rope logn" not in text and "E1 time" in text and "peak RSS" in text


def test_bench_hf_reads_every_rope_before_loading_the_model(tmp_path, monkeypatch):
    """A bad --rope is one line before any model load or forward (a 16k warm-up costs minutes)."""
    import extrapolab.hf.bench as hb

    monkeypatch.setattr(hb, "open_hf", lambda *a, **k: pytest.fail("loaded a model before reading --rope"))
    with pytest.raises(UserError, match="KIND:FACTOR"):
        hb.bench_hf_eval("hf:/nowhere.gguf", [64], ropes=["selfextend:2,8", "yarn"])
