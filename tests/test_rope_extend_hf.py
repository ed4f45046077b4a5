"""Self-Extend, ReRoPE, leaky ReRoPE and log-n inside a tiny random Llama (GQA: 4 query heads, 2 KV
heads) through transformers' attention-function registry (hf/extend.py), and Algorithm 1's
statistics computed block-wise from the model's own q and k.

Reference, per layer: the attention module's input hidden states (captured by a forward hook) go
through its own q/k/v/o projections here; q and k are rotated in complex form in Hugging Face's
half layout (pairs (i, i + d/2)) by the relative position matrix of each paper's rule, written
again here (Self-Extend: m - n below w, else floor(m/G) + w - floor(w/G) - floor(n/G); ReRoPE:
min(m - n, w); leaky: w + (m - n - w)/k), then an explicit causal softmax in float64.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

transformers = pytest.importorskip("transformers")

from hf_tiny import MAXPOS, TEXT, save_tiny  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from extrapolab.hf import HFBlockTarget, HFTarget, load_hf, open_hf, parse_rope  # noqa: E402
from extrapolab.hf.extend import ATTN, OPTS_KWARG  # noqa: E402
from extrapolab.io import UserError  # noqa: E402
from extrapolab.memory import PeakMemory  # noqa: E402
from extrapolab.model.attention import AttnOptions  # noqa: E402

SPECS = {  # --rope -> (the paper's rule parameters, log-n)
    "selfextend:2,8": ({"method": "selfextend", "G": 2, "w": 8}, False),
    "selfextend:3,9+logn": ({"method": "selfextend", "G": 3, "w": 9}, True),
    "selfextend:2,8+logn": ({"method": "selfextend", "G": 2, "w": 8}, True),
    "rerope:6": ({"method": "rerope", "w": 6}, False),
    "rerope:6+logn": ({"method": "rerope", "w": 6}, True),
    "rerope-leaky:6,4": ({"method": "rerope-leaky", "w": 6, "k": 4.0}, False),
    "logn": ({}, True),
    "linear:2+rerope:6": ({"method": "rerope", "w": 6}, False),
    "yarn:2+selfextend:2,8": ({"method": "selfextend", "G": 2, "w": 8}, False),
}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("ext") / "llama")


def _open(folder, **kw):
    return open_hf(f"hf:{folder}", device="cpu", dtype="fp32", **kw)


def _ids(model, L):
    ids = np.asarray(model.loaded.tokenizer(TEXT * 4)["input_ids"], dtype=np.int64)
    return torch.from_numpy(ids[:L])[None]


def _relative(rule, L):
    m = torch.arange(L, dtype=torch.float64)[:, None]
    n = torch.arange(L, dtype=torch.float64)[None, :]
    d = m - n
    if not rule:
        return d
    w = rule["w"]
    if rule["method"] == "selfextend":
        far = torch.floor(m / rule["G"]) + w - w // rule["G"] - torch.floor(n / rule["G"])
    elif rule["method"] == "rerope":
        far = torch.full_like(d, float(w))
    else:
        far = w + (d - w) / rule["k"]
    return torch.where(d < w, d, far)


def _projections(attn, h):
    """q [1, H, L, D], k, v [1, Hkv, L, D] and the output projection of the module, float64."""
    cfg, L = attn.config, h.shape[1]
    H = cfg.num_attention_heads
    if hasattr(attn, "query_key_value"):  # GPT-NeoX: one fused projection, [q | k | v] per head
        qkv = torch.nn.functional.linear(h, attn.query_key_value.weight.double(), attn.query_key_value.bias.double())
        q, k, v = qkv.view(1, L, H, -1).transpose(1, 2).chunk(3, dim=-1)
        return q, k, v, attn.dense
    D, Hkv = attn.head_dim, cfg.num_key_value_heads
    q = (h @ attn.q_proj.weight.double().T).view(1, L, H, D).transpose(1, 2)
    k = (h @ attn.k_proj.weight.double().T).view(1, L, Hkv, D).transpose(1, 2)
    v = (h @ attn.v_proj.weight.double().T).view(1, L, Hkv, D).transpose(1, 2)
    return q, k, v, attn.o_proj


def _reference_layer(attn, h, R, logn: bool):
    """The attention module's output for input h [1, L, C] by the paper's rule R [L, L] (module doc)."""
    cfg = attn.config
    h = h.double()
    L = h.shape[1]
    q, k, v, proj = _projections(attn, h)
    H, D = q.shape[1], q.shape[-1]
    k, v = (x.repeat_interleave(H // x.shape[1], dim=1) for x in (k, v))  # GQA: head h reads KV head h // rep
    rp = cfg.rope_parameters
    rot = int(D * rp.get("partial_rotary_factor", 1.0))  # GPT-NeoX rotates the first rot dims only
    if rp["rope_type"] == "default":
        theta, f = rp["rope_theta"] ** (-torch.arange(0, rot, 2, dtype=torch.float64) / rot), 1.0  # [rot/2]
    else:  # a rewrite (--rope linear:2 / yarn:2): transformers' own frequencies and attention factor
        inv, f = ROPE_INIT_FUNCTIONS[rp["rope_type"]](cfg, "cpu")
        theta = inv.double()
    zq = torch.complex(q[..., :rot // 2], q[..., rot // 2:rot])  # half layout
    zk = torch.complex(k[..., :rot // 2], k[..., rot // 2:rot])
    s = torch.einsum("bhmi,bhni,mni->bhmn", zq, zk.conj(), torch.exp(1j * R[..., None] * theta)).real * f * f
    s = (s + q[..., rot:] @ k[..., rot:].transpose(-1, -2)) * D ** -0.5  # f: YaRN's factor on q and k
    if logn:
        s = s * (torch.log(torch.arange(1, L + 1, dtype=torch.float64)) / math.log(MAXPOS)).clamp(min=1)[:, None]
    s = s.masked_fill(torch.triu(torch.ones(L, L, dtype=torch.bool), 1), -math.inf)
    out = (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(1, L, H * D)
    return torch.nn.functional.linear(out, proj.weight.double(), None if proj.bias is None else proj.bias.double())


def _layer_io(model, ids):
    """[(attention module, input hidden states, output)] of every layer for one forward."""
    got, hooks = [], []
    for mod in model.hf.modules():
        if type(mod).__name__ in ("LlamaAttention", "GPTNeoXAttention"):
            hooks.append(mod.register_forward_hook(
                lambda m, a, kw, out: got.append((m, (a[0] if a else kw["hidden_states"]).detach(), out[0].detach())),
                with_kwargs=True))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    return got


@pytest.mark.parametrize("spec", list(SPECS))
def test_every_layer_equals_the_papers_dense_rule(llama, spec):
    _check_layers(_open(llama, rope=spec), spec)


@pytest.mark.parametrize("spec", ["selfextend:2,8+logn", "rerope-leaky:6,4"])
def test_partial_rotary_gpt_neox_equals_the_rule(tmp_path, spec):
    """GPT-NeoX rotates only its first rotary_pct of each head: the re-rotation leaves the rest alone."""
    m = _open(save_tiny("gpt_neox", tmp_path / "neox"), rope=spec)
    assert m.hf.config.rope_parameters["partial_rotary_factor"] == 0.5
    _check_layers(m, spec)


def _check_layers(m, spec):
    rule, logn = SPECS[spec]
    assert m.loaded.attn_implementation == ATTN
    L = 110
    io = _layer_io(m, _ids(m, L))
    assert len(io) == 2
    R = _relative(rule, L)
    for attn, h, out in io:
        want = _reference_layer(attn, h, R, logn)
        assert (out.double() - want).abs().max() < 2e-5, (spec, (out.double() - want).abs().max())


def test_plain_rope_inside_the_window_and_the_merge_beyond(llama):
    """Layer 0 (same input everywhere): the tau = 1 logits of every method equal plain RoPE's for
    keys nearer than w and differ beyond; with w past the input the whole model is plain RoPE."""
    plain = _open(llama, attn=ATTN)
    ids = _ids(plain, 90)

    def layer0(model):
        rows = []
        opts = AttnOptions(logits_sink=lambda layer, lg, n: rows.append(lg) if layer == 0 else None, block_size=32)
        with torch.no_grad():
            model.hf(input_ids=ids, use_cache=False, **{OPTS_KWARG: opts})
        return torch.cat([torch.nn.functional.pad(r, (0, 90 - r.shape[-1]), value=-math.inf) for r in rows], 2)

    base = layer0(plain)
    d = torch.arange(90)[:, None] - torch.arange(90)[None, :]
    for spec, w in (("selfextend:2,8", 8), ("rerope:6", 6), ("rerope-leaky:6,4", 6)):
        got = layer0(_open(llama, rope=spec))
        near, far = (d >= 0) & (d < w), d >= w
        assert torch.allclose(got[..., near], base[..., near], atol=1e-6, rtol=0), spec
        assert (got[..., far] - base[..., far]).abs().max() > 1e-3, spec
    sdpa = _open(llama)
    with torch.no_grad():
        want = sdpa(ids)
        for spec in ("selfextend:4,95", "rerope:95", "rerope-leaky:95,8"):  # w > 89: every key is near
            got = _open(llama, rope=spec, train_length=100)(ids)
            assert (got - want).abs().max() < 2e-5, spec


@pytest.mark.parametrize("spec", ["selfextend:2,8+logn", "rerope:6", "logn", "dca:20,3"])
def test_kv_cache_generation_equals_the_full_forward(llama, spec):
    m = _open(llama, rope=spec)
    ids = _ids(m, 70)
    with torch.no_grad():
        full = m.hf(input_ids=ids, use_cache=False).logits
        out = m.hf(input_ids=ids[:, :30], use_cache=True)
        steps, cache = [out.logits], out.past_key_values
        for t in range(30, 70):
            out = m.hf(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            steps.append(out.logits)
            cache = out.past_key_values
    assert (torch.cat(steps, 1) - full).abs().max() < 2e-5


def test_temperature_and_plain_attention_through_the_registered_function(llama):
    """No extension: our function equals sdpa; hf_temperature (``scaling``) and a per-layer
    AttnOptions temperature give the same sharpened model."""
    from extrapolab.hf import hf_temperature

    ours, sdpa = _open(llama, attn=ATTN), _open(llama)
    ids = _ids(ours, 60)
    with torch.no_grad():
        assert (ours(ids) - sdpa(ids)).abs().max() < 2e-5
        with hf_temperature(sdpa, [0.5, 0.8]):
            want = sdpa(ids)
        got = ours.hf(input_ids=ids, use_cache=False, **{OPTS_KWARG: AttnOptions(temperature=(0.5, 0.8))}).logits
        assert (got - want).abs().max() < 2e-5
        with hf_temperature(ours, [0.5, 0.8]):
            assert (ours(ids) - want).abs().max() < 2e-5


@pytest.mark.parametrize("propagate", [True, False])
@pytest.mark.parametrize("spec", [None, "rerope:6"])
def test_blockwise_statistics_equal_the_eager_probabilities(llama, propagate, spec):
    """Algorithm 1's P_max, entropy and layer-0 average logit vector: block-wise from q, k through the
    registered function == from eager [B, H, L, L] probabilities (ReRoPE: eager on a plain model
    cannot show it, so the reference there is the same function with one block per layer)."""
    from extrapolab.align import collect_logit_stats

    block = _open(llama, attn=ATTN, rope=spec)
    ref = _open(llama, attn="eager") if spec is None else block
    segs = _ids(block, 128).reshape(2, 64).numpy()
    taus = [1.0, 0.8, 0.6]
    got = collect_logit_stats(HFBlockTarget(block, block_size=16), segs, taus, propagate=propagate, layer0=True,
                              batch_size=2)
    tgt = HFTarget(ref) if spec is None else HFBlockTarget(ref, block_size=64)
    want = collect_logit_stats(tgt, segs, taus, propagate=propagate, layer0=True, batch_size=2)
    for key in ("pmax", "entropy"):
        assert np.allclose(got[key], want[key], rtol=1e-5, atol=1e-6), key
    assert np.allclose(got["per_layer_pmax"], want["per_layer_pmax"], atol=1e-5)
    assert got["softmaxes"] == want["softmaxes"] == 2 * 2 * 4 * 64
    if "layer0" in want:
        assert got["layer0"]["sigma"] == pytest.approx(want["layer0"]["sigma"], rel=1e-5)
        assert got["layer0"]["length"] == pytest.approx(want["layer0"]["length"], rel=1e-6)
    with pytest.raises(UserError, match=ATTN):
        HFBlockTarget(_open(llama))


class Largest(TorchFunctionMode):
    """Records the element count of the largest tensor any torch call returns inside the block."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_long_input_never_materialises_LxL(llama):
    """2,048 tokens, 4 heads: no tensor of the two-pass forward or of the block-wise statistics holds
    more than one query block of logits [H, 64, L] (an [L, L] one would be 64 times that), and the
    forward's peak memory stays far below one [4, L, L] fp32 score tensor (64 MiB)."""
    from extrapolab.align.temperature import SoftmaxStats

    L = 2048
    m = _open(llama, rope="selfextend:4,16", train_length=MAXPOS)
    ids = torch.randint(0, 300, (1, L), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), PeakMemory() as mem, Largest() as big:
        m.hf(input_ids=ids, use_cache=False, logits_to_keep=1)
    assert mem.mib < 32 and big.numel < L * L, (mem.mib, big.numel)
    target = HFBlockTarget(m, block_size=64)
    sink = SoftmaxStats(target.num_layers, [1.0, 0.7], layer0=True)
    with torch.no_grad(), target.scope(0.7, sink), Largest() as big:
        target.forward(ids)
    assert big.numel <= 4 * 64 * L * 2, big.numel  # [H, 64, L] logits (int64 quantile indices: 2 words)
    assert sink.summary()["softmaxes"] == 2 * 4 * L


def test_rope_syntax_and_run_record(llama, tmp_path):
    s = parse_rope("yarn:2+selfextend:4,16+logn")
    assert s.rewrite == ("yarn", 2.0) and s.method == "selfextend" and s.params == {"G": 4, "w": 16} and s.logn == 0
    assert parse_rope("rerope-leaky:8").params == {"w": 8} and parse_rope("logn:4096").logn == 4096
    m = _open(llama, rope="selfextend:4,16+logn")
    rec = m.loaded.info["rope_extension"]
    assert rec == {"method": "selfextend", "w": 16, "G": 4, "max_length": (MAXPOS - 16) * 4 + 16, "logn": MAXPOS}
    assert json.loads(json.dumps(m.hf.config.to_dict()))["extrapolab_rope"]["G"] == 4
    defaults = _open(llama, rope="rerope-leaky").loaded.info["rope_extension"]
    assert defaults == {"method": "rerope-leaky", "w": MAXPOS // 8, "k": 16.0}
    from extrapolab.hf import default_out

    assert str(default_out(m.loaded)).endswith("hf-llama-selfextend4_16-logn")


@pytest.mark.parametrize("bad,match", [
    ("selfextend", "group size"), ("selfextend:4,1000", "1 <= w < L_tr"), ("rerope:0", "1 <= w < L_tr"),
    ("rerope-leaky:8,0.5", "k must be"), ("rerope:6+selfextend:2", "one two-pass"), ("dynamic:2+rerope:6", "dynamic"),
    ("selfextend:2.5", "whole numbers"), ("logn:1", "L >= 2"), ("rerope:6,7", "at most 1"), ("lognn", "joined by"),
])
def test_bad_rope_specs_fail_in_one_line(llama, bad, match):
    with pytest.raises(UserError, match=match) as err:
        _open(llama, rope=bad)
    assert "\n" not in str(err.value)


def test_non_rope_model_and_padding_are_refused(tmp_path, llama):
    gpt2 = save_tiny("gpt2", tmp_path / "gpt2")
    with pytest.raises(UserError, match="RoPE models"):
        _open(gpt2, rope="rerope:6")
    m = load_hf(f"hf:{llama}", device="cpu", dtype="fp32", rope="rerope:6")
    ids = torch.ones(2, 20, dtype=torch.long)
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, :5] = 0
    with pytest.raises(UserError, match="padded"):
        m.model(input_ids=ids, attention_mask=mask)


def test_cli_eval_and_align_record_the_extension(llama, tmp_path):
    """`eval` and `align` (block-wise statistics) with --rope on hf:PATH, recorded in their results."""
    from typer.testing import CliRunner

    from extrapolab.cli.main import app

    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(12):
        (docs / f"d{i:02d}.txt").write_text(f"doc {i}\n" + TEXT[i * 40:] + TEXT[: i * 40])
    sets = [x for kv in (f"data.corpus=path:{docs}", f"data.cache_dir={tmp_path / 'cache'}", "data.test_percent=50",
                         "data.valid_percent=10", "eval.num_tokens=300") for x in ("--set", kv)]
    out = tmp_path / "out"
    args = ["--rope", "selfextend:2,16+logn", "--out", out, "--device", "cpu", *sets]
    r = CliRunner().invoke(app, [str(a) for a in ["eval", f"hf:{llama}", "--lengths", "96", "--protocol",
                                                  "nonoverlapping", *args]], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert not (out / "eval.json").exists()  # the extension has its own file, never the plain one
    model = json.loads((out / "eval-rope-selfextend2_16-logn.json").read_text())["model"]
    assert model["rope"] == "selfextend:2,16+logn" and model["attn_implementation"] == ATTN
    assert model["rope_extension"] == {"method": "selfextend", "w": 16, "G": 2, "max_length": 80, "logn": MAXPOS}
    r = CliRunner().invoke(app, [str(a) for a in ["align", f"hf:{llama}", "--lengths", "96", "--segments", "1",
                                                  *args]], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    res = json.loads((out / "temperature.json").read_text())
    assert res["model"]["rope_extension"]["method"] == "selfextend" and 0.5 <= res["tau"]["pmax"]["96"] <= 1.0
    r = CliRunner().invoke(app, ["eval", f"hf:{llama}", "--rope", "selfextend:4,48", "--lengths", "96", *sets])
    assert r.exit_code == 2 and "rope" in r.output.lower()
